"""The packages import one way (import-linter's contract in pyproject.toml), every package is
named by it, and nothing but the interface sits at the top of kvbench/."""

from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvbench"
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "options.py", "errors.py"}


def _contract_layers() -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    return [name.strip() for c in contracts for layer in c.get("layers", [])
            for name in layer.split("|")]


def test_the_import_contracts_hold(capsys):
    from importlinter.application.use_cases import lint_imports
    from importlinter.configuration import configure

    configure()
    kept = lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None,
                        no_logo=True)
    assert kept, capsys.readouterr().out  # the broken contract: which module imports which


def test_every_package_and_top_module_is_in_the_contract():
    named = set(_contract_layers())
    packages = {f"kvbench.{p.name}" for p in PACKAGE.iterdir()
                if p.is_dir() and (p / "__init__.py").is_file()}
    modules = {f"kvbench.{p.stem}" for p in PACKAGE.glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert packages | modules <= named, sorted((packages | modules) - named)


def test_only_the_interface_sits_at_the_top_of_the_package():
    assert {p.name for p in PACKAGE.glob("*.py")} <= TOP_LEVEL


def test_no_module_imports_itself_round_a_circle():
    # lazy (function-level) imports included: a circle hidden inside a function is still one;
    # imports for type checking alone left out, as the import contract leaves them
    import grimp

    graph = grimp.build_graph("kvbench", cache_dir=None, exclude_type_checking_imports=True)
    circles = sorted((a, b) for a in graph.modules
                     for b in graph.find_modules_directly_imported_by(a)
                     if graph.chain_exists(importer=b, imported=a))
    assert not circles, circles


@pytest.mark.slow
def test_no_private_name_is_imported_from_another_package():
    import ast

    reached = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        own = parts[0] if len(parts) > 1 else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvbench."):
                package = node.module.split(".")[1]
                reached += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}"
                            for a in node.names if a.name.startswith("_")
                            and not a.name.startswith("__") and package != own]
    assert not reached, reached


def test_every_module_has_its_tests_in_the_map():
    # tests/map.toml (or tests/test_<name>.py) names each module's tests, and they exist
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import mutants

    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        for test in mutants.tests_for(str(path.relative_to(ROOT))):
            assert (ROOT / test.split("::")[0]).is_file(), (path, test)

"""scripts/mutants.sh's refusals: a run that cannot mutate says so and fails, never an empty
pass."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import mutants
import pytest


def test_without_mutmut_it_is_one_line_exit_2(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mutmut" else real(name, *a))
    monkeypatch.setattr(mutants.tempfile, "mkdtemp",
                        lambda **_: pytest.fail("went on to copy the checkout and run"))
    assert mutants.main(["kvbench/caches/think.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mutmut is not installed" in err and "[mutants]" in err


def test_no_module_is_exit_2(capsys):
    assert mutants.main([]) == 2
    assert "no module to mutate" in capsys.readouterr().err


def test_the_model_modules_run_their_mutants_without_the_slow_tests(tmp_path):
    def section(module, all_tests=False):
        (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
        mutants.configure(tmp_path, [module], mutants.tests_for(module), all_tests)
        text = (tmp_path / "pyproject.toml").read_text()
        return text[text.index("[tool.mutmut]"):]

    model = section("kvbench/layers/model/transformer.py")
    assert '"-m", "not cuda and not compiles and not trained and not slow"]' in model
    assert '"tests/test_transformer.py"' in model
    assert '"-m", "not cuda"]' in section("kvbench/sizing/capacity.py")
    assert '"-m", "not cuda"]' in section("kvbench/experiments/servesim/runs.py", all_tests=True)
    assert "not slow" in section("kvbench/experiments/servesim/loop.py")

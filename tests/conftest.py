import os

if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("OMP_NUM_THREADS"):
    # One thread per worker (and the processes it starts) when the workers share the cores:
    # two workers of two threads each on two cores run the suite about a fifth slower.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in Triton's interpreter, which Triton picks as it is
    # imported: set it before any test (or torch.compile) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "numba: needs numba (the splitk kernel); skipped "
                            "without it")


SLOW_MARKERS = ("slow", "compiles", "trained", "cuda")


def builds_graphs(item) -> bool:
    """Whether a test builds torch.compile graphs on the CPU: marked `compiles`, in
    test_compiled.py, or run with the compiled or flex implementation as a parameter."""
    if "compiles" in item.keywords or item.path.name == "test_compiled.py":
        return True
    params = getattr(item, "callspec", None)
    return params is not None and any(
        isinstance(v, str) and v in ("compiled", "flex") for v in params.params.values())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    import importlib.util

    # Under -n, the tests that compile run in one worker: inductor's start-up (its first
    # graph in a process takes ~10 s more than the next) is paid once, and a shape two tests
    # compile is compiled once.
    for item in items:
        if builds_graphs(item) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("inductor"))
        # the inner loop's tier (pytest -m fast): every test under a second or so
        if not (builds_graphs(item) or any(m in item.keywords for m in SLOW_MARKERS)):
            item.add_marker(pytest.mark.fast)

    if importlib.util.find_spec("numba") is None:
        no_numba = pytest.mark.skip(reason="needs numba: pip install -e \".[cpu-kernel]\"")
        for item in items:
            if "numba" in item.keywords:
                item.add_marker(no_numba)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def refused(tmp_path):
    """refused(args, command="verify"): runs `kvbench COMMAND --device cpu ARGS --csv F`; returns
    (exit status, the lines on stderr, whether any results file was written) for the test to
    judge: bad input is exit 2, one line, nothing written."""
    from typer.testing import CliRunner

    from kvbench.cli import app

    def run(args, command="verify"):
        out = tmp_path / "v.csv"
        result = CliRunner().invoke(app, [command, "--device", "cpu", *args, "--csv", str(out)])
        written = bool(list(tmp_path.glob("*.csv")))
        return result.exit_code, result.stderr.strip().splitlines(), written

    return run


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama checkpoint (hidden 64, 4 query and 2 KV heads of 32), made here."""
    transformers = pytest.importorskip("transformers")
    import torch

    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)

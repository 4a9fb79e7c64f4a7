import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.measure.allocation import CASES, allocator_model, check_allocation

MIB = 2**20

# (request bytes, allocated growth, reserved growth), worked by hand from the allocator's rules
MODEL_TABLE = [
    (1, 512, 2 * MIB),  # rounded to 512, small pool, a 2 MiB segment split
    (513, 1024, 2 * MIB),
    (MIB, MIB, 2 * MIB),  # the largest small request
    (MIB + 1, MIB + 512, 20 * MIB),  # large pool, below 10 MiB: a shared 20 MiB segment
    (9 * MIB + 100, 9 * MIB + 512, 20 * MIB),
    (10 * MIB - 512, 10 * MIB - 512, 20 * MIB),
    (10 * MIB, 10 * MIB, 10 * MIB),  # a segment of its own, exact: nothing to split
    (10 * MIB + 1, 10 * MIB + 512, 12 * MIB),  # remainder 2 MiB - 512 > 1 MiB: split
    (11 * MIB, 12 * MIB, 12 * MIB),  # remainder exactly 1 MiB is not > kSmallSize: unsplit
    (11 * MIB + 1, 12 * MIB, 12 * MIB),  # remainder < 1 MiB: unsplit, allocated = segment
    (13 * MIB + 3000, 14 * MIB, 14 * MIB),
    (2 * 2**30, 2 * 2**30, 2 * 2**30),  # the gqa case: exact
    (8 * 2**30, 8 * 2**30, 8 * 2**30),  # the mha case: exact
]


@pytest.mark.parametrize("nbytes, allocated, reserved", MODEL_TABLE)
def test_allocator_model_by_hand(nbytes, allocated, reserved):
    assert allocator_model(nbytes) == (allocated, reserved)


def test_refuses_before_allocating_when_the_margin_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2**30, 80 * 2**30))

    def must_not_allocate(shape):
        raise AssertionError("allocated despite the missing margin")

    with pytest.raises(KvbenchError, match=r"5\.00 GiB free.*need 6\.00 GiB"):
        check_allocation("gqa", **CASES["gqa"], device="cuda:0", margin_bytes=4 * 2**30,
                         allocate=must_not_allocate)


@pytest.mark.cuda
def test_both_cases_pass_on_cuda():
    for name, case in CASES.items():
        r = check_allocation(name, **case, device="cuda:0", margin_bytes=4 * 2**30)
        assert r.passed, r
        assert r.reserved_increase_bytes == r.expected_reserved_increase_bytes


@pytest.mark.cuda
def test_the_model_matches_the_real_allocator_on_cuda():
    # A fresh process, and its cache emptied between requests: no cached block of anything
    # else can serve a request, which is what the model assumes. Nothing is stubbed.
    import subprocess
    import sys

    sizes = [n for n, _, _ in MODEL_TABLE if n < 2**30]
    code = (
        "import torch\n"
        "torch.cuda.init()\n"
        f"for n in {sizes}:\n"
        "    torch.cuda.empty_cache()\n"
        "    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()\n"
        "    t = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
        "    print(torch.cuda.memory_allocated() - a0, torch.cuda.memory_reserved() - r0)\n"
        "    del t\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    measured = {n: tuple(map(int, line.split())) for n, line in zip(sizes, out)}
    assert measured == {n: allocator_model(n) for n in sizes}


@pytest.mark.cuda
def test_a_wrong_size_is_detected_on_cuda():
    # Allocating one layer fewer than the formula asks for must fail the check.
    def short(shape):
        return torch.empty((shape[0] - 1, *shape[1:]), dtype=torch.float16, device="cuda:0")

    r = check_allocation("gqa", **CASES["gqa"], device="cuda:0", margin_bytes=4 * 2**30,
                         allocate=short)
    assert not r.passed


@pytest.mark.cuda
def test_an_extra_allocation_beside_the_cache_is_detected_on_cuda():
    # The cache is right but 3 MiB more stay allocated: measured growth differs from the model.
    held = []

    def with_extra(shape):
        held.append(torch.empty(3 * MIB, dtype=torch.uint8, device="cuda:0"))
        return torch.empty(shape, dtype=torch.float16, device="cuda:0")

    r = check_allocation("gqa", **CASES["gqa"], device="cuda:0", margin_bytes=4 * 2**30,
                         allocate=with_extra)
    assert not r.passed
    assert r.allocated_increase_bytes == r.expected_increase_bytes + 3 * MIB


@pytest.mark.cuda
def test_allocation_check_is_warning_free(tmp_path):
    import subprocess
    import sys

    subprocess.run([sys.executable, "-W", "error", "-m", "kvbench", "capacity", "--allocate",
                    "--case", "both", "--csv", str(tmp_path / "allocation.csv")], check=True)


@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_refuses_under_either_allocator_setting(monkeypatch, var):
    # torch reads both names; a setting in either changes what the model predicts
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    for other in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, "expandable_segments:True")

    def must_not_allocate(shape):
        raise AssertionError("allocated under a non-default allocator")

    with pytest.raises(KvbenchError, match=f"unset {var}"):
        check_allocation("gqa", **CASES["gqa"], device="cuda:0", margin_bytes=4 * 2**30,
                         allocate=must_not_allocate)

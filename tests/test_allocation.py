import pytest
import torch

from kvbench.allocation import CASES, allocator_rounding, check_allocation
from kvbench.errors import KvbenchError


def test_allocator_rounding():
    assert allocator_rounding(1) == 512
    assert allocator_rounding(513) == 1024
    assert allocator_rounding(2 * 2**30) == 2 * 2**30  # the gqa case is exact
    assert allocator_rounding(8 * 2**30) == 8 * 2**30  # the mha case is exact
    assert allocator_rounding(11 * 2**20 + 1) == 12 * 2**20


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


@pytest.mark.cuda
def test_a_wrong_size_is_detected_on_cuda():
    # Allocating one layer fewer than the formula asks for must fail the check.
    def short(shape):
        return torch.empty((shape[0] - 1, *shape[1:]), dtype=torch.float16, device="cuda:0")

    r = check_allocation("gqa", **CASES["gqa"], device="cuda:0", margin_bytes=4 * 2**30,
                         allocate=short)
    assert not r.passed


@pytest.mark.cuda
def test_allocation_check_is_warning_free():
    import subprocess
    import sys

    subprocess.run([sys.executable, "-W", "error", "-m", "kvbench", "capacity", "--allocate",
                    "--case", "both", "--csv", "/tmp/kvbench-allocation-test.csv"], check=True)

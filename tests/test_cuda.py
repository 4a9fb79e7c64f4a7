"""CUDA paths. Marked `cuda`: skipped with a reason where no GPU is present."""

import pytest

from kvbench.config import CUDA_TIMING_CASE, SMALL_CASE, RunConfig
from kvbench.verify import verify

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rope", [False, True])
def test_every_implementation_equals_recompute_on_cuda(dtype, rope):
    for shape in (SMALL_CASE, CUDA_TIMING_CASE):
        report = verify(RunConfig(shape, dtype, "cuda:0", 0, rope))
        # splitk is the CPU kernel; every other implementation runs on CUDA
        assert [c.impl for c in report.checks] == ["concat", "static", "sdpa", "paged"]
        assert report.passed, [(c.impl, c.message) for c in report.checks]


def test_verify_rejects_a_lossy_cache_on_cuda():
    from broken import LossyCast

    report = verify(RunConfig(CUDA_TIMING_CASE, device="cuda:0"), {"lossy": LossyCast})
    assert not report.passed

"""`flashinfer`: FlashInfer's paged decode over kvbench's pool (kvbench.caches.flashinfer).
Its kernel runs on CUDA where flashinfer imports; here, its CSR view of the block tables by
hand and its refusal."""

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import ImplOptions, PagedCache
from kvbench.caches.flashinfer import FlashInferCache
from kvbench.cli import app
from kvbench.layers.attention import AttentionLayer
from kvbench.sizing.config import LayerShape, RunConfig


def test_the_block_tables_as_flashinfers_csr_arrays_by_hand():
    # pages of 4; rows of 5, 8 and 1 positions: 2, 2 and 1 pages, the last holding 1, 4, 1
    shape = LayerShape(batch=3, prompt_len=8, decode_len=1, hidden=16, q_heads=2, kv_heads=1,
                       head_dim=8, seq_lens=(5, 8, 1))
    layer = AttentionLayer.from_config(RunConfig(shape))
    cache = PagedCache(layer, 3, 9, ImplOptions(block_size=4), lens=shape.seq_lens)
    cache.prefill(torch.randn(3, 8, 16))
    indptr, ids, last = FlashInferCache.plan_arrays(cache)
    assert indptr == [0, 2, 4, 5] and last == [1, 4, 1]
    assert ids == [*cache.tables[0][:2], *cache.tables[1][:2], cache.tables[2][0]]
    assert len(set(ids)) == 5  # each sequence its own pages


def test_without_cuda_it_is_one_line_when_named_and_left_out_of_all():
    runner = CliRunner()
    named = runner.invoke(app, ["verify", "--impl", "flashinfer", "--no-csv"])
    assert named.exit_code == 2
    assert named.stderr.strip().splitlines() == [
        "kvbench: error: --impl flashinfer cannot run here: CUDA only (FlashInfer's paged "
        "decode kernel)"]
    everything = runner.invoke(app, ["verify", "--impl", "all", "--no-csv"])
    assert everything.exit_code == 0
    assert "flashinfer (CUDA only" in " ".join(everything.stderr.split())


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                    reason="flashinfer is not installed (pip install flashinfer-python)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flashinfer_equals_recompute_on_cuda(dtype):
    from kvbench.experiments.verify import verify

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is available here")
    shape = LayerShape(batch=3, prompt_len=300, decode_len=6, hidden=256, q_heads=8,
                       kv_heads=2, head_dim=128)
    report = verify(RunConfig(shape, dtype, "cuda:0"), {"flashinfer": FlashInferCache})
    assert report.passed, report.checks[0].message

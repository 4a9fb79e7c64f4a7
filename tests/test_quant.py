"""Quantized K/V layouts: round trips, packing order, and bytes equal to the planner's."""

import pytest
import torch

from kvbench.capacity import CacheFormat, ModelSpec, plan
from kvbench.quant import (
    KvFormat,
    QuantizedStore,
    dequantize_grouped,
    pack,
    quantize_grouped,
    unpack,
)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_puts_the_lower_index_in_the_lower_bits_and_unpacks_exactly(bits):
    q = torch.randint(0, 1 << bits, (3, 7), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.shape[-1] == -(-7 * bits // 8)
    assert torch.equal(unpack(packed, bits, 7), q)
    if bits == 4:
        assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("D, group", [(64, 32), (64, 64), (96, 64), (128, 128), (80, 32)])
def test_grouped_round_trip_is_within_half_a_step(bits, D, group):
    x = torch.randn(2, 3, 5, D)
    codes, scale, zero = quantize_grouped(x, bits, group)
    back = dequantize_grouped(codes, scale, zero, bits, group, D, torch.float32)
    step = scale.float().repeat_interleave(group, -1)[..., :D]
    # half a step of rounding, plus the fp16 rounding of scale and zero point
    assert ((back - x).abs() <= 0.5 * step + 2e-3 * x.abs().amax()).all()


@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "int2"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_store_bytes_equal_the_planner(name, group, D):
    B, H_kv, T = 2, 4, 37
    store = QuantizedStore(KvFormat(name, group), B, H_kv, T, D, "cpu")
    model = ModelSpec(name="t", layers=1, kv_heads=H_kv, head_dim=D)
    assert store.nbytes == plan(model, CacheFormat(name, group), (T,) * B).payload_bytes


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_store_reads_back_what_it_wrote(name):
    store = QuantizedStore(KvFormat(name, 32), 2, 2, 10, 64, "cpu")
    k, v = torch.randn(2, 2, 6, 64), torch.randn(2, 2, 6, 64)
    store.write(k, v, 0)
    store.write(k[:, :, :1] * 0.5, v[:, :, :1], 6)
    got = store.read("k", 7, torch.float32)
    tol = {"fp8": 0.3, "int8": 0.02, "int4": 0.3}[name]  # e4m3 keeps 3 mantissa bits
    assert (got[:, :, :6] - k).abs().max() < tol
    assert (got[:, :, 6:] - 0.5 * k[:, :, :1]).abs().max() < tol

from kvbench import costs
from kvbench.config import CUDA_TIMING_CASE, LayerShape


def test_reference_final_kv_is_0_5625_mib():
    s = CUDA_TIMING_CASE  # B=2, T=256+32, H_kv=2, D=64, fp32
    assert costs.kv_bytes(s, s.total_len, 4) == 589824 == int(0.5625 * 2**20)


def test_step_bytes_and_flops_by_hand():
    s = LayerShape(batch=1, prompt_len=3, decode_len=1, hidden=4, q_heads=2, kv_heads=1,
                   head_dim=2)
    # weights: W_q 4x4, W_k 4x2, W_v 4x2, W_o 4x4 = 48 elements
    assert costs.weight_elements(s) == 48
    # 48 weights + cache 2·1·4·1·2 = 16 + new kv 4 + activations 2·4 = 8 -> 76 elements
    assert costs.step_min_bytes(s, 4, 2) == 76 * 2
    # 2·48 + 4·1·2·4·2 = 96 + 64
    assert costs.step_flops(s, 4) == 160
    assert costs.decode_min_bytes_per_step(s, 2) == 152

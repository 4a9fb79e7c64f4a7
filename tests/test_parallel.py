"""A whole model across ranks (--tp, --pp): the split by hand, each rank's part summing to
the whole layer in one process, and the real thing under torch's launcher on gloo: equal to
one rank, each rank's K/V bytes and traffic equal to the planner and SPEC §20, planted faults
failing, bad input one line."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvbench.errors import KvbenchError
from kvbench.layers import attention
from kvbench.layers.model import parallel as split
from kvbench.layers.model.spec import resolve
from kvbench.layers.model.transformer import random_model
from kvbench.measure import distributed
from kvbench.sizing.parallel import Rank, pp_partition, sent_bytes_per_token, stage_ranges

TIMEOUT = 240  # a hung group must not hang the suite
FAULT = Path(__file__).with_name("ranks_fault.py")
# 4 layers, 8 query heads over 2 KV heads (TP 4 replicates each KV head on two ranks), MLP 96
CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 8, "max_position_embeddings": 256, "initializer_range": 0.2,
          "rope_theta": 500.0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp") / "tiny"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ the split, on paper


def test_stages_split_as_vllms_get_pp_indices():
    assert pp_partition(30, 3) == [10, 10, 10]
    assert pp_partition(30, 4) == [7, 8, 8, 7]  # the remainder before the last stage
    assert pp_partition(30, 2) == [15, 15] and pp_partition(5, 2) == [3, 2]
    assert pp_partition(7, 3) == [2, 3, 2] and pp_partition(8, 3) == [3, 3, 2]
    assert pp_partition(28, 3, (10, 9, 9)) == [10, 9, 9]
    assert [list(r) for r in stage_ranges([2, 3, 1])] == [[0, 1], [2, 3, 4], [5]]
    for layers, pp, given, message in [(4, 5, None, "more stages than"),
                                       (28, 3, (10, 9, 8), "sum to the model's 28"),
                                       (28, 3, (14, 14), "give 3 positive"),
                                       (3, 0, None, "positive integer")]:
        with pytest.raises(KvbenchError, match=message):
            pp_partition(layers, pp, given)


def test_a_ranks_place_by_hand():
    # TP 3 × PP 2: ranks 0-2 stage 0, 3-5 stage 1, TP innermost (vLLM's layout)
    r = Rank(4, tp=3, pp=2)
    assert (r.stage, r.tp_rank, r.first, r.last) == (1, 1, False, True)
    assert (r.previous, r.next, r.peers) == (1, None, [3, 4, 5])
    assert (Rank(2, 3, 2).next, Rank(2, 3, 2).previous) == (5, None)


def test_the_bytes_a_rank_sends_per_token_by_hand():
    # SmolLM2 (H 576) in float32, B 2: TP 3 over a stage of 15 layers: 2 all-reduces a layer
    # of 2 × 576 × 4 = 4,608 B; a stage before the last sends 4,608 B of hidden states
    assert sent_bytes_per_token(15, 2, 576, 4, 3, last=False) == {"allreduce": 138_240,
                                                                  "send": 4_608}
    assert sent_bytes_per_token(15, 2, 576, 4, 1, last=True) == {"allreduce": 0, "send": 0}


# ------------------------------------------- each rank's part sums to the whole, in-process


@pytest.mark.parametrize("tp", [2, 4])
def test_each_ranks_part_of_a_layer_sums_to_the_whole(tiny, tp, monkeypatch):
    ref = resolve(str(tiny))
    model = random_model(ref.arch, torch.float64, "cpu", seed=3)
    b = model.blocks[1]
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    from kvbench.kernels.reference import dense_causal_attention

    def attend(layer):
        q, k, v = layer.project(x, start=0)
        return layer.output(dense_causal_attention(q, k, v, layer.scale))

    monkeypatch.setattr(distributed, "all_reduce", lambda t: None)  # the partial sums, kept
    monkeypatch.setattr("kvbench.layers.attention.all_reduce", lambda t: None)
    parts = [split.shard_block(b, tp, r) for r in range(tp)]
    assert [p.attn.shape.kv_heads for p in parts] == [max(1, 2 // tp)] * tp
    assert sum(attend(p.attn) for p in parts).sub(attend(b.attn)).abs().max() < 1e-12
    mlp = random_model(ref.arch, torch.float64, "cpu", seed=3)
    assert sum(mlp.mlp(p, x) for p in parts).sub(mlp.mlp(b, x)).abs().max() < 1e-12
    # a rank reading the wrong KV head: the parts no longer sum to the layer
    right = attention.head_columns

    def shifted(s, n, r):  # K and V columns of the next rank's KV heads
        q, k, _ = right(s, n, r)
        D = s.head_dim
        held = (k.stop - k.start) // D
        first = ((k.start - s.q_heads * D) // D + held) % s.kv_heads
        k0, v0 = (s.q_heads + first) * D, (s.q_heads + s.kv_heads + first) * D
        return q, slice(k0, k0 + held * D), slice(v0, v0 + held * D)

    monkeypatch.setattr(attention, "head_columns", shifted)
    wrong = [split.shard_block(b, tp, r) for r in range(tp)]
    assert sum(attend(p.attn) for p in wrong).sub(attend(b.attn)).abs().max() > 1e-3


# ------------------------------------------------------- under the launcher, on gloo


def kvbench(*args, cwd, fault=None):
    """kvbench ARGS as a user runs it (--nproc starts the ranks), its result; `fault`:
    planted in every process it starts (tests/ranks_fault.py, through sitecustomize)."""
    path = [str(cwd)] if fault else []
    if fault:
        (cwd / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(FAULT.parent)!r})\n"
            f"import ranks_fault\nranks_fault.plant({fault!r})\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "KVBENCH_DIST_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvbench", *args], check=False,
                          capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env)


def short(model, *extra):
    return ["--model", str(model), "--prompt-len", "12", "--decode-len", "16", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [["--tp", "4", "--nproc", "4"],
                                   ["--pp", "2", "--pp-layers", "3,1", "--nproc", "2"],
                                   ["--tp", "2", "--pp", "2", "--nproc", "4"]],
                         ids=["tp4", "pp2", "tp2xpp2"])
def test_across_ranks_equals_one_rank_token_for_token(tiny, tmp_path, ranks):
    out = tmp_path / "v.csv"
    r = kvbench("verify", *short(tiny, "--impl", "static,paged", "--csv", str(out)), *ranks,
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(out)
    assert len(rows) == 2 and rows.passed.all()  # rank 0 alone writes: once each
    assert rows.one_rank_tokens_equal.all() and (rows.one_rank_max_abs_err < 1e-4).all()
    tp = int(ranks[ranks.index("--tp") + 1]) if "--tp" in ranks else 1
    pp = int(ranks[ranks.index("--pp") + 1]) if "--pp" in ranks else 1
    assert (rows.tp == tp).all() and (rows.pp == pp).all() and (rows.world_size == tp * pp).all()
    assert "vs 1 rank" in r.stdout and f"TP {tp} PP {pp}" in r.stdout


@pytest.mark.slow
def test_each_ranks_bytes_and_traffic_equal_the_planner_and_the_formula(tiny, tmp_path):
    out = tmp_path / "m.csv"
    r = kvbench("memory", *short(tiny, "--impl", "static", "--tp", "2", "--pp", "2",
                                 "--pp-layers", "3,1", "--nproc", "4", "--csv", str(out)),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(out).sort_values("rank")
    assert list(rows["rank"]) == [0, 1, 2, 3] and list(rows.stage) == [0, 0, 1, 1]
    assert list(rows.stage_layers) == ["0-2", "0-2", "3-3", "3-3"]
    # static reserves 28 positions; a rank: 1 KV head of 8, K and V, float32 = 64 B a
    # position a layer: 28 × 64 × 3 layers on stage 0, × 1 on stage 1
    assert list(rows.kv_cache_bytes) == [28 * 64 * 3] * 2 + [28 * 64] * 2
    assert (rows.kv_cache_bytes == rows.kv_planner_bytes).all()
    # per token: 2 all-reduces a layer of 1 × 64 × 4 B; stage 0 sends 256 B to stage 1
    assert list(rows.allreduce_bytes_per_token) == [2 * 3 * 256] * 2 + [2 * 256] * 2
    assert list(rows.send_bytes_per_token) == [256, 256, 0, 0]
    assert (rows.allreduce_bytes_per_token == rows.formula_allreduce_bytes_per_token).all()
    assert (rows.send_bytes_per_token == rows.formula_send_bytes_per_token).all()


@pytest.mark.slow
@pytest.mark.parametrize("fault, ranks", [("kv-slice", ["--tp", "2"]),
                                          ("boundary", ["--pp", "2"])])
def test_a_planted_fault_fails_verification(tiny, tmp_path, fault, ranks):
    r = kvbench("verify", *short(tiny, "--impl", "static", "--no-csv"), *ranks,
                "--nproc", "2", cwd=tmp_path, fault=fault)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "verify failed" in r.stderr


@pytest.mark.slow
def test_a_killed_rank_is_one_line_and_the_finished_rows_are_kept(tiny, tmp_path):
    out = tmp_path / "m.csv"
    r = kvbench("memory", "--model", str(tiny), "--prompt-len", "8,16", "--decode-len", "2",
                "--impl", "static", "--tp", "2", "--nproc", "2", "--csv", str(out),
                cwd=tmp_path, fault="killed")
    assert r.returncode != 0
    rows = pd.read_csv(out)  # the first point's two ranks, written before rank 1 died
    assert len(rows) == 2 and set(rows.prompt_len) == {8}
    ours = [line for line in r.stderr.splitlines() if line.startswith("kvbench:")]
    assert ours == ["kvbench: error: rank 1 ended with signal 9; the other ranks were "
                    "stopped"], r.stderr[-3000:]


@pytest.mark.slow
def test_the_launcher_stopped_says_what_rank_0_kept(tiny, tmp_path):
    # SIGTERM to `kvbench ... --nproc 2` while its ranks stall in the second point: exit
    # 143, one line, the first point's two rows kept
    import signal
    import time

    out = tmp_path / "m.csv"
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(FAULT.parent)!r})\n"
        "import ranks_fault\nranks_fault.plant('slow')\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "KVBENCH_DIST_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "kvbench", "memory", "--model", str(tiny),
                          "--prompt-len", "8,16", "--decode-len", "2", "--impl", "static",
                          "--tp", "2", "--nproc", "2", "--csv", str(out)], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + TIMEOUT
    while not (out.exists() and len(out.read_text().splitlines()) == 3):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (f"kvbench: terminated; the ranks were stopped; 2 "
                                            f"rows kept in {out}"), err[-2000:]
    assert len(pd.read_csv(out)) == 2


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "--tp 3 does not divide --q-heads 8"),
    (["--tp", "4", "--pp", "5"], "--pp 5 is more stages than the model's 4 layers"),
    (["--pp", "2", "--pp-layers", "2,1"], "sum to the model's 4 layers"),
    (["--pp-layers", "2,2"], "add --pp N"),
    (["--tp", "2"], "add --nproc 2, or start them with torchrun"),
    (["--tp", "2", "--nproc", "3"], "needs 2 ranks; use --nproc 2"),
    (["--tp", "2", "--graph", "--nproc", "2"], "--graph captures one process's step"),
])
def test_bad_input_across_ranks_is_one_line(tiny, tmp_path, args, message):
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, ["verify", *short(tiny), *args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_more_ranks_than_the_host_holds_is_refused_before_starting(tiny):
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, ["verify", *short(tiny), "--tp", "4", "--nproc", "4",
                                 "--host-mem", "1MB"])
    assert r.exit_code == 2 and "each rank holds about" in r.stderr, r.output


def test_capacity_gives_each_stages_per_rank_bytes_as_memory_measures_them(tmp_path):
    # SmolLM2 at T = 36, fp32, TP 3 × PP 2: a rank holds 1 KV head of 64 for 15 layers:
    # 36 × 15 × 2 × 64 × 4 = 276,480 B (memory measures the same per rank)
    from typer.testing import CliRunner

    from kvbench.cli import app

    out = tmp_path / "c.csv"
    r = CliRunner().invoke(app, ["capacity", "--model", "smollm2-135m", "--seq-len", "36",
                                 "--kv-dtype", "fp32", "--tp", "3", "--pp", "2", "--pp-layers",
                                 "20,10", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(out).iloc[0]
    assert row.stage_layers == "20,10" and row.pp == 2
    assert row.stage_bytes == f"{36 * 20 * 512},{36 * 10 * 512}"
    assert "per rank of stage 1 (layers 20–29)" in r.stdout

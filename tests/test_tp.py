"""Tensor parallelism on the CPU: two gloo ranks, under torchrun as a user runs them, and
spawned in-process to inject faults."""

import os
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch.multiprocessing as mp

from kvbench.sizing.capacity import CacheFormat, ModelSpec, plan

SMALL = ["--device", "cpu", "--batch", "2", "--prompt-len", "9", "--decode-len", "3",
         "--hidden", "32", "--q-heads", "4", "--head-dim", "8"]
TIMEOUT = 120  # a hung group must not hang the suite


def torchrun(*args, tmp_path, env=None, script=None):
    """`torchrun --nproc-per-node 2 -m kvbench ARGS` (or a script), its result."""
    target = [script] if script else ["-m", "kvbench"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", *target, *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=tmp_path,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


@pytest.mark.slow
def test_verify_tp2_passes_for_each_cache_layout_and_technique(tmp_path):
    # under torchrun, as a user runs it: each layout a rank's shard is cached in (contiguous,
    # SDPA, paged, the Triton kernel's pages), then a window, a shared prefix and eviction,
    # each split over 2 ranks, against one device. A rank's cache is an ordinary cache of
    # H_kv / tp heads, which test_verify checks for every implementation at every H_kv;
    # splitk and compiled add a compile here and nothing a rank does differently.
    sweep = tmp_path / "t.toml"
    sweep.write_text('command = "verify"\nblock_size = 4\n'
                     '[[points]]\nimpl = "concat,static,sdpa,paged,triton"\n'
                     '[[points]]\nimpl = "window"\nwindow = 5\nsinks = 2\nrope = true\n'
                     '[[points]]\nimpl = "paged"\nshared_prefix = 6\nrope = true\n'
                     '[[points]]\nimpl = "h2o"\nkv_budget = 6\nrope = true\n')
    out = tmp_path / "v.csv"
    r = torchrun("verify", "--tp", "2", *SMALL, "--kv-heads", "2", "--config", str(sweep),
                 "--csv", str(out), tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    df = pd.read_csv(out)  # rank 0 alone writes: one row per implementation
    every, techniques = df.iloc[:-3], df.iloc[-3:]
    assert every["impl"].tolist() == ["concat", "static", "sdpa", "paged", "triton"]
    assert df["passed"].all() and set(df["tp"]) == {2} and set(df["world_size"]) == {2}
    assert set(every["cache_shape"]) == {"2x1x12x8"}  # each rank caches its own KV head
    assert techniques["impl"].tolist() == ["window", "paged", "h2o"]
    assert techniques["lossy"].fillna(False).tolist() == [False, False, True]


@pytest.mark.slow
def test_memory_per_rank_equals_capacity_tp(tmp_path):
    # H_kv = 2 over 2 ranks: one head each; H_kv = 1: the head replicated on both ranks.
    # Each rank's own exit status too: a rank that left while its peer still talked to it, or
    # whose interpreter tore down gloo's threads, aborted now and then (SIGABRT after the rows
    # were written: torchrun then exits 1)
    out = tmp_path / "m.csv"
    for r in ranks("memory", "--tp", "2", *SMALL, "--kv-heads", "2,1", "--impl", "static,paged",
                   "--block-size", "4", "--csv", str(out), tmp_path=tmp_path):
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and "terminate called" not in r.stderr, r.stderr
    df = pd.read_csv(out)
    assert sorted(set(df["rank"])) == [0, 1] and len(df) == 2 * 2 * 2
    for (kv_heads, impl), rows in df.groupby(["kv_heads", "impl"]):
        model = ModelSpec(name="layer", layers=1, kv_heads=int(kv_heads), head_dim=8)
        block = 4 if impl == "paged" else None
        per_rank = plan(model, CacheFormat("fp32", tp=2, block_size=block), (12, 12)).per_rank_bytes
        assert (rows["kv_cache_bytes"] == per_rank).all(), (kv_heads, impl)
        payload = plan(model, CacheFormat("fp32", tp=2), (12, 12)).per_rank_bytes
        assert (rows["theoretical_kv_bytes"] == payload).all()


@pytest.mark.slow
def test_bench_tp2_times_the_slowest_rank_and_the_all_reduce(tmp_path):
    out = tmp_path / "b.csv"
    r, r1 = ranks("bench", "--tp", "2", *SMALL, "--kv-heads", "2", "--impl", "static,sdpa",
                  "--warmup", "1", "--rounds", "3", "--csv", str(out), tmp_path=tmp_path)
    assert r.returncode == r1.returncode == 0, r.stderr[-2000:] + r1.stderr[-2000:]
    df = pd.read_csv(out)
    assert list(df["impl"]) == ["static", "sdpa"]
    assert (df["allreduce_ms"] > 0).all() and (df["decode_rank_spread_ms"] >= 0).all()
    assert "all-reduce" in r.stdout


@pytest.mark.slow
def test_a_failing_rank_ends_the_group_with_a_clear_message(tmp_path):
    driver = tmp_path / "fail_on_rank_1.py"
    driver.write_text(
        "import os\n"
        "from kvbench.caches import StaticCache\n"
        "if os.environ['RANK'] == '1':\n"
        "    def step(self, x_t):\n"
        "        raise RuntimeError('injected on rank 1')\n"
        "    StaticCache.step = step\n"
        "from kvbench.cli import main\n"
        "main()\n")
    start = time.monotonic()
    r = torchrun("verify", "--tp", "2", *SMALL, "--kv-heads", "2", "--impl", "static",
                 "--no-csv", tmp_path=tmp_path, script=str(driver))
    assert r.returncode != 0
    assert time.monotonic() - start < 60
    assert "kvbench: error: rank 1: RuntimeError: injected on rank 1" in r.stderr
    assert "kvbench/experiments/verify.py" not in r.stderr  # one line, not kvbench's traceback


@pytest.mark.slow
def test_tp_unlike_the_world_size_is_one_line(tmp_path):
    # torchrun's own launcher: ranks other than 0 wait for it to stop them once rank 0 has
    # said why
    r = torchrun("verify", "--tp", "4", *SMALL, "--kv-heads", "2", tmp_path=tmp_path)
    assert r.returncode != 0
    ours = [line for line in r.stderr.splitlines() if line.startswith("kvbench:")]
    assert ours == [("kvbench: error: --tp 4 needs 4 processes; torchrun started 2: use "
                     "torchrun --nproc-per-node 4 (or --nproc 4)")]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "runs one process per rank: add --nproc 2, or start them with torchrun "
     "--nproc-per-node 2"),
    (["--tp", "3"], "--tp 3 does not divide --q-heads 4"),
    (["--tp", "4", "--q-heads", "8", "--kv-heads", "3"], "not a multiple"),
    (["--tp", "2", "--q-heads", "6", "--kv-heads", "3"], "--tp 2 with --kv-heads 3"),
    (["--tp", "0"], "--tp must be a positive integer"),
])
def test_bad_tp_is_one_line_exit_2(tmp_path, args, message):
    from typer.testing import CliRunner

    from kvbench.cli import app

    base = [a for a in SMALL if a not in ("--q-heads", "4")]
    out = tmp_path / "v.csv"
    result = CliRunner().invoke(app, ["verify", *base, "--q-heads", "4", *args, "--csv",
                                      str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not out.exists()


# Faults, injected in two spawned gloo ranks: each must fail verify.

FAULTS = {"none": True, "other-ranks-kv": False, "no-all-reduce": False}  # fault: passes


def _verify_with_faults(rank: int, store: str, results) -> None:
    import torch.distributed as dist

    from kvbench.caches import StaticCache
    from kvbench.experiments.verify import verify
    from kvbench.layers.attention import AttentionLayer
    from kvbench.measure import distributed
    from kvbench.sizing.config import LayerShape, RunConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    distributed._group = distributed.Group(2, rank, rank, "gloo")
    shard = AttentionLayer.shard
    shape = LayerShape(batch=2, prompt_len=9, decode_len=3, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8)
    for fault in FAULTS:  # one group runs each fault in turn (a group costs seconds)

        def faulty(layer, tp, r, fault=fault):
            part = shard(layer, tp, r)
            if fault == "other-ranks-kv":  # k and v columns of the other rank's KV head
                other = shard(layer, tp, (r + 1) % tp)
                qcols = part.shape.q_heads * part.shape.head_dim
                part.w_qkv = part.w_qkv.clone()
                part.w_qkv[:, qcols:] = other.w_qkv[:, qcols:]
            elif fault == "no-all-reduce":
                part.tp = 1
            return part

        AttentionLayer.shard = faulty
        report = verify(RunConfig(shape, tp=2), {"static": StaticCache})
        if rank == 0:
            results.put((fault, report.passed, report.checks[0].message))
    AttentionLayer.shard = shard
    dist.destroy_process_group()


@pytest.mark.slow
def test_verify_rejects_tp_faults(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_verify_with_faults, args=(str(tmp_path / "store"), results),
                       nprocs=2, start_method="spawn")
    for _ in FAULTS:
        fault, passed, message = results.get(timeout=TIMEOUT)
        assert passed is FAULTS[fault], (fault, message)
        if not passed:
            assert message.startswith("rank "), (fault, message)


def ranks(*args, tmp_path) -> list[subprocess.CompletedProcess]:
    """`python -m kvbench ARGS` as two ranks with torchrun's environment, started here (the
    launcher's own interpreter, seconds a run, is not what is tested): each rank's result."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "kvbench", *args], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
             "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("tp, kv_heads", [(4, 2), (4, 1), (4, 4), (2, 8)])
def test_every_rank_takes_the_kv_heads_its_query_heads_read(tp, kv_heads):
    # no process group needed: shard is arithmetic on the weights. With fewer KV heads than
    # ranks, rank r's query heads read KV head (r * H_q/tp) // G: not always rank 0's
    import torch

    from kvbench.layers.attention import AttentionLayer
    from kvbench.sizing.config import LayerShape, RunConfig

    shape = LayerShape(batch=1, prompt_len=4, decode_len=1, hidden=32, q_heads=8,
                       kv_heads=kv_heads, head_dim=4)
    layer = AttentionLayer.from_config(RunConfig(shape))
    Hq, D, G = 8, 4, 8 // kv_heads
    w = layer.w_qkv.view(32, Hq + 2 * kv_heads, D)  # [H, heads, D]
    seen = set()
    for rank in range(tp):
        part = layer.shard(tp, rank)
        hq, hkv = Hq // tp, max(1, kv_heads // tp)
        first_q = rank * hq
        kv = [(first_q + i * G) // G for i in range(0, hq, G)] if hq >= G else [first_q // G]
        got = part.w_qkv.view(32, hq + 2 * hkv, D)
        assert torch.equal(got[:, :hq], w[:, first_q:first_q + hq])
        assert torch.equal(got[:, hq:hq + hkv], w[:, Hq + kv[0]:Hq + kv[0] + hkv])
        assert torch.equal(got[:, hq + hkv:], w[:, Hq + kv_heads + kv[0]:
                                                Hq + kv_heads + kv[0] + hkv])
        seen.add(kv[0])
    assert seen == set(range(0, kv_heads, max(1, kv_heads // tp)))

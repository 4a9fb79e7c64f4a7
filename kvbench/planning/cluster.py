"""A sweep beyond one process: its points as Ray tasks (--ray), or one shard of them
(--shard I/N) for a scheduler's job array, whose CSVs `kvbench merge` joins.

Under --ray each point is one task: a CUDA point asks for one GPU, a CPU point for --threads
cores (1 by default, so a node runs a point per core); a --tp N point asks for N of them on one
node and starts its N ranks there with torchrun's environment, each running the driver's
command on that one point. The driver plans and preflights the
points as a local sweep does, submits them all, and writes each point's rows as its task
finishes (kvbench.planning.runner.sweep). A task whose worker dies is run again, at most
--retries times; a point that fails for its own reasons (a mismatch, out of memory, a device
error) is not, and a point is never written twice: rows are written by the driver alone, once
per finished task. Ray is an optional dependency (the `cluster` extra).
"""

from __future__ import annotations

import os
import socket

from kvbench.errors import KvbenchError

INSTALL = 'pip install -e ".[cluster]"'


def parse_shard(text: str) -> tuple[int, int]:
    """--shard I/N -> (I, N), 0 <= I < N."""
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise KvbenchError(f"--shard {text!r}: give I/N, e.g. 0/4 for the first of 4 "
                           "shards") from None
    if n < 1:
        raise KvbenchError(f"--shard {text}: N is the number of shards, 1 or more (e.g. 0/4 "
                           "for the first of 4)")
    if not 0 <= i < n:
        raise KvbenchError(f"--shard {text}: I runs from 0 to N-1 (0/{n} … {n - 1}/{n})")
    return i, n


def shard(points: list, text: str) -> list:
    """Shard I of N: the points whose index in the sweep is I modulo N (every shard gets
    points of every size, and the N shards together are the sweep)."""
    i, n = parse_shard(text)
    return points[i::n]


def _ray():
    try:
        import ray
    except ImportError:
        raise KvbenchError(f"--ray needs Ray: {INSTALL}") from None
    return ray


def _reachable(address: str, timeout_s: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def needs(config, threads: int | None) -> dict[str, float]:
    """The Ray resources one point asks for: a GPU per rank (a --tp point's ranks share one
    node), or --threads cores per rank on the CPU."""
    if config.device.startswith("cuda"):
        return {"num_gpus": config.tp, "num_cpus": config.tp}
    return {"num_cpus": (threads or 1) * config.tp}


# Options of the driver's command line that a --tp point's ranks do not take: where rows go
# and how the sweep runs (each takes a value unless named in FLAGS)
DRIVER_ONLY = {"--ray", "--retries", "--threads", "--csv", "--format", "--shard"}
FLAGS = {"--no-csv", "-q", "--quiet", "--dry-run"}


def rank_args(command_line: str) -> list[str]:
    """The driver's arguments (after `kvbench`) less DRIVER_ONLY and FLAGS."""
    import shlex

    args, out, skip = shlex.split(command_line)[1:], [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in FLAGS:
            continue
        if name in DRIVER_ONLY:
            skip = "=" not in a
            continue
        out.append(a)
    return out


class Cluster:
    """A Ray cluster the sweep's points run on: joined (or started, for `local`) on entry,
    left on exit when this process started it."""

    def __init__(self, address: str, retries: int = 2, threads: int | None = None):
        if retries < 0:
            raise KvbenchError(f"--retries must be 0 or more, got {retries}")
        if threads is not None and threads < 1:
            raise KvbenchError(f"--threads must be a positive integer, got {threads}")
        self.address, self.retries, self.threads = address, retries, threads
        self.ray, self.started, self.refs = _ray(), False, {}

    def __enter__(self) -> Cluster:  # noqa: PYI034
        ray = self.ray
        explicit = self.address not in ("local", "auto")
        if explicit and not _reachable(self.address.removeprefix("ray://")):
            raise KvbenchError(f"--ray {self.address}: no Ray cluster answers there; start "
                               "one (ray start --head) or give its address (HOST:PORT)")
        if ray.is_initialized():  # a cluster this process already joined
            return self
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster: no token file
        try:
            ray.init(address=None if self.address == "local" else self.address,
                     include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise KvbenchError(f"--ray {self.address}: cannot join the cluster ({first})") \
                from None
        self.started = True
        from kvbench.planning.signals import terminate_on_sigterm

        terminate_on_sigterm()  # Ray's own handler ends the process without a word
        return self

    def __exit__(self, *exc) -> None:
        if self.refs:  # stopped early: the outstanding points are cancelled
            self.cancel()
        if self.started:
            self.ray.shutdown()

    def check(self, points) -> None:
        """Refuse, before any task starts, a point no node can hold."""
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        for config, _ in points:
            want = needs(config, self.threads)
            gpus, cpus = want.get("num_gpus", 0), want.get("num_cpus", 0)
            if not any(n.get("GPU", 0) >= gpus and n.get("CPU", 0) >= cpus for n in nodes):
                from kvbench.report.render import describe

                most = max((n.get("GPU", 0) for n in nodes), default=0)
                what = (f"{gpus:g} GPUs on one node (the most any node has is {most:g})"
                        if gpus else f"{cpus:g} CPU cores on one node")
                raise KvbenchError(f"--ray: the point {describe(config)} needs {what}; "
                                   "lower --tp or --threads")

    def submit(self, points, run_point, indices=None, total=None) -> None:
        """Every point a task. A --tp point's task starts its ranks (the driver's command on
        that one point: --shard I/N of the whole sweep, `indices` its points' places in it)."""
        from kvbench.measure import env

        shown = env.provenance()
        run = {k: shown[k] for k in ("run_id", "sweep_id", "command_line")}
        task, ranks = self.ray.remote(_point_task), self.ray.remote(_ranks_task)
        for i, (config, names) in enumerate(points):
            options = {"max_retries": self.retries, "retry_exceptions": False,
                       **needs(config, self.threads)}
            if config.tp > 1:
                where = (indices or range(len(points)))[i]
                ref = ranks.options(**options).remote(
                    rank_args(run["command_line"]), where, total or len(points), config.tp,
                    run, self.threads)
            else:
                ref = task.options(**options).remote(run_point, config, names, run,
                                                     self.threads)
            self.refs[ref] = i

    def completed(self):
        """(index, (result, rows) or the exception its point raised), as tasks finish."""
        ray = self.ray
        while self.refs:
            ready, _ = ray.wait(list(self.refs), num_returns=1)
            i = self.refs.pop(ready[0])
            try:
                yield i, ray.get(ready[0])
            except ray.exceptions.RayTaskError as err:  # the point's own failure
                yield i, err.cause if err.cause is not None else err
            except ray.exceptions.RayError as err:  # its worker died --retries + 1 times
                yield i, WorkerLost(f"its worker died {self.retries + 1} times "
                                    f"({type(err).__name__})")

    def cancel(self) -> None:
        for ref in list(self.refs):
            self.ray.cancel(ref, force=True)
        self.refs.clear()


class WorkerLost(RuntimeError):
    """A point whose task's worker died more often than --retries allows."""


def _point_task(run_point, config, names, run: dict, threads: int | None):
    """One point, on a Ray worker: the driver's run id and command line on its rows, this
    worker's environment (host, device) beside them."""
    from kvbench.errors import DeviceError, is_out_of_memory
    from kvbench.measure import env

    env._run.update(run)
    if threads:
        import torch

        torch.set_num_threads(threads)
    environment = env.environment(config.device)
    try:
        return run_point(config, names, environment)
    except (RuntimeError, MemoryError) as err:  # as a local sweep turns it into a DeviceError
        if not is_out_of_memory(err):
            raise
        raise DeviceError("weights and inputs", None, err) from err


def _ranks_task(args: list[str], index: int, total: int, tp: int, run: dict,
                threads: int | None) -> tuple[list[dict], int, str]:
    """A --tp point on one node: its tp ranks started with torchrun's environment, running
    the sweep's point `index` alone (--shard index/total); rank 0's rows read back with the
    driver's run id and command line. (rows, the worst exit status, the last error line)."""
    import csv
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.csv"
        argv = [sys.executable, "-m", "kvbench", *args, "--shard", f"{index}/{total}",
                "--csv", str(out), "-q"]
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "WORLD_SIZE": str(tp), "LOCAL_WORLD_SIZE": str(tp)}
        if threads:
            base["OMP_NUM_THREADS"] = str(threads)
        procs = [subprocess.Popen(argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(tp)]
        errors = [p.communicate()[1] for p in procs]
        code = max(p.returncode for p in procs)
        rows = []
        if out.exists():
            with out.open(newline="") as f:
                rows = [{k: v for k, v in row.items() if v != ""} | run
                        for row in csv.DictReader(f)]
    said = [line for e in errors for line in e.splitlines() if line.startswith("kvbench")]
    return rows, code, said[-1] if said else ""

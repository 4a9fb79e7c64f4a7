"""Tensor parallelism on torch.distributed: one process per rank, started by torchrun.

The layer is split by head, Megatron-style (kvbench.layers.attention.AttentionLayer.shard): each
rank holds H_q/N query heads, its KV heads (H_kv/N of them, or one replicated KV head when there are
fewer KV heads than ranks), the matching columns of W_q, W_k, W_v (column-parallel) and rows of W_o
(row-parallel), and caches only its own KV heads. The output projection's partial sums are
all-reduced: one collective per layer per step. NCCL on CUDA (rank r on cuda:r of its node), gloo on
the CPU.

Rank 0 alone prints and writes results; every rank runs the same points, so collectives meet.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

from kvbench.errors import KvbenchError

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # what torchrun sets for each process


@dataclass(frozen=True)
class Group:
    size: int
    rank: int
    local_rank: int
    backend: str
    tp: int = 0  # ranks a layer is split over (0: size, the one-layer --tp)
    pp: int = 1  # pipeline stages (a whole model's --pp)


_group: Group | None = None
_tp_group = None  # this rank's stage's tensor-parallel group (None: the whole world)
# Every collective and send times out (a rank that died or hangs ends the group, not waits
# forever): seconds, $KVBENCH_DIST_TIMEOUT, default 600
TIMEOUT_VAR = "KVBENCH_DIST_TIMEOUT"
# Bytes this process handed to the network, by kind: "allreduce" (each all-reduce's tensor)
# and "send" (point-to-point: a pipeline stage's hidden states); reset by whoever counts
traffic = {"allreduce": 0, "send": 0}


def launched() -> bool:
    """Whether torchrun (or another torch.distributed launcher) started this process."""
    return all(k in os.environ for k in ENV)


def multiprocess() -> bool:
    """Whether torchrun started this process as one of several."""
    return launched() and int(os.environ["WORLD_SIZE"]) > 1


def env_rank() -> int:
    """This process's rank as torchrun set it (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0"))


def world() -> Group | None:
    """The tensor-parallel group this process runs in, once `setup` has made it."""
    return _group


def rank() -> int:
    return _group.rank if _group else 0


def torchrun_command(tp: int) -> str:
    """How to run this very command line on `tp` ranks."""
    args = " ".join(a for a in sys.argv[1:])
    return f"torchrun --nproc-per-node {tp} -m kvbench {args}"


def check(tp: int, q_heads: int, kv_heads: int) -> None:
    """Refuse a split that does not give each rank whole heads."""
    if type(tp) is not int or tp < 1:
        raise KvbenchError(f"--tp must be a positive integer, got {tp}")
    if q_heads % tp:
        raise KvbenchError(f"--tp {tp} does not divide --q-heads {q_heads}: each rank holds "
                           f"H_q/N query heads; use a --tp that divides {q_heads}")
    if kv_heads % tp and tp % kv_heads:
        raise KvbenchError(f"--tp {tp} with --kv-heads {kv_heads}: each rank holds H_kv/N KV "
                           "heads, or one replicated when there are fewer KV heads than ranks; "
                           "use a --tp that divides --kv-heads or a multiple of it")


def setup(tp: int, device: str, pp: int = 1) -> str:
    """Join the group for --tp `tp` (and a whole model's --pp `pp`: tp × pp ranks) on
    --device `device`; returns this rank's device.

    One rank outside torchrun changes nothing. Everything that can be refused is refused
    here, the same way on every rank, before any collective.
    """
    global _group, _tp_group
    if tp < 1:
        raise KvbenchError(f"--tp must be a positive integer, got {tp}")
    ranks = tp * pp
    flags = " ".join(f for f in (f"--tp {tp}" if tp > 1 else "", f"--pp {pp}" if pp > 1
                                 else "") if f)
    if not launched():
        if ranks > 1:
            raise KvbenchError(f"{flags} runs one process per rank: add --nproc {ranks}, or "
                               f"start them with {torchrun_command(ranks)}")
        return device
    size = int(os.environ["WORLD_SIZE"])
    if size != ranks:
        raise KvbenchError(f"{flags} needs {ranks} processes; torchrun started {size}: use "
                           f"torchrun --nproc-per-node {ranks} (or --nproc {ranks})")
    if size == 1:
        return device
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", size)):
            raise KvbenchError(f"--tp {tp} on --device cuda needs a GPU per rank; this node has "
                               f"{torch.cuda.device_count()}")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device == "cpu":
        backend = "gloo"
    else:
        raise KvbenchError(f"--tp runs on --device cpu (gloo) or cuda (NCCL), not {device}")
    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group(backend, timeout=timedelta(
            seconds=float(os.environ.get(TIMEOUT_VAR, "600"))))
        # Leave the group before the interpreter tears down the threads it runs on: without
        # this, gloo's exit may abort ("terminate called without an active exception").
        # `leave` does it on the way out of a command; this is for any other exit.
        atexit.register(_destroy)
    me = dist.get_rank()
    if pp > 1:  # each stage's ranks their own group (every rank makes every group, in order)
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if me // tp == stage:
                _tp_group = group
    _group = Group(size, me, local, backend, tp, pp)
    return device


def all_reduce(tensor) -> None:
    """Sum `tensor` over the ranks of this rank's tensor-parallel group, in place (traceable
    by torch.compile); its bytes counted in `traffic`."""
    import torch.distributed as dist

    traffic["allreduce"] += tensor.numel() * tensor.element_size()
    dist.all_reduce(tensor, group=_tp_group)


def send(tensor, dst: int) -> None:
    """`tensor` to global rank `dst` (a stage's hidden states to the next); counted."""
    import torch.distributed as dist

    traffic["send"] += tensor.numel() * tensor.element_size()
    dist.send(tensor.contiguous(), dst)


def recv(shape, dtype, device, src: int):
    """A tensor of `shape` from global rank `src`."""
    import torch
    import torch.distributed as dist

    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src)
    return out


def barrier(device: str) -> None:
    import torch.distributed as dist

    if device.startswith("cuda"):
        dist.barrier(device_ids=[int(device.split(":")[1])])
    else:
        dist.barrier()


def gather(obj) -> list | None:
    """Every rank's `obj` on rank 0 (a list by rank); None on the others."""
    import torch.distributed as dist

    out = [None] * _group.size if _group.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_max_min(values: list[float]) -> tuple[list[float], list[float]]:
    """Element-wise max and min of `values` over the ranks (every rank gets both)."""
    import torch.distributed as dist

    every = [None] * _group.size
    dist.all_gather_object(every, list(values))
    return [max(c) for c in zip(*every)], [min(c) for c in zip(*every)]


class Ranks:
    """What kvbench.measure.timing needs of the group: a barrier, and max/min over the ranks."""

    def __init__(self, device: str):
        self.device = device

    def barrier(self) -> None:
        barrier(self.device)

    def max_min(self, values: list[float]) -> tuple[list[float], list[float]]:
        return all_max_min(values)


def end_group(code: int, quiet: bool = False):
    """Leave at once: the other ranks may be waiting in a collective that will never come;
    torchrun stops them when it sees this process exit."""
    if not quiet:
        print("kvbench: ending the tensor-parallel group (torchrun stops the other ranks)",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> None:
    """End a rank's command: wait for every rank to finish, leave the group, and exit without
    the interpreter's teardown. A rank that exits while another still talks to it, or whose
    interpreter tears down threads gloo still runs on, may abort ("terminate called without
    an active exception", SIGABRT) after its work is done."""
    import torch.distributed as dist

    if _group is not None and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 (a peer already gone: leave all the same)
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

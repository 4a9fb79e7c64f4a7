"""Faults planted in every process of a run across ranks (tests/test_parallel.py): the test
puts a sitecustomize.py calling plant(FAULT) on PYTHONPATH, so the ranks that `kvbench ...
--nproc N` starts carry the fault as the command that started them does."""

import os
import signal


def plant(fault: str) -> None:
    if fault == "kv-slice":  # each rank's K/V columns those of the next rank's KV heads
        from kvbench.layers import attention

        right = attention.head_columns

        def wrong(s, tp, rank):
            q, k, _ = right(s, tp, rank)
            D = s.head_dim
            held = (k.stop - k.start) // D
            first = ((k.start - s.q_heads * D) // D + held) % s.kv_heads
            k0, v0 = (s.q_heads + first) * D, (s.q_heads + s.kv_heads + first) * D
            return q, slice(k0, k0 + held * D), slice(v0, v0 + held * D)

        attention.head_columns = wrong
    elif fault == "boundary":  # stage 1 starts one layer early: that layer runs twice
        from kvbench.experiments.model import parallel

        stages = parallel.stage_layers

        def shifted(arch, config):
            out = stages(arch, config)
            return [out[0]] + [range(r.start - 1, r.stop) for r in out[1:]]

        parallel.stage_layers = shifted
    elif fault == "killed":  # rank 1 is killed at its second point
        from kvbench.experiments.model import parallel

        memory, calls = parallel.memory, []

        def dies(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2 and os.environ.get("RANK") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            return memory(*args, **kwargs)

        parallel.memory = dies
    elif fault == "slow":  # every rank stalls at its second point (the launcher is stopped)
        import time

        from kvbench.experiments.model import parallel

        memory, calls = parallel.memory, []

        def stalls(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(120)
            return memory(*args, **kwargs)

        parallel.memory = stalls

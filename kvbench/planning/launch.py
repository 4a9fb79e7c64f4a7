"""--nproc K: this command line again on K ranks, started by torch's own launcher (torchrun's
`torch.distributed.run`, standalone on this node), as if typed under `torchrun
--nproc-per-node K -m kvbench`. A rank that fails takes the others down (torchrun stops
them); the failing rank says why in its own line, and this process adds one naming it when
the rank could not (a signal, an unexpected exit).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from kvbench.report.render import plural

EXPLAINED = (1, 2, 3, 130, 143)  # exit codes a kvbench rank has already said a line about
LAUNCHED_VAR = "KVBENCH_LAUNCHER"  # set in the ranks it starts
PEER_LOST = 75  # a rank whose peer went away first: it exits quietly with this, for the
# launcher names the rank that failed


def argv_without_nproc(argv: list[str]) -> list[str]:
    """The command line less its --nproc K (or --nproc=K)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(nproc: int, argv: list[str], results: Path | None = None) -> int:
    """Run `kvbench argv` (less --nproc) on `nproc` ranks here; their exit status. `results`:
    the file rank 0 appends to (what an interrupt says it kept)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):  # its banners and warnings: each of
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # its loggers sets a level
    import os

    before = rows_in(results)

    os.environ[LAUNCHED_VAR] = "1"  # (the ranks inherit it)
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc),
                                         "--monitor-interval", "0.5", "--module", "kvbench",
                                         *argv_without_nproc(argv)])
    try:
        run(args)
    except SignalException as err:
        # this process was interrupted: torchrun stops the ranks (rank 0 wrote each point's
        # rows as it finished)
        how = "interrupted" if err.sigval == signal.SIGINT else "terminated"
        n = rows_in(results) - before
        kept = "" if results is None else f"; {n} {plural(n, 'row')} kept in {results}"
        print(f"kvbench: {how}; the ranks were stopped{kept}", file=sys.stderr)
        return 130 if err.sigval == signal.SIGINT else 143
    except ChildFailedError as err:
        # the one that failed: an exit status of its own, else a signal other than the
        # SIGTERM torchrun stops the others with; the earliest of those
        rank, failure = min(err.failures.items(),
                            key=lambda rf: (rf[1].exitcode in (PEER_LOST, -15),
                                            rf[1].exitcode <= 0, rf[1].timestamp, rf[0]))
        code = failure.exitcode
        if code not in EXPLAINED:
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            print(f"kvbench: error: rank {rank} ended with {how}; the other ranks were "
                  "stopped", file=sys.stderr)
        return code if code > 0 and code != PEER_LOST else 3
    return 0


def rows_in(path: Path | None) -> int:
    """The rows of a results file (0 where there is none)."""
    import csv

    if path is None or not path.is_file():
        return 0
    with path.open(newline="") as f:
        return max(sum(1 for _ in csv.reader(f)) - 1, 0)


def peer_lost(err: BaseException) -> bool:
    """Whether a rank started by the launcher failed because another rank went away (its
    collective's connection closed): it then leaves the saying to the launcher."""
    import os

    text = str(err).lower()
    return bool(os.environ.get(LAUNCHED_VAR)) and any(
        m in text for m in ("connection closed", "connection reset", "broken pipe",
                            "connection refused", "peer"))

"""SIGTERM handled as Ctrl-C is: `terminate_on_sigterm` makes it raise `Terminated` in the
main thread, and `terminated` tells the two apart once a library has turned either into a
plain KeyboardInterrupt. The runner, the cluster and serve-sim share it; it imports nothing
of theirs."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_signals: list[int] = []  # SIGTERMs received


def terminated(stopped: BaseException) -> bool:
    """Whether a KeyboardInterrupt was SIGTERM (Ray's wait re-raises it as a plain one)."""
    return isinstance(stopped, Terminated) or signal.SIGTERM in _signals


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the rows of finished points kept, exit 143."""


def terminate_on_sigterm() -> None:
    """From now on SIGTERM raises Terminated in the main thread (elsewhere nothing changes).
    Not under torchrun, which stops the ranks with it once one has exited."""
    from kvbench.measure import distributed

    if threading.current_thread() is not threading.main_thread() or distributed.multiprocess():
        return

    def terminate(signum, frame):
        _signals.append(signum)  # said again where a library turned it into a KeyboardInterrupt
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while a unit's rows go to its files, then acted on as
    the block ends: a run stopped then keeps the whole unit in every file, never its rows
    without its steps. (Handlers, not a signal mask: a mask holds one thread, and a signal
    sent to the process may land on any of torch's threads.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in before.items():
        if handler is not None:  # (None: set outside Python, left alone)
            signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)
        if pending:  # as if it arrived now
            handler = before[signal.Signals(pending[0])]
            if callable(handler):
                handler(pending[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(pending[0])

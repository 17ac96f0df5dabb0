"""Signal handling that cannot deadlock.

A Python signal handler runs in the main thread between two of its bytecodes, wherever that thread is: inside
``logging`` (holding a handler's lock) or inside ``Event.wait`` (holding the event's condition lock). A handler
that logs or sets an event then waits for a lock its own thread holds, forever; and every further signal runs
the handler again, nested, while it waits (a worker stopped by a burst of SIGTERMs died of RecursionError).

So the handler here only writes the signal's number to a pipe; a thread of its own reads it and runs the
callback, which may log, take locks and set events like any other code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

#: Signals that end a process by default besides SIGTERM and SIGINT (which stop a role gracefully) and a native
#: crash's (which its log names): a role of psctl's runtime, or the keeper of a framework's program, leaves the
#: one that ends it in its exit file, so that an agent that adopted it, not its parent, reports it.
RECORDED_SIGNALS = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU)


def on_signals(signums: Iterable[int], callback: Callable[[int], None], *, name: str = "psctl-signals") -> None:
    """Run ``callback(signum)`` in a daemon thread for each of ``signums`` this process receives.

    Call from the main thread (as ``signal.signal`` requires). Each signal received runs the callback once;
    the callback itself must tolerate being called again (a second SIGTERM while the first is handled).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a flood of signals drops bytes instead of blocking the handler

    def handler(signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(write_fd, bytes([signum]))

    def deliver() -> None:
        while True:
            data = os.read(read_fd, 64)
            if not data:
                return
            for signum in data:
                try:
                    callback(signum)
                except Exception:  # the next signal must still be delivered
                    logging.exception("handling signal %d failed", signum)

    threading.Thread(target=deliver, name=name, daemon=True).start()
    for signum in signums:
        signal.signal(signum, handler)

"""Waiting for a role's exit without polling: a thread sleeps until a watched child exits, until another thread
wakes it, or until a timeout.

Each child is watched through a pidfd (Linux 5.3+: ``os.pidfd_open``), which becomes readable when the process
exits. Readiness is only a reason to look: whoever waits still collects the exit with ``waitpid``
(``Popen.poll``), so a spurious wake costs one look; a child that cannot be watched (an older kernel, a stand-in
that is no real child) must be looked at on a timer, and ``blind()`` says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import weakref


class _Descriptors:
    """The waiter's descriptors: its wake pipe, the pidfds it polls and those forgotten but not yet closed."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(self.write, False)
        self.pidfds: dict[int, int] = {}  # pid -> its pidfd
        self.to_close: list[int] = []

    def close_all(self) -> None:
        for fd in [self.read, self.write, *self.pidfds.values(), *self.to_close]:
            os.close(fd)
        self.pidfds.clear()
        self.to_close.clear()


class ExitWaiter:
    """Sleeps until a watched process exits, ``wake()`` is called, or the timeout passes. ``watch`` and
    ``forget`` may be called from any thread; ``wait`` from one thread only (it closes forgotten pidfds, so
    that none is closed while it polls on it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds = _Descriptors()
        # closed by close(), or when the waiter is dropped unclosed (an agent that was never started); not at the
        # interpreter's exit, where a thread may still be in ``wait`` (it read a closed descriptor, or another
        # file's of the same number): the process's end closes them
        self._finalizer = weakref.finalize(self, self._fds.close_all)
        self._finalizer.atexit = False
        #: Processes that could not be watched: their exits are seen only by looking (see ``blind``).
        self._unwatched: set[int] = set()
        self._poller = select.poll()
        self._polled: list[int] = []  # the descriptors registered in it

    def watch(self, pid: int) -> bool:
        """Wake the waiter when ``pid`` exits; False where that cannot be done (it must then be looked at)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd_open (kernel < 5.3, not Linux) or no such process
            self.look_only(pid)
            return False
        with self._lock:
            if not self._finalizer.alive:  # closed: nothing waits any more
                os.close(fd)
                return False
            old = self._fds.pidfds.pop(pid, None)
            if old is not None:
                self._fds.to_close.append(old)
            self._fds.pidfds[pid] = fd
        self.wake()
        return True

    def look_only(self, pid: int) -> None:
        """``pid``'s exit shows no pidfd (a stand-in for a child, or no pidfds here): it must be looked at."""
        with self._lock:
            self._unwatched.add(pid)

    def forget(self, pid: int) -> None:
        """Stop watching ``pid`` (its exit was collected)."""
        with self._lock:
            self._unwatched.discard(pid)
            fd = self._fds.pidfds.pop(pid, None)
            if fd is not None:
                self._fds.to_close.append(fd)

    def blind(self) -> bool:
        """Some process is watched only by looking at it."""
        with self._lock:
            return bool(self._unwatched)

    def wake(self) -> None:
        """End the current (or the next) ``wait`` at once; safe from any thread."""
        with self._lock:
            if not self._finalizer.alive:  # closed: its descriptor number may be another file's by now
                return
            with contextlib.suppress(BlockingIOError):  # the pipe is full of wakes already: one is enough
                os.write(self._fds.write, b"\0")

    def wait(self, timeout: float) -> None:
        """Return when a watched process has exited, on a wake, or after ``timeout`` seconds."""
        with self._lock:
            closing = list(self._fds.to_close)
            self._fds.to_close.clear()
            fds = [self._fds.read, *self._fds.pidfds.values()]
        for fd in closing:
            os.close(fd)
        if fds != self._polled:  # (most waits watch what the last one did: keep its poll object)
            self._poller = select.poll()
            for fd in fds:
                self._poller.register(fd, select.POLLIN)
            self._polled = fds
        ready = self._poller.poll(max(0, math.ceil(timeout * 1000)))
        if any(fd == fds[0] for fd, _ in ready):  # woken: take the wakes out of the pipe
            with contextlib.suppress(BlockingIOError):
                while os.read(fds[0], 4096):
                    pass

    def close(self) -> None:
        """Close every descriptor (the waiter is done with)."""
        with self._lock:
            self._finalizer()

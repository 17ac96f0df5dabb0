"""psctl.signals: a signal's callback runs in a thread of its own, so a burst of signals that lands while the
main thread holds a lock (inside ``Event.wait``, inside ``logging``) neither deadlocks nor recurses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading

from cluster_helpers import wait_until

from psctl.signals import on_signals

# Like a role's main thread: blocked in stop.wait() until a signal's callback logs and sets ``stop``, under a
# stream of SIGTERMs (an agent once sent one per report). The race that killed a worker this way (the second
# signal's handler, run in the main thread, waiting for the event's lock that thread held) is rare here; the
# next test pins it down deterministically.
STOPPABLE = textwrap.dedent("""
    import logging, signal, sys, threading
    from psctl.signals import on_signals
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    stop = threading.Event()
    def on_term(signum):
        logging.info("received %s", signal.Signals(signum).name)
        stop.set()
    on_signals((signal.SIGTERM,), on_term)
    print("ready", flush=True)
    stop.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the test's stream goes on until it sees the exit
    print("stopped", flush=True)
""")


def test_a_stream_of_sigterms_stops_a_waiting_process_cleanly() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STOPPABLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        def signalled() -> bool:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            return proc.poll() is not None

        wait_until(signalled, timeout=30, interval=0.001, what="the process to stop")
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "received SIGTERM" in out and out.rstrip().endswith("stopped")
    assert "Traceback" not in err


def test_the_callback_may_take_a_lock_the_main_thread_held_when_the_signal_came() -> None:
    lock, taken, where = threading.Lock(), threading.Event(), []

    def callback(signum: int) -> None:
        where.append((signum, threading.current_thread() is threading.main_thread()))
        if lock.acquire(timeout=10):  # in the main thread itself this could never succeed
            lock.release()
            taken.set()

    previous = signal.getsignal(signal.SIGUSR1)
    on_signals((signal.SIGUSR1,), callback, name="test-signals")
    try:
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            sum(range(1000))  # a few bytecodes: the handler runs here, while the lock is held
        assert taken.wait(timeout=15)
        assert where == [(signal.SIGUSR1, False)]
    finally:
        signal.signal(signal.SIGUSR1, previous)


class _Clock:
    """A stop event whose waits advance a fake clock instead of sleeping (never set)."""

    def __init__(self) -> None:
        self.now = 0.0

    def wait(self, timeout: float) -> bool:
        self.now += timeout
        return False


def test_a_role_ends_by_itself_only_after_training_has_been_over_for_the_whole_linger() -> None:
    """Told that training is over, a ps or worker nothing stops ends after the linger; a step or push
    meanwhile (a chief training again, restored after the end was said) starts the count again."""
    from psctl.runtime.__main__ import _wait_for_stop

    clock = _Clock()
    over_from, back_at = 10.0, 40.0  # over at 10 s, training again at 40 s (a restored chief), over at 50 s

    def over() -> bool:
        return over_from <= clock.now < back_at or clock.now >= back_at + 10

    assert _wait_for_stop(clock, over, 60.0, clock=lambda: clock.now) is True  # type: ignore[arg-type]
    assert 110.0 <= clock.now <= 112.0, clock.now  # 60 s on end from 50 s, not from 10 s
    stopped = threading.Event()
    stopped.set()
    assert _wait_for_stop(stopped, lambda: True, 60.0) is False  # stopped first: the usual way out


def test_a_role_that_has_recorded_its_end_is_not_ended_by_a_late_sigterm() -> None:
    """A preempted worker that got a second SIGTERM as it exited (its agent's and the host's) was reported killed
    by SIGTERM, a failure: Python restores the default handlers as it finalizes. ``exit_now`` ignores SIGTERM
    and SIGINT first (seen here from an exit handler, which runs after it)."""
    script = (
        "import atexit, signal\n"
        "from psctl.runtime.__main__ import exit_now\n"
        "atexit.register(lambda: print('sigterm ignored:', signal.getsignal(signal.SIGTERM) == signal.SIG_IGN,"
        " signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True))\n"
        "exit_now(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "sigterm ignored: True True\n"), done

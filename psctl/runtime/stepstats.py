"""Where a role's time goes, summarised for its heartbeats (and so for ``psctl top``).

A worker records each step's phases (input and pull, compute, push) and bytes moved; every
``SUMMARY_INTERVAL`` the recent steps become a few numbers in the role's progress metrics: step time p50 and
p99 (ms), the share of wall time spent in each phase and waiting (between steps: for the chief's next step,
or stalled), and bytes per second. A PS reports its requests per second and the bytes it holds. Kept small
and cheap: a deque of recent steps, summarised at most twice a second, by the thread that ran the step.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from psctl.runtime.heartbeat import PROGRESS, Progress

#: How often the summary in the progress metrics is renewed.
SUMMARY_INTERVAL = 0.5
#: Steps the percentiles look at.
WINDOW = 512


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class StepStats:
    def __init__(self, *, progress: Progress = PROGRESS, get_time: Callable[[], float] = time.monotonic) -> None:
        self.progress = progress
        self.time = get_time
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._phases = [0.0, 0.0, 0.0]  # input+pull, compute, push: seconds since the last summary
        self._bytes = 0
        self._count = 0
        self._since = get_time()
        self._lock = threading.Lock()

    def record(self, *, pull: float, compute: float, push: float, nbytes: int) -> None:
        """One step's phases (seconds) and the bytes it moved (pulled and pushed)."""
        with self._lock:
            self._steps.append(pull + compute + push)
            self._count += 1
            for i, seconds in enumerate((pull, compute, push)):
                self._phases[i] += seconds
            self._bytes += nbytes
            now = self.time()
            if now - self._since < SUMMARY_INTERVAL:
                return
            wall = now - self._since
            ordered = sorted(self._steps)
            busy = sum(self._phases)
            summary = {
                "steps_per_s": self._count / wall,
                "step_ms_p50": 1000 * _percentile(ordered, 0.5),
                "step_ms_p99": 1000 * _percentile(ordered, 0.99),
                "pull_frac": self._phases[0] / wall,
                "compute_frac": self._phases[1] / wall,
                "push_frac": self._phases[2] / wall,
                # several steps may run at once (pipelining): busy time can exceed the wall time
                "wait_frac": max(0.0, 1.0 - busy / wall),
                "bytes_per_s": self._bytes / wall,
            }
            self._phases, self._bytes, self._count, self._since = [0.0, 0.0, 0.0], 0, 0, now
        # replaced, not changed in place: the heartbeat thread may be reading the old one
        self.progress.metrics = {**self.progress.metrics, **summary}
        self.progress.steps_per_second = summary["steps_per_s"]  # (the role's own rate: status --json's)


class RequestRate:
    """A PS's requests per second and the bytes it holds, renewed in its progress metrics every second."""

    def __init__(self, requests: Callable[[], int], held_bytes: Callable[[], int], *,
                 progress: Progress = PROGRESS) -> None:
        self.requests = requests
        self.held_bytes = held_bytes
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="request-rate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last, since = self.requests(), time.monotonic()
        while not self._stop.wait(1.0):
            now, count = time.monotonic(), self.requests()
            self.progress.metrics = {**self.progress.metrics, "requests_per_s": (count - last) / (now - since),
                                     "bytes_held": float(self.held_bytes())}
            last, since = count, now

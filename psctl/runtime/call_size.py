"""How many asynchronous training steps the chief gives a worker per call (``training.steps_per_execution``).

Each call from the chief costs a round trip and gRPC Python's own work at both ends, about 0.35 ms of the
chief's CPU and 0.3 ms of the worker's on a 2-core host (benchmarks/README.md): a fifth of all the work when a
step itself takes a few milliseconds, nothing when it takes fifty. ``auto`` (the default) sizes each call to
last about CALL_SECONDS of a worker's time, from the steps' own measured durations: fast steps share a call,
slow ones keep a call each. What a step sees does not change either way: the steps of a call run one after the
other, each with its own step id and batch, each pushed before the next starts.
"""

from __future__ import annotations

AUTO = "auto"
#: A call of ``auto`` lasts about this long: long enough that the call's own cost is a few percent of it, short
#: enough that a draining or failed worker's call ends (or is re-run elsewhere) within a blink.
CALL_SECONDS = 0.05
#: ... and holds at most this many steps.
MAX_STEPS = 32
#: Weight of the newest call in the running estimate of a step's duration.
SMOOTHING = 0.2


class CallSizer:
    """Steps per call: ``setting`` steps (an int), or ``auto``: one until a step's duration is known, then
    enough for CALL_SECONDS. Fed by the chief's results (``observe``, from the coordinator's threads) and asked
    by its scheduling loop (``steps``); a float written whole, so no lock is needed."""

    def __init__(self, setting: int | str) -> None:
        if setting != AUTO and (isinstance(setting, bool) or not isinstance(setting, int) or setting < 1):
            raise ValueError(f"steps_per_execution must be {AUTO} or an integer >= 1, got {setting!r}")
        self.fixed = None if setting == AUTO else int(setting)
        self._step_seconds: float | None = None
        #: The size of the last call asked for (the chief's progress records report it).
        self.last = 0
        self._calls = self._scheduled = 0

    def observe(self, steps: int, seconds: float) -> None:
        """A call of ``steps`` steps took the worker ``seconds`` (its own time, not the round trip)."""
        if steps < 1 or not seconds > 0:
            return
        per_step = seconds / steps
        last = self._step_seconds
        self._step_seconds = per_step if last is None else last + SMOOTHING * (per_step - last)

    def steps(self, remaining: int, workers: int, until_boundary: int | None = None) -> int:
        """Steps for the next call, when ``remaining`` steps are left to schedule among ``workers`` workers and
        ``until_boundary`` steps until the next point that should not be overrun by a queue of long calls (a
        checkpoint by steps). The calls of ``auto`` shrink towards either, so that the workers finish together
        rather than one running a long call alone at the end, and a checkpoint is taken near its step."""
        ahead = remaining if until_boundary is None else min(remaining, until_boundary)
        self.last = min(max(0, remaining), self._size(ahead, workers))
        self._calls += self.last > 0
        self._scheduled += self.last
        return self.last

    def mean(self) -> float:
        """Steps per call so far, on average (0 before the first)."""
        return self._scheduled / self._calls if self._calls else 0.0

    def _size(self, ahead: int, workers: int) -> int:
        if self.fixed is not None:
            return self.fixed
        if self._step_seconds is None:
            return 1
        share = ahead // (2 * max(1, workers))  # each worker has two calls queued (chief._train)
        return max(1, min(MAX_STEPS, round(CALL_SECONDS / self._step_seconds), share))

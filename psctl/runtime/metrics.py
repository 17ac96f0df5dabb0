"""Training metrics: a rate meter, and a JSON-lines writer that status and plots read later."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TextIO

#: A role's recent CPU use (cores), which its heartbeat adds to the role's own metrics (``psctl top`` shows it;
#: the evaluator's line in ``psctl status`` shows the evaluation's metrics without it).
CPU_METRIC = "cpu"


def metric_text(value: float) -> str:
    """A metric as people read it: 4 decimals, or 4 significant digits where that would show 0.0000 (a training
    loss of 3e-05 is not nothing)."""
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"


def metrics_text(metrics: Mapping[str, float], *, skip: Collection[str] = ("examples",)) -> str:
    """``loss 0.1208, accuracy 0.9833``: each metric but those in ``skip``, in the mapping's order."""
    return ", ".join(f"{k} {metric_text(v)}" for k, v in metrics.items() if k not in skip)


class MetricsFile:
    """Appends one JSON object per line, flushed each time (a crash loses at most the line being written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = json.dumps(clean, sort_keys=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics file (a torn last line is skipped)."""
    records = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def last_record(path: str | Path, event: str, *, tail_bytes: int = 64 << 10) -> dict[str, Any] | None:
    """The newest complete record with this ``event``, reading only the file's tail (the live view asks
    several times a second, and the file grows for as long as training runs)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None
    if size > tail_bytes:
        lines = lines[1:]  # the first line read may be cut
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            return record
    return None


class TrainingMeter:
    """Counts steps and examples and reports rates over the last reporting interval (the final report: over the
    whole run, from the first result to the last).

    ``steps_per_sec`` is global steps per second. Asynchronous training applies each worker step as one global
    step, so the workers' steps are counted; synchronous training (``by_global_step``) computes N batches per
    global step (the replicas, backups included), so the global step itself is (counting the workers' steps
    showed N times its rate). ``examples_per_sec`` is the examples the workers computed."""

    def __init__(self, *, get_time: Callable[[], float] = time.monotonic, by_global_step: bool = False) -> None:
        self._time = get_time
        self._by_global_step = by_global_step
        self._lock = threading.Lock()
        self.steps = 0
        self.examples = 0
        self.global_step = 0
        self.loss = float("nan")
        self._loss_sum = 0.0
        self._loss_n = 0
        #: (time, steps counted, examples) at the last report, at the first result; the time of the latest
        self._mark = (get_time(), 0, 0)
        self._first: tuple[float, int, int] | None = None
        self._latest = 0.0
        #: global steps counted (by_global_step): each result's advance over the highest seen before
        self._advanced = 0

    def record(self, *, loss: float, examples: int, global_step: int, steps: int = 1) -> None:
        """``steps`` steps finished (one call of several: ``loss`` is their mean, ``examples`` their sum)."""
        with self._lock:
            self.steps += steps
            self.examples += examples
            self._latest = self._time()
            if self._first is not None:  # (the first says where training is: a resumed run starts far on)
                self._advanced += max(0, global_step - self.global_step)
            if self._first is None:  # (the steps of this first result took a time not known here)
                self._first = (self._latest, self._counted(), self.examples)
            self.global_step = max(self.global_step, global_step)
            self._loss_sum += loss * steps
            self._loss_n += steps

    def _counted(self) -> int:
        return self._advanced if self._by_global_step else self.steps

    def reset(self, global_step: int) -> None:
        """After a restore the global step goes back: forget the higher one seen before (the steps trained
        again from there count again)."""
        with self._lock:
            self.global_step = global_step

    def report(self, *, final: bool = False) -> dict[str, float]:
        """Rates and mean loss since the previous report; ``final``: the rates of the whole run, between its first
        and last results (not the last interval, which holds the end's evaluation and checkpoint)."""
        with self._lock:
            now = self._time()
            then, steps, examples = self._mark
            if final and self._first is not None and self._latest > self._first[0]:
                then, steps, examples = self._first
                now = self._latest
            elapsed = max(now - then, 1e-9)
            if self._loss_n:
                self.loss = self._loss_sum / self._loss_n
            out = {
                "global_step": self.global_step,
                "loss": self.loss,
                "steps_per_sec": (self._counted() - steps) / elapsed,
                "examples_per_sec": (self.examples - examples) / elapsed,
            }
            self._mark = (now, self._counted(), self.examples)
            self._loss_sum, self._loss_n = 0.0, 0
            return out

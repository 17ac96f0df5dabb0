"""Scalars in TensorBoard's event files, beside metrics.jsonl (``run/tensorboard/``), when the optional
``tensorboard`` package is installed (``pip install 'psctl[tensorboard]'``); without it, nothing is written.

Only the event file writer and protos of the ``tensorboard`` package are used: no TensorFlow.
``tensorboard --logdir PSCTL_HOME/NAME/run/tensorboard`` then shows the chief's loss, steps/s and per-worker
rates (``train``) and the evaluator's metrics (``eval``).
"""

from __future__ import annotations

import logging
import sys
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("psctl.tensorboard")


class ScalarWriter:
    def __init__(self, logdir: str | Path) -> None:
        self._writer: Any = None
        # tensorboard's own switch (tensorboard.compat.tf): use its TensorFlow stub for file I/O, so that a
        # role never imports TensorFlow (seconds of start-up and hundreds of MB) where both are installed
        sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            return
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add(self, step: int, scalars: Mapping[str, float], *, wall_time: float | None = None) -> None:
        """One point of each scalar at ``step`` (non-finite values are left out)."""
        if self._writer is None:
            return
        values = [self._summary.Value(tag=tag, simple_value=float(v)) for tag, v in scalars.items()
                  if v is not None and v == v and abs(v) != float("inf")]
        event = self._event(wall_time=wall_time or time.time(), step=int(step),
                            summary=self._summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

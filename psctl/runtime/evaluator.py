"""The evaluator: follows the checkpoint folder and evaluates each new checkpoint on the test split.

Like TensorFlow's SidecarEvaluator it evaluates only the newest checkpoint (skipping intermediate ones when it
falls behind) and skips, with a warning, one it cannot load. It needs no PS: it reads checkpoints, so it
never slows training. With ``eval_every_steps`` it evaluates a checkpoint only once it is that many steps past the
last one it evaluated (the final one always). It stops after ``max_evaluations``, or once training is done and the
final checkpoint has been evaluated. Results go to ``eval.jsonl`` (JSON lines with the global step) and to its
heartbeats.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from psctl.runtime.checkpoint import (
    CheckpointError,
    Snapshot,
    finished_at,
    list_checkpoints,
    load_checkpoint,
    step_of,
)
from psctl.runtime.cluster import ClusterInfo
from psctl.runtime.config import TrainingConfig
from psctl.runtime.heartbeat import PROGRESS
from psctl.runtime.metrics import MetricsFile, metrics_text
from psctl.runtime.program import EmbeddingRows, Program, ProgramRef, load_program
from psctl.runtime.tensorboard import ScalarWriter

log = logging.getLogger("psctl.evaluator")
#: How often the checkpoint folder is looked at (a listing): a new checkpoint is evaluated, and the end of
#: training seen, within this.
POLL_SECONDS = 0.1


def evaluate_snapshot(program: Program, snapshot: Snapshot, split: str = "test") -> dict[str, float]:
    """The program's metrics over a whole split, with the checkpoint's variables."""
    dataset = program.dataset(split, 0, 1)
    batch = dataset.batch(0, dataset.num_examples)
    params: dict[str, np.ndarray | EmbeddingRows] = dict(snapshot.variables)
    for name, ids in program.embedding_ids(batch).items():
        ids = np.asarray(ids, dtype=np.int64)
        params[name] = EmbeddingRows(ids=ids, rows=snapshot.variables[name][ids])
    metrics = {k: float(v) for k, v in program.evaluate(params, batch).items()}
    metrics["examples"] = float(dataset.num_examples)
    return metrics


class Evaluator:
    def __init__(self, info: ClusterInfo, *, stop: threading.Event, poll_seconds: float = POLL_SECONDS) -> None:
        cfg = TrainingConfig.from_dict(info.training)
        if not (cfg.checkpoint or {}).get("dir"):
            raise ValueError("the evaluator needs checkpoints: set training.checkpoint.dir")
        self.directory = Path(str(cfg.checkpoint["dir"])).expanduser()  # type: ignore[index]
        self.program = load_program(ProgramRef(cfg.program, cfg.args, cfg.data, cfg.seed))
        self.max_evaluations = cfg.max_evaluations
        self.eval_every_steps = cfg.eval_every_steps
        self.run_dir = Path(info.run_dir)
        self.cluster_id = info.cluster_id
        self.stop = stop
        self.poll_seconds = poll_seconds
        self.metrics = MetricsFile(self.run_dir / "eval.jsonl")
        self.tensorboard = ScalarWriter(self.run_dir / "tensorboard" / "eval")
        self.evaluated = 0
        self.last_step = -1
        self._bad: set[str] = set()
        #: Checkpoints' steps passed over as too close to the last evaluated (said once each).
        self._passed: set[int] = set()

    def training_done(self) -> bool:
        """The chief's result.json (it runs on this host), or its word beside the checkpoints (it runs or
        moved elsewhere: the checkpoint folder is then shared) once the checkpoint of the step it names was
        evaluated (a shared folder's listing may show that checkpoint later than the word)."""
        if (self.run_dir / "result.json").is_file():
            return True
        step = finished_at(self.directory, self.cluster_id)
        return step is not None and self.last_step >= step

    def run(self) -> int:
        PROGRESS.status = "waiting for a checkpoint"
        while not self.stop.is_set():
            done = self.training_done()  # read before listing: the final checkpoint precedes result.json
            newest = [p for p in list_checkpoints(self.directory) if p.name not in self._bad]
            step = step_of(newest[-1]) if newest else -1
            if step > self.last_step and (done or self._due(step)):
                self._evaluate(newest[-1])
                if self.max_evaluations and self.evaluated >= self.max_evaluations:
                    log.info("stopping after %d evaluations", self.evaluated)
                    return 0
                continue
            if done:
                log.info("training is done and its last checkpoint evaluated: stopping")
                return 0
            self.stop.wait(self.poll_seconds)
        return 0

    def _due(self, step: int) -> bool:
        """Whether a checkpoint at ``step`` is far enough past the last evaluated one (``eval_every_steps``)."""
        due = step - max(self.last_step, 0) >= self.eval_every_steps
        if not due and step not in self._passed:
            self._passed.add(step)
            log.info("the checkpoint of global step %d is %d steps past the last evaluated (eval_every_steps %d): "
                     "waiting for a later one", step, step - max(self.last_step, 0), self.eval_every_steps)
        return due

    def _evaluate(self, path: Path) -> None:
        started = time.monotonic()
        try:
            snapshot = load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping a checkpoint that cannot be loaded: %s", exc)
            self._bad.add(path.name)
            return
        try:
            metrics = evaluate_snapshot(self.program, snapshot)
        except (KeyError, ValueError, IndexError) as exc:  # a checkpoint of another model in the same folder
            log.warning("skipping %s: it does not fit this program (%s: %s)", path.name, type(exc).__name__, exc)
            self._bad.add(path.name)
            return
        self.evaluated += 1
        self.last_step = snapshot.global_step
        PROGRESS.global_step = snapshot.global_step
        PROGRESS.metrics = {k: v for k, v in metrics.items() if k != "examples"}
        PROGRESS.loss = metrics.get("loss", float("nan"))
        PROGRESS.status = "evaluated"
        self.metrics.write({"time": time.time(), "global_step": snapshot.global_step, "checkpoint": str(path),
                            **metrics})
        self.tensorboard.add(snapshot.global_step, {k: v for k, v in metrics.items() if k != "examples"})
        shown = metrics_text(metrics)
        log.info("evaluated %s (global step %d) in %.2fs: %s", path.name, snapshot.global_step,
                 time.monotonic() - started, shown)


def run_evaluator(info: ClusterInfo, stop: threading.Event) -> int:
    return Evaluator(info, stop=stop).run()

"""The evaluator as a real ``python -m psctl.runtime`` process following a checkpoint folder.

Checkpoints of the MLP are written with distinct variables, so each evaluation's metrics identify the checkpoint
it read; the expected metrics are computed here from the same snapshots.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LocalCluster, Role, wait_until

from psctl.runtime.checkpoint import Snapshot, mark_finished, write_checkpoint
from psctl.runtime.evaluator import evaluate_snapshot
from psctl.runtime.metrics import read_metrics
from psctl.runtime.program import LowRankGrad, Program, ProgramRef, load_program

PROGRAM = "psctl.models.mlp"
ARGS = {"hidden_units": 32}
DATA = {"name": "digits"}
SEED = 0
STEPS = (100, 200, 300)
#: Starting Python, importing numpy/grpc/scikit-learn and loading digits, on a busy 2-core machine.
START_TIMEOUT = 90.0


@pytest.fixture(scope="module")
def program() -> Program:
    return load_program(ProgramRef(PROGRAM, ARGS, DATA, SEED))


def make_snapshot(program: Program, step: int) -> Snapshot:
    """Variables (and Adam slots) that differ from one step to the next, so the metrics tell them apart."""
    rng = np.random.default_rng(step)
    variables: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for var in program.variables():
        variables[var.name] = (rng.standard_normal(var.shape) * 0.3).astype(var.dtype)
        slots[var.name] = {
            "m": np.zeros(var.shape, dtype=var.dtype),
            "v": np.zeros(var.shape, dtype=var.dtype),
            "t": np.asarray(step, dtype=np.int64),
        }
    return Snapshot(step, [step // 2, step // 2], variables, slots, {"program": PROGRAM})


@pytest.fixture
def evaluators(tmp_path: Path) -> Iterator[list[LocalCluster]]:
    """Clusters of one evaluator each; every process is stopped, and checked gone, pass or fail."""
    clusters: list[LocalCluster] = []
    try:
        yield clusters
    finally:
        failures = []
        for cluster in clusters:
            try:
                cluster.close()
            except AssertionError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]


class EvalRun:
    def __init__(self, tmp_path: Path, clusters: list[LocalCluster], **training: Any) -> None:
        self.ckpt_dir = tmp_path / "ckpts"
        self.run_dir = tmp_path / "run"
        config = {
            "program": PROGRAM,
            "args": ARGS,
            "data": DATA,
            "seed": SEED,
            "checkpoint": {"dir": str(self.ckpt_dir)},
            **training,
        }
        self.cluster = LocalCluster(self.run_dir, config, num_ps=0, num_workers=0, cluster_id="eval-test")
        clusters.append(self.cluster)
        # the evaluator needs no port: it only has to be named in the cluster
        self.cluster.jobs["evaluator"] = ["127.0.0.1:1"]

    def start(self) -> Role:
        return self.cluster.start("evaluator", 0)

    def write(self, snapshot: Snapshot) -> Path:
        return write_checkpoint(self.ckpt_dir, snapshot)

    def finish_training(self) -> None:
        """What the chief writes when training is done."""
        (self.run_dir / "result.json").write_text(json.dumps({"global_step": STEPS[-1]}))

    def evaluations(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir / "eval.jsonl")

    def evaluated_steps(self) -> list[int]:
        return [int(r["global_step"]) for r in self.evaluations()]

    def wait_for_exit(self, timeout: float = START_TIMEOUT) -> int:
        return self.cluster.wait_for_exit("evaluator", timeout=timeout)

    def log(self) -> str:
        return self.cluster.role("evaluator").log()


def assert_metrics_of(record: dict[str, Any], program: Program, snapshot: Snapshot) -> None:
    want = evaluate_snapshot(program, snapshot)
    assert record["global_step"] == snapshot.global_step
    assert record["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert record["accuracy"] == pytest.approx(want["accuracy"])
    assert record["examples"] == want["examples"] > 0


def test_evaluates_the_newest_checkpoint_and_stops_once_training_is_done(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    run = EvalRun(tmp_path, evaluators)
    snapshots = {step: make_snapshot(program, step) for step in STEPS}
    for snapshot in snapshots.values():
        run.write(snapshot)
    run.finish_training()
    # the checkpoints really differ in what they evaluate to
    assert evaluate_snapshot(program, snapshots[200])["loss"] != evaluate_snapshot(program, snapshots[300])["loss"]

    run.start()
    rc = run.wait_for_exit()
    assert rc == 0, run.log()

    # like SidecarEvaluator: only the newest checkpoint, the older ones are skipped
    records = run.evaluations()
    assert [r["global_step"] for r in records] == [300], run.log()
    assert_metrics_of(records[0], program, snapshots[300])
    assert records[0]["checkpoint"].endswith("ckpt-000000000300")
    assert "training is done and its last checkpoint evaluated: stopping" in run.log()


def test_follows_new_checkpoints_until_training_is_done(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    run = EvalRun(tmp_path, evaluators)
    role = run.start()
    snapshots = {step: make_snapshot(program, step) for step in STEPS}

    run.write(snapshots[100])
    wait_until(lambda: 100 in run.evaluated_steps(), timeout=START_TIMEOUT, what="the evaluation of step 100",
               detail=run.log)
    assert role.popen.poll() is None, "the evaluator stopped although training is not done"

    run.write(snapshots[200])
    run.write(snapshots[300])
    wait_until(lambda: 300 in run.evaluated_steps(), timeout=30, what="the evaluation of step 300", detail=run.log)
    assert role.popen.poll() is None, "the evaluator stopped although training is not done"

    run.finish_training()
    rc = run.wait_for_exit(timeout=30)
    assert rc == 0, run.log()

    steps = run.evaluated_steps()
    assert steps[0] == 100
    assert steps[-1] == 300
    assert steps == sorted(set(steps)), "a checkpoint was evaluated twice or out of order"
    assert set(steps) <= set(STEPS)  # 200 may have been skipped: the evaluator keeps up with the newest
    for record in run.evaluations():
        assert_metrics_of(record, program, snapshots[record["global_step"]])


def test_an_evaluator_away_from_the_chief_stops_on_its_word_beside_the_shared_checkpoints(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    """Without the chief's result.json on its host (the chief runs or moved elsewhere), the evaluator stops on
    the finished.json the chief leaves in the shared checkpoint folder, and only on its own cluster's."""
    run = EvalRun(tmp_path, evaluators)
    run.write(make_snapshot(program, 100))
    mark_finished(run.ckpt_dir, "another-cluster", 100)  # an earlier cluster that used the same folder
    role = run.start()
    wait_until(lambda: 100 in run.evaluated_steps(), timeout=START_TIMEOUT, what="the evaluation of step 100",
               detail=run.log)
    # Its own cluster's word, for a step whose checkpoint it has not seen yet (a shared folder's listing can
    # lag): it goes on waiting, for several of its 1 s polls.
    mark_finished(run.ckpt_dir, "eval-test", 200)
    watch_until = time.monotonic() + 3.0
    while time.monotonic() < watch_until:
        assert role.popen.poll() is None, f"the evaluator stopped before evaluating step 200\n{run.log()}"
        time.sleep(0.1)
    run.write(make_snapshot(program, 200))
    assert run.wait_for_exit(timeout=30) == 0, run.log()
    assert run.evaluated_steps() == [100, 200]  # the last checkpoint is evaluated before it stops
    assert not (run.run_dir / "result.json").exists()


@pytest.mark.parametrize("damage", ["flip-byte", "no-manifest"])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program, damage: str
) -> None:
    run = EvalRun(tmp_path, evaluators)
    snapshots = {step: make_snapshot(program, step) for step in STEPS}
    paths = {step: run.write(snapshot) for step, snapshot in snapshots.items()}
    newest = paths[300]
    if damage == "flip-byte":
        data = bytearray((newest / "arrays.npz").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "arrays.npz").write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    run.finish_training()

    run.start()
    rc = run.wait_for_exit()
    log = run.log()
    assert rc == 0, log

    records = run.evaluations()
    assert [r["global_step"] for r in records] == [200], log
    assert_metrics_of(records[0], program, snapshots[200])
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    assert any("skipping a checkpoint that cannot be loaded" in w and newest.name in w for w in warnings), log


def test_max_evaluations_stops_the_evaluator(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    run = EvalRun(tmp_path, evaluators, max_evaluations=1)
    snapshots = {step: make_snapshot(program, step) for step in STEPS[:2]}
    for snapshot in snapshots.values():
        run.write(snapshot)
    assert not (run.run_dir / "result.json").exists()  # training is not done: only the limit can stop it

    run.start()
    rc = run.wait_for_exit()
    assert rc == 0, run.log()
    records = run.evaluations()
    assert [r["global_step"] for r in records] == [200]
    assert_metrics_of(records[0], program, snapshots[200])
    assert "stopping after 1 evaluations" in run.log()


def test_eval_every_steps_evaluates_checkpoints_that_far_apart_and_the_final_one(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    """`training.eval_every_steps` was accepted and read by nothing: every checkpoint was evaluated."""
    run = EvalRun(tmp_path, evaluators, eval_every_steps=150)
    snapshots = {step: make_snapshot(program, step) for step in (100, 200, 300, 350, 400)}
    run.write(snapshots[100])  # not 150 steps into training
    role = run.start()
    wait_until(lambda: "the checkpoint of global step 100 is 100 steps past the last evaluated (eval_every_steps "
               "150): waiting for a later one" in run.log(), timeout=START_TIMEOUT, what="step 100 passed over",
               detail=run.log)
    run.write(snapshots[200])
    wait_until(lambda: run.evaluated_steps() == [200], timeout=30, what="the evaluation of step 200", detail=run.log)
    run.write(snapshots[300])  # 100 past 200
    wait_until(lambda: "global step 300 is 100 steps past" in run.log(), timeout=30, what="step 300 passed over",
               detail=run.log)
    run.write(snapshots[350])
    wait_until(lambda: run.evaluated_steps() == [200, 350], timeout=30, what="step 350's", detail=run.log)
    run.write(snapshots[400])  # 50 past 350, but the final one
    run.finish_training()
    assert run.wait_for_exit(timeout=30) == 0, run.log()
    assert run.evaluated_steps() == [200, 350, 400] and role.popen.poll() == 0


def test_the_evaluator_needs_a_checkpoint_folder(tmp_path: Path, evaluators: list[LocalCluster]) -> None:
    run = EvalRun(tmp_path, evaluators)
    run.cluster.training["checkpoint"] = None
    run.start()
    rc = run.wait_for_exit()
    assert rc == 2, run.log()  # a configuration error: permanent, not restarted
    assert "the evaluator needs checkpoints" in run.log()
    assert not (run.run_dir / "eval.jsonl").exists()


def trained_snapshot(program: Program, steps: int) -> Snapshot:
    """Variables after ``steps`` of plain in-process Adam on the training split: more steps, better model."""
    params = {}
    for var in program.variables():
        rng = np.random.default_rng(zlib.crc32(var.name.encode()))
        limit = np.sqrt(6.0 / sum(var.shape)) if len(var.shape) == 2 else 0.0
        params[var.name] = rng.uniform(-limit, limit, var.shape).astype(var.dtype)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    data = program.dataset("train", 0, 1)
    for t in range(1, steps + 1):
        _loss, grads = program.loss_and_grads(params, data.batch(t - 1, 100))
        for k, grad in grads.items():
            g = grad.dense() if isinstance(grad, LowRankGrad) else grad
            m[k] = 0.9 * m[k] + 0.1 * g
            v2[k] = 0.999 * v2[k] + 0.001 * g * g
            lr = 0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
            params[k] = (params[k] - lr * m[k] / (np.sqrt(v2[k]) + 1e-7)).astype(params[k].dtype)
    return Snapshot(steps, [], params, {}, {"program": PROGRAM})


def test_three_checkpoints_of_a_training_run_show_increasing_accuracy(
    tmp_path: Path, evaluators: list[LocalCluster], program: Program
) -> None:
    run = EvalRun(tmp_path, evaluators)
    run.start()
    steps = (2, 20, 200)
    for step in steps:  # each written only once the previous one was evaluated, so none is skipped
        run.write(trained_snapshot(program, step))
        wait_until(lambda s=step: s in run.evaluated_steps(), timeout=START_TIMEOUT,
                   what=f"the evaluation of step {step}", detail=run.log)
    run.finish_training()
    assert run.wait_for_exit(timeout=30) == 0, run.log()
    records = run.evaluations()
    assert [r["global_step"] for r in records] == list(steps)
    accuracies = [r["accuracy"] for r in records]
    assert accuracies[0] < accuracies[1] < accuracies[2], accuracies
    assert accuracies[2] > 0.9, accuracies

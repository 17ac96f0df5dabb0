"""Evaluating the current parameters on a batch: shared by the chief, workers and the evaluator."""

from __future__ import annotations

from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Batch
from psctl.runtime.ps_client import PsClient


def evaluate_batch(model: ShardedModel, ps: PsClient, batch: Batch) -> tuple[dict[str, float], int]:
    """The program's metrics on ``batch`` with the parameters now on the PS, and ps 0's global step."""
    program = model.program
    ids = program.embedding_ids(batch)
    plan = model.pull_plan(ids)
    pulled, global_step = ps.pull(plan, model.pull_bytes(plan))
    metrics = program.evaluate(model.assemble(ids, pulled), batch)
    return {k: float(v) for k, v in metrics.items()}, global_step


def evaluate_split(model: ShardedModel, ps: PsClient, split: str = "test") -> tuple[dict[str, float], int]:
    """Metrics over a whole split, every example once (one epoch of the split's stream)."""
    dataset = model.program.dataset(split, 0, 1)
    batch = dataset.batch(0, dataset.num_examples)
    metrics, step = evaluate_batch(model, ps, batch)
    metrics["examples"] = float(dataset.num_examples)
    return metrics, step

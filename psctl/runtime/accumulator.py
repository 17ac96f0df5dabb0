"""Synchronous training's accumulator: the gradients of one step, averaged once enough have arrived.

One per PS, covering all its shards (TensorFlow keeps one ConditionalAccumulator per variable; every push
here carries all of a step's gradients for the PS at once, so one count serves them all). Dense gradients are
averaged over the gradients received; sparse ones per row, over the gradients that touched that row.
Towards ``replicas_to_aggregate`` it counts gradients (TensorFlow's rule) or, if asked, distinct replicas, so
that one fast replica cannot stand in for several.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: One update for one shard: (shard, local rows or None for dense, gradient)
Update = tuple[Any, "np.ndarray | None", np.ndarray]


@dataclass
class StepAccumulator:
    replicas_to_aggregate: int
    distinct_replicas: bool = False
    step: int = 0
    gradients: int = 0
    replicas: set[str] = field(default_factory=set)
    _dense: dict[str, tuple[Any, np.ndarray, int]] = field(default_factory=dict)
    _sparse: dict[str, tuple[Any, list[np.ndarray], list[np.ndarray]]] = field(default_factory=dict)

    def count(self) -> int:
        return len(self.replicas) if self.distinct_replicas else self.gradients

    def ready(self) -> bool:
        return self.count() >= self.replicas_to_aggregate

    def add(self, task: str, updates: list[Update]) -> None:
        """Add one replica's gradients for the current step."""
        self.gradients += 1
        self.replicas.add(task)
        for shard, rows, grad in updates:
            name = shard.spec.name
            if rows is None:
                if name in self._dense:
                    _, total, n = self._dense[name]
                    total += grad
                    self._dense[name] = (shard, total, n + 1)
                else:
                    self._dense[name] = (shard, grad.astype(np.float64), 1)
            else:
                unique, inverse = np.unique(rows, return_inverse=True)
                if len(unique) != len(rows):  # one replica's repeated id is one contribution: its rows summed
                    summed = np.zeros((len(unique), *grad.shape[1:]), dtype=np.float64)
                    np.add.at(summed, inverse, grad)
                    rows, grad = unique, summed
                _, all_rows, all_values = self._sparse.setdefault(name, (shard, [], []))
                all_rows.append(rows)
                all_values.append(grad)

    def averaged(self) -> list[Update]:
        out: list[Update] = []
        for shard, total, n in self._dense.values():
            out.append((shard, None, (total / n).astype(shard.value.dtype)))
        for shard, all_rows, all_values in self._sparse.values():
            rows = np.concatenate(all_rows)
            values = np.concatenate(all_values).astype(np.float64)
            unique, inverse = np.unique(rows, return_inverse=True)
            sums = np.zeros((len(unique), *values.shape[1:]), dtype=np.float64)
            np.add.at(sums, inverse, values)
            counts = np.bincount(inverse, minlength=len(unique)).astype(np.float64)
            mean = sums / counts.reshape(-1, *([1] * (values.ndim - 1)))
            out.append((shard, unique, mean.astype(shard.value.dtype)))
        return out

    def reset(self, step: int) -> None:
        self.step = step
        self.gradients = 0
        self.replicas = set()
        self._dense = {}
        self._sparse = {}

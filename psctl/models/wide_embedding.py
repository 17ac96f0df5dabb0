"""A wide embedding model: mean-pooled id embeddings feeding a logistic head.

The table is an embedding variable, so only the rows a batch touches travel between workers and parameter
servers, and its gradient is row-sparse. Args: ``vocab_size`` (default from the data config) and ``dim``
(default 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psctl.models import compute_dtype, dense, resolve_args
from psctl.models.data import ArrayDataset, data_shape, load_dataset
from psctl.runtime.program import Batch, EmbeddingRows, Grads, Params, Program, SparseGrad, VariableDef
from psctl.runtime.rows import unique_ids

NAME = "psctl.models.wide_embedding"
TABLE = "emb/table"


def build(args: dict[str, Any], data: dict[str, Any], seed: int) -> Program:
    opts = resolve_args(NAME, args, {"vocab_size": data_shape(data, seed).vocab_size, "dim": 16})
    return WideEmbedding(opts["vocab_size"], opts["dim"], dict(data), seed)


@dataclass
class WideEmbedding:
    vocab_size: int
    dim: int
    data: dict[str, Any]
    seed: int

    def variables(self) -> list[VariableDef]:
        return [
            VariableDef(TABLE, (self.vocab_size, self.dim), initializer="normal", init_scale=0.01, embedding=True),
            VariableDef("head/kernel", (self.dim, 1), initializer="glorot_uniform"),
            VariableDef("head/bias", (1,), initializer="zeros"),
        ]

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        return {TABLE: unique_ids(self._ids(batch)).astype(np.int64, copy=False)}

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]:
        kernel, bias = dense(params, "head/kernel"), dense(params, "head/bias")
        ids = self._ids(batch)
        rows, pos, pooled, z = self._forward(params, ids)
        y = binary_labels(batch, z.dtype)
        dz = (sigmoid(z) - y) / len(y)
        # Each of an example's k ids receives 1/k of the pooled gradient dz_i * kernel, so a row's gradient is
        # kernel times the sum of dz_i / k over its occurrences: one weight per id to sum (bincount, repeated
        # ids included), not one per id and dimension.
        k = ids.shape[1]
        per_row = np.bincount(pos.reshape(-1), weights=np.repeat(dz / k, k), minlength=len(rows.ids))
        table_grad = np.multiply.outer(per_row.astype(rows.rows.dtype), kernel[:, 0].astype(rows.rows.dtype))
        return binary_cross_entropy(z, y), {
            TABLE: SparseGrad(rows.ids, table_grad),
            "head/kernel": (pooled.T @ dz)[:, None].astype(kernel.dtype, copy=False),
            "head/bias": np.array([dz.sum()], dtype=bias.dtype),
        }

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        _, _, _, z = self._forward(params, self._ids(batch))
        y = binary_labels(batch, z.dtype)
        return {
            "loss": binary_cross_entropy(z, y),
            "accuracy": float(((z > 0) == (y > 0.5)).mean()),
            "auc": auc(z, y),
        }

    def dataset(self, split: str, shard: int, num_shards: int) -> ArrayDataset:
        return load_dataset(self.data, split=split, shard=shard, num_shards=num_shards, seed=self.seed)

    def _ids(self, batch: Batch) -> np.ndarray:
        ids = np.asarray(batch["x"])
        ids = ids.reshape(len(ids), -1)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{NAME} needs integer ids in batch['x'], got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size}), got [{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64, copy=False)

    def _forward(self, params: Params, ids: np.ndarray) -> tuple[EmbeddingRows, np.ndarray, np.ndarray, np.ndarray]:
        """(rows, position of each id in rows, pooled embeddings, logits)."""
        kernel, bias = dense(params, "head/kernel"), dense(params, "head/bias")
        rows = embedding_rows(params[TABLE], ids)
        pos = rows.positions(ids)
        if np.any(pos >= len(rows.ids)) or not np.array_equal(rows.ids[pos], ids):
            raise ValueError(f"the rows of {TABLE!r} given do not include every id of the batch")
        dtype = compute_dtype(kernel)
        pooled = rows.rows[pos].astype(dtype, copy=False).mean(axis=1)
        return rows, pos, pooled, pooled @ kernel[:, 0] + bias[0]


def embedding_rows(table: np.ndarray | EmbeddingRows, ids: np.ndarray) -> EmbeddingRows:
    """The runtime passes rows; a whole table (local runs, tests) is reduced to the rows ``ids`` need."""
    if isinstance(table, EmbeddingRows):
        return table
    unique = unique_ids(ids).astype(np.int64, copy=False)
    return EmbeddingRows(unique, np.asarray(table)[unique])


def binary_labels(batch: Batch, dtype: np.dtype) -> np.ndarray:
    y = np.asarray(batch["y"]).reshape(-1)
    if y.size and (y.min() < 0 or y.max() > 1):
        raise ValueError(f"{NAME} needs 0/1 labels, got values in [{y.min()}, {y.max()}]")
    return y.astype(dtype, copy=False)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """tanh form: no overflow for large |z|, unlike 1 / (1 + exp(-z))."""
    return 0.5 * (1 + np.tanh(0.5 * z))


def binary_cross_entropy(z: np.ndarray, y: np.ndarray) -> float:
    """Mean sigmoid cross-entropy from logits, in the form that never takes exp of a positive number."""
    return float((np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))).mean())


def auc(scores: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve from the Mann-Whitney rank statistic (ties get average ranks); nan if
    the batch holds only one class."""
    positive = y > 0.5
    n_pos = int(positive.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, group, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = (ends - (counts - 1) / 2.0)[group.reshape(-1)]  # 1-based average rank of each score
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))

"""The classic "mnist replica" MLP: hidden relu layers, then softmax cross-entropy.

Args: ``hidden_units`` (default 100; a list such as ``[1024, 1024]`` for several hidden layers), and
``num_features`` / ``num_classes`` when the data config does not imply them. Variables: ``hid/*`` for the
first hidden layer, ``hid_2/*``, ``hid_3/*``... for further ones, ``sm/*`` for the softmax layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from psctl.models import compute_dtype, dense, resolve_args
from psctl.models.data import ArrayDataset, data_shape, load_dataset
from psctl.models.softmax import classification_metrics, features, labels, softmax_cross_entropy
from psctl.runtime.builtin_programs import arg_expected
from psctl.runtime.program import Batch, Grads, LowRankGrad, Params, Program, VariableDef

NAME = "psctl.models.mlp"


def build(args: dict[str, Any], data: dict[str, Any], seed: int) -> Program:
    shape = data_shape(data, seed)
    opts = resolve_args(NAME, {k: v for k, v in args.items() if k != "hidden_units"},
                        {"num_features": shape.num_features, "num_classes": shape.num_classes})
    hidden = _hidden_units(args.get("hidden_units", 100))
    return Mlp(opts["num_features"], hidden, opts["num_classes"], dict(data), seed)


def _hidden_units(value: Any) -> tuple[int, ...]:
    expected = arg_expected(NAME, "hidden_units", value)
    if expected is not None:
        raise ValueError(f"args.hidden_units for {NAME} must be {expected}, got {value!r}")
    return tuple(int(h) for h in (value if isinstance(value, (list, tuple)) else [value]))


def _layer_names(depth: int) -> list[str]:
    return ["hid", *(f"hid_{i}" for i in range(2, depth + 1)), "sm"]


@dataclass
class Mlp:
    num_features: int
    hidden_units: int | tuple[int, ...]
    num_classes: int
    data: dict[str, Any]
    seed: int

    @property
    def widths(self) -> list[int]:
        hidden = (self.hidden_units,) if isinstance(self.hidden_units, int) else tuple(self.hidden_units)
        return [self.num_features, *hidden, self.num_classes]

    def variables(self) -> list[VariableDef]:
        widths = self.widths
        out = []
        for name, fan_in, fan_out in zip(_layer_names(len(widths) - 2), widths[:-1], widths[1:], strict=True):
            out.append(VariableDef(f"{name}/kernel", (fan_in, fan_out), initializer="glorot_uniform"))
            out.append(VariableDef(f"{name}/bias", (fan_out,), initializer="zeros"))
        return out

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        return {}

    def _forward(self, params: Params, batch: Batch) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[np.ndarray],
                                                              list[np.ndarray], np.ndarray]:
        """Weights, each layer's input activation, each hidden layer's pre-activation, and the logits."""
        names = _layer_names(len(self.widths) - 2)
        weights = [(dense(params, f"{n}/kernel"), dense(params, f"{n}/bias")) for n in names]
        activation = features(batch, self.num_features, compute_dtype(weights[0][0]))
        inputs, pres = [], []
        for w, b in weights[:-1]:
            inputs.append(activation)
            pre = activation @ w + b
            pres.append(pre)
            activation = np.maximum(pre, 0)
        inputs.append(activation)
        w, b = weights[-1]
        return weights, inputs, pres, activation @ w + b

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]:
        weights, inputs, pres, logits = self._forward(params, batch)
        loss, _, delta = softmax_cross_entropy(logits, labels(batch, self.num_classes))
        grads: Grads = {}
        names = _layer_names(len(pres))
        for i in range(len(weights) - 1, -1, -1):
            w, _b = weights[i]
            # the kernel's gradient inputs.T @ delta, left as its two factors: the runtime sends whichever of
            # them and their product is smaller
            grads[f"{names[i]}/kernel"] = LowRankGrad(inputs[i].astype(w.dtype, copy=False),
                                                      delta.astype(w.dtype, copy=False))
            grads[f"{names[i]}/bias"] = delta.sum(axis=0).astype(w.dtype, copy=False)
            if i:
                delta = delta @ w.T
                np.multiply(delta, pres[i - 1] > 0, out=delta)  # relu passes gradient only where it was active
        return loss, grads

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        _weights, _inputs, _pres, logits = self._forward(params, batch)
        return classification_metrics(logits, labels(batch, self.num_classes))

    def dataset(self, split: str, shard: int, num_shards: int) -> ArrayDataset:
        return load_dataset(self.data, split=split, shard=shard, num_shards=num_shards, seed=self.seed)

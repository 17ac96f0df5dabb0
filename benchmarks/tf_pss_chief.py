"""The TensorFlow side of ``benchmarks.vs_tensorflow``: the chief of a ParameterServerStrategy cluster training
one of the workloads W1/W2/W3 exactly as psctl's ``benchmarks.workloads`` defines them, written as a TensorFlow
user who wants speed would write it. Reads TF_CONFIG (the ps and workers run ``python -m psctl.tfserver``).

    python -m benchmarks.tf_pss_chief WORKLOAD --steps N [--zipf S] [--warmup-fraction 0.1] [--steps-per-execution K]

Prints one JSON line: the steady rate (steps/s between the end of the warm-up steps and the last step) and the
wall times (``time.time()``) of the first step, the measured window's start and its end.

TensorFlow at its best, not at its most naive:
- the same models, shapes, initial scales, optimizers and data (psctl's own synthetic arrays, in memory as a
  ``tf.data`` pipeline per worker, shuffled, repeated, batched and prefetched);
- the optimizers are TensorFlow's fused kernels (``ResourceApplyAdam``, ``ResourceApplyGradientDescent``,
  ``ResourceSparseApplyAdagradV2``...), which the placer runs on the ps holding the variable, so a step sends
  only gradients (Keras 3, TensorFlow's Keras since 2.16, does not run under ParameterServerStrategy; tf_keras's
  legacy optimizers call these same kernels);
- W2 looks up each distinct id of a batch once (``tf.unique`` before ``tf.nn.embedding_lookup``), so pulls
  and the table's sparse gradient carry distinct rows only, as psctl's do;
- ``--steps-per-execution K`` (default 1, TensorFlow's default) runs K steps per scheduled function, as Keras's
  ``steps_per_execution`` does (here unrolled: K ``strategy.run`` calls in one ``tf.function``);
- variables are placed by the strategy itself (round-robin in creation order), W2's table (and its 64 x 1 head
  kernel, as psctl's fixed partitioner does) cut by ``FixedShardsPartitioner(2)``; every slot is colocated
  with its variable.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from typing import Any

import numpy as np
import tensorflow as tf

from benchmarks.workloads import training_config
from psctl.models.data import load_dataset


def glorot_uniform(shape: tuple[int, ...], dtype: tf.DType, partition_shape: Any = None,
                   partition_offset: Any = None) -> tf.Tensor:
    """Keras's glorot_uniform (fan_in + fan_out of the whole variable), per partition when sharded."""
    limit = float(np.sqrt(6.0 / (shape[0] + shape[-1])))
    return tf.random.uniform(partition_shape or shape, -limit, limit, dtype=dtype)


def normal(shape: tuple[int, ...], dtype: tf.DType, partition_shape: Any = None, partition_offset: Any = None,
           stddev: float = 0.01) -> tf.Tensor:
    return tf.random.normal(partition_shape or shape, stddev=stddev, dtype=dtype)


def zeros(shape: tuple[int, ...], dtype: tf.DType, partition_shape: Any = None,
          partition_offset: Any = None) -> tf.Tensor:
    return tf.zeros(partition_shape or shape, dtype=dtype)


def variable(init: Any, shape: tuple[int, ...], name: str) -> Any:
    """Created from a callable so each ps initialises its own variable (or shard): nothing large is sent."""
    return tf.Variable(functools.partial(init, shape=shape, dtype=tf.float32), shape=shape, dtype=tf.float32,
                       name=name)


def components(var: Any) -> list[tf.Variable]:
    """A ShardedVariable's parts, or the variable itself."""
    return list(getattr(var, "variables", [var]))


class FusedOptimizer:
    """One of TensorFlow's fused update kernels per variable, its slots created beside the variable."""

    def __init__(self, strategy: tf.distribute.Strategy, config: dict[str, Any], variables: list[tf.Variable],
                 step: tf.Variable) -> None:
        self.name = config["name"]
        self.lr = float(config["learning_rate"])
        self.step = step
        self.slots: dict[str, list[tf.Variable]] = {}
        for var in variables:
            with strategy.extended.colocate_vars_with(var):
                if self.name == "adam":
                    self.slots[var.name] = [tf.Variable(tf.zeros(var.shape), trainable=False) for _ in range(2)]
                elif self.name == "adagrad":
                    self.slots[var.name] = [tf.Variable(tf.fill(var.shape, 0.1), trainable=False)]

    def apply(self, grads: list[Any], variables: list[tf.Variable]) -> None:
        if self.name == "adam":  # TF's ApplyAdam: bias correction from the (shared) step count
            t = tf.cast(self.step.read_value() + 1, tf.float32)
            beta1_power, beta2_power = tf.pow(0.9, t), tf.pow(0.999, t)
        for grad, var in zip(grads, variables, strict=True):
            slots = self.slots.get(var.name, [])
            if self.name == "sgd":
                tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=self.lr, delta=grad)
            elif self.name == "adam":
                tf.raw_ops.ResourceApplyAdam(
                    var=var.handle, m=slots[0].handle, v=slots[1].handle, beta1_power=beta1_power,
                    beta2_power=beta2_power, lr=self.lr, beta1=0.9, beta2=0.999, epsilon=1e-7, grad=grad)
            elif isinstance(grad, tf.IndexedSlices):
                tf.raw_ops.ResourceSparseApplyAdagradV2(
                    var=var.handle, accum=slots[0].handle, lr=self.lr, epsilon=1e-7, grad=grad.values,
                    indices=grad.indices)
            else:
                tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=slots[0].handle, lr=self.lr, epsilon=1e-7,
                                                  grad=grad)


def build(workload: str, training: dict[str, Any], strategy: tf.distribute.Strategy) -> tuple[Any, list[Any]]:
    """(forward(x) -> logits, the model's variables) for a workload, created under ``strategy.scope()``."""
    if workload == "w2":
        vocab, dim = training["args"]["vocab_size"], training["args"]["dim"]
        table = variable(normal, (vocab, dim), "emb/table")
        kernel = variable(glorot_uniform, (dim, 1), "head/kernel")
        bias = variable(zeros, (1,), "head/bias")

        def forward(ids: tf.Tensor) -> tf.Tensor:
            unique, position = tf.unique(tf.reshape(ids, [-1]))
            rows = tf.gather(tf.nn.embedding_lookup(table, unique), position)
            pooled = tf.reduce_mean(tf.reshape(rows, [-1, ids.shape[1], dim]), axis=1)
            return tf.squeeze(pooled @ tf.convert_to_tensor(kernel), 1) + bias

        return forward, [table, kernel, bias]
    data = training["data"]
    hidden = training["args"]["hidden_units"]
    widths = [data["num_features"], *(hidden if isinstance(hidden, list) else [hidden]), data["num_classes"]]
    layers = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        layers.append((variable(glorot_uniform, (fan_in, fan_out), f"layer{i}/kernel"),
                       variable(zeros, (fan_out,), f"layer{i}/bias")))

    def mlp(x: tf.Tensor) -> tf.Tensor:
        for i, (w, b) in enumerate(layers):
            x = x @ w + b
            if i < len(layers) - 1:
                x = tf.nn.relu(x)
        return x

    return mlp, [v for layer in layers for v in layer]


def loss_fn(workload: str, logits: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    if workload == "w2":
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.cast(y, tf.float32), logits=logits))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=("w1", "w2", "w3"))
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--zipf", type=float, default=0.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.1)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    args = parser.parse_args(argv)
    per_call = max(1, args.steps_per_execution)
    training = training_config(args.workload, steps=args.steps, zipf=args.zipf)
    batch_size = training["batch_size"]

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
                   if "partitioner" in training else None)
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        forward, model_vars = build(args.workload, training, strategy)
        trainable = [part for var in model_vars for part in components(var)]
        step = tf.Variable(0, dtype=tf.int64, name="global_step", trainable=False)
        optimizer = FusedOptimizer(strategy, training["optimizer"], trainable, step)

    train = load_dataset(training["data"], split="train", shard=0, num_shards=1, seed=training["seed"])
    x_all, y_all = np.asarray(train.x), np.asarray(train.y)

    def dataset_fn() -> tf.data.Dataset:
        return (tf.data.Dataset.from_tensor_slices((x_all, y_all)).shuffle(len(x_all)).repeat()
                .batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def replica_fn(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        x, y = batch
        with tf.GradientTape() as tape:
            loss = loss_fn(args.workload, forward(x), y)
        optimizer.apply(tape.gradient(loss, trainable), trainable)
        step.assign_add(1)
        return loss

    @tf.function
    def train_step(it: Any) -> Any:
        loss = strategy.run(replica_fn, args=(next(it),))
        # steps_per_execution: the call's other steps, unrolled in the graph (a Python loop: with one step per
        # call, the default, the function is exactly one step; a tf.range loop of no iterations cost TensorFlow
        # 1.2-1.6x the CPU per step in one run: W1 8.3 against 5.2 ms)
        for _ in range(per_call - 1):
            loss = strategy.run(replica_fn, args=(next(it),))
        return loss

    coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()
    first_step = time.time()
    warm = max(1, round(args.steps * args.warmup_fraction / per_call)) - 1
    for _ in range(warm):
        coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()
    start, start_step = time.time(), int(step.numpy())
    loss = None
    for _ in range(-(-(args.steps - start_step) // per_call)):
        loss = coordinator.schedule(train_step, args=(iterator,))
    coordinator.join()
    end, end_step = time.time(), int(step.numpy())
    print(json.dumps({
        "steps_per_s": (end_step - start_step) / (end - start),
        "first_step_at": first_step, "measured_from": start, "measured_to": end,
        "measured_steps": end_step - start_step, "global_step": end_step,
        "last_loss": float(loss.fetch()) if loss is not None else None,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A TensorFlow 2 ParameterServerStrategy trainer, as a user writes one: linear regression on synthetic data,
a custom training loop scheduled by a ClusterCoordinator, checkpoints by a CheckpointManager (it resumes from the
latest one), and an evaluator role that follows the checkpoints. Nothing in it knows psctl: it reads TF_CONFIG.

    python tf2_pss_train.py --steps 300 --checkpoint_dir DIR

The chief runs this file; the ps and workers run tf.distribute.Server (psctl's psctl.tfserver); the evaluator
runs this file too and evaluates each new checkpoint until the one of the last step.
"""

from __future__ import annotations

import argparse
import time

import tensorflow as tf

FEATURES = 20
BATCH = 64
LEARNING_RATE = 0.05


def synthetic(seed: int) -> tuple[tf.Tensor, tf.Tensor]:
    x = tf.random.stateless_normal([4096, FEATURES], seed=[seed, 7])
    true_w = tf.reshape(tf.range(FEATURES, dtype=tf.float32) / FEATURES, [FEATURES, 1])
    y = x @ true_w + 0.5 + 0.01 * tf.random.stateless_normal([4096, 1], seed=[seed, 8])
    return x, y


def variables() -> tuple[tf.Variable, tf.Variable, tf.Variable]:
    w = tf.Variable(tf.zeros([FEATURES, 1]), name="w")
    b = tf.Variable(tf.zeros([1]), name="b")
    step = tf.Variable(0, dtype=tf.int64, name="global_step")
    return w, b, step


def train(args: argparse.Namespace, resolver: tf.distribute.cluster_resolver.ClusterResolver) -> None:
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        w, b, step = variables()
    checkpoint = tf.train.Checkpoint(w=w, b=b, step=step)
    manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=3)
    restored = manager.restore_or_initialize()
    print(f"chief: starting at step {int(step.numpy())}" + (f" (restored {restored})" if restored else ""),
          flush=True)

    def dataset_fn() -> tf.data.Dataset:
        x, y = synthetic(seed=1)
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=3).repeat().batch(BATCH)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def train_step(it: object) -> tf.Tensor:
        def replica_fn(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
            x, y = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(x @ w + b - y))
            grad_w, grad_b = tape.gradient(loss, [w, b])
            w.assign_sub(LEARNING_RATE * grad_w)
            b.assign_sub(LEARNING_RATE * grad_b)
            step.assign_add(1)
            return loss

        return strategy.run(replica_fn, args=(next(it),))

    while (done := int(step.numpy())) < args.steps:
        losses = [coordinator.schedule(train_step, args=(iterator,))
                  for _ in range(min(args.checkpoint_every, args.steps - done))]
        coordinator.join()
        at = int(step.numpy())
        manager.save(checkpoint_number=at)
        print(f"chief: step {at} loss {float(losses[-1].fetch()):.5f}", flush=True)
    print(f"chief: finished at step {int(step.numpy())}", flush=True)


def evaluate(args: argparse.Namespace) -> None:
    """Evaluate each new checkpoint (the latest only) until the one of the last step."""
    w, b, step = variables()
    checkpoint = tf.train.Checkpoint(w=w, b=b, step=step)
    x, y = synthetic(seed=2)
    seen = None
    while True:
        latest = tf.train.latest_checkpoint(args.checkpoint_dir)
        if latest is not None and latest != seen:
            checkpoint.restore(latest).expect_partial()
            seen = latest
            loss = float(tf.reduce_mean(tf.square(x @ w + b - y)))
            print(f"evaluator: step {int(step.numpy())} eval loss {loss:.5f}", flush=True)
            if int(step.numpy()) >= args.steps:
                return
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--checkpoint_every", type=int, default=50)
    args = parser.parse_args()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type == "evaluator":
        evaluate(args)
    else:
        train(args, resolver)


if __name__ == "__main__":
    main()

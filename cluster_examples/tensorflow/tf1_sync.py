"""A TensorFlow 1 style between-graph replicated trainer, as such scripts are written: every role runs this
file with its job name and index; the ps serve; the chief and the workers train one graph each with
SyncReplicasOptimizer (every step averages one gradient from each replica) in a MonitoredTrainingSession
that checkpoints (the chief) and stops at --steps. It knows nothing of psctl.

    python tf1_sync.py --job_name=worker --task_index=0 --chief_host=h:p --ps_hosts=h:p,... \\
        --worker_hosts=h:p,... --steps=200 --checkpoint_dir=DIR
"""

from __future__ import annotations

import argparse

import tensorflow as tf

FEATURES = 20
BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("job_name", "chief_host", "ps_hosts", "worker_hosts", "checkpoint_dir"):
        parser.add_argument(f"--{flag}", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    tf.compat.v1.disable_eager_execution()
    workers = args.worker_hosts.split(",")
    cluster = tf.train.ClusterSpec({"chief": [args.chief_host], "ps": args.ps_hosts.split(","), "worker": workers})
    server = tf.distribute.Server(cluster, job_name=args.job_name, task_index=args.task_index)
    if args.job_name == "ps":
        server.join()
        return

    is_chief = args.job_name == "chief"
    replicas = 1 + len(workers)  # the chief trains too
    device = f"/job:{args.job_name}/task:{args.task_index}"
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(worker_device=device, cluster=cluster)):
        global_step = tf.compat.v1.train.get_or_create_global_step()
        x = tf.random.normal([BATCH, FEATURES], seed=args.task_index)
        true_w = tf.reshape(tf.range(FEATURES, dtype=tf.float32) / FEATURES, [FEATURES, 1])
        y = x @ true_w + 0.5
        w = tf.compat.v1.get_variable("w", [FEATURES, 1], initializer=tf.compat.v1.zeros_initializer())
        b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(x @ w + b - y))
        optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.05),
            replicas_to_aggregate=replicas, total_num_replicas=replicas)
        train_op = optimizer.minimize(loss, global_step=global_step)

    hooks = [optimizer.make_session_run_hook(is_chief), tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", device])  # replicas do not wait for each other
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=is_chief, hooks=hooks, config=config,
        checkpoint_dir=args.checkpoint_dir if is_chief else None, save_checkpoint_steps=50,
        stop_grace_period_secs=3,  # SyncReplicasOptimizer's token queue runner never ends by itself
    ) as session:
        step = local = 0
        while not session.should_stop():
            _, step, value = session.run([train_op, global_step, loss])
            local += 1
            if local % 10 == 0:  # this replica's 10th, 20th, ... gradient
                print(f"{args.job_name}:{args.task_index}: step {step} loss {value:.5f}", flush=True)
    if is_chief:  # the step of the final checkpoint, which the session wrote as it closed
        step = tf.train.load_variable(tf.train.latest_checkpoint(args.checkpoint_dir), "global_step")
    print(f"{args.job_name}:{args.task_index}: finished at step {step}", flush=True)


if __name__ == "__main__":
    main()

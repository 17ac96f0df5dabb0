"""``python -m psctl.tfserver``: a TensorFlow server for the ps or worker task that TF_CONFIG names.

What psctl runs for the ps and workers of a TensorFlow ParameterServerStrategy program that gives them no
command of their own (TensorFlow's coordinator, in the chief, sends them its work). Needs only tensorflow;
psctl itself never imports this module. SIGTERM ends it with code 75 (preempted: restarted, never counted as a
failure).
"""

from __future__ import annotations

import os
import signal
import sys

EXIT_PREEMPTED = 75  # (psctl.runtime.exits, without importing psctl's runtime next to TensorFlow)


def main() -> int:
    # SIGTERM blocked before TensorFlow starts its threads (they inherit the mask) and taken below with sigwait:
    # a handler would run only in the main thread, once back in Python, which server.join() never is; and a
    # thread of TensorFlow's may be the one the kernel gives the signal to
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        print(f"psctl.tfserver: TF_CONFIG's task is {resolver.task_type!r}; it serves ps and worker tasks",
              file=sys.stderr)
        return 2
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc", start=True)
    print(f"psctl.tfserver: {resolver.task_type}:{resolver.task_id} serving at {server.target}", flush=True)
    signal.sigwait({signal.SIGTERM})  # (it serves from TensorFlow's threads meanwhile)
    os._exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    sys.exit(main())

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
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        print(f"psctl.tfserver: TF_CONFIG's task is {resolver.task_type!r}; it serves ps and worker tasks",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_PREEMPTED))
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc", start=True)
    print(f"psctl.tfserver: {resolver.task_type}:{resolver.task_id} serving at {server.target}", flush=True)
    while server.target:  # (held here: it serves from TensorFlow's threads until the process ends)
        # not server.join(): a Python signal handler runs only once the main thread is back in Python, and join
        # never comes back (SIGTERM was ignored until the stop's grace ran out and SIGKILL came)
        signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())

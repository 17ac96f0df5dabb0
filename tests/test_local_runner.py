"""The local runner's process handling, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psutil
from cluster_helpers import wait_until

from psctl.launch.base import stop_processes
from psctl.launch.local import LocalRunner

#: Forks, the child starts a session of its own and forks the daemon (`sleep`), and both parents end: the daemon
#: leads no group (its group's leader is gone) and nothing waits for it.
DOUBLE_FORK = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
os.wait()
"""


def test_a_daemon_that_forked_twice_is_found_by_its_cluster_and_stopped() -> None:
    """`psctl down` found such a daemon by its environment, then could not signal it (a SIGKILL sent to the group
    it led, which was none) and said it "survived SIGKILL", on every try."""
    cluster_id = f"daemon-{uuid.uuid4().hex[:8]}"
    subprocess.run([sys.executable, "-c", DOUBLE_FORK], env={**os.environ, "PSCTL_CLUSTER_ID": cluster_id},
                   check=True, timeout=30)
    runner = LocalRunner()
    found = wait_until(lambda: runner.cluster_processes(cluster_id), timeout=10, what="the daemon")
    try:
        assert len(found) == 1 and psutil.Process(found[0].pid).name() == "sleep"
        assert os.getpgid(found[0].pid) != found[0].pid  # (it leads no group)
        assert stop_processes(runner, found, grace=0.5) == []
        assert runner.cluster_processes(cluster_id) == []
    finally:
        for handle in runner.cluster_processes(cluster_id):
            os.kill(handle.pid, 9)

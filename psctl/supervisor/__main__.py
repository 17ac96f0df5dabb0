"""``python -m psctl.supervisor CLUSTER_DIR``: the supervisor daemon that ``psctl up`` starts."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import psutil

from psctl.home import ClusterDir, take_supervision
from psctl.launch.hostset import host_runners, placements
from psctl.runtime.log_format import LOG_FORMAT
from psctl.signals import on_signals
from psctl.supervisor.daemon import Supervisor
from psctl.supervisor.state import ClusterState, cluster_spec, load_state, save_state

#: Seconds the supervisor of a Slurm job that Slurm stops waits for its roles to go before it records the
#: outcome: Slurm signals every step itself and SIGKILLs what is left after its KillWait (30 s by default).
SLURM_FINISH_WAIT = 5.0


def main(argv: list[str]) -> int:
    os.umask(0o077)  # logs, metrics, results and checkpoints are private to their owner
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout)
    cdir = ClusterDir(Path(argv[1]))
    held = take_supervision(cdir, wait=2.0)  # (held until this process ends)
    if held is None:
        logging.error("another supervisor of this cluster runs (it holds %s): this one exits", cdir.supervisor_lock)
        return 1
    if held < 0:
        logging.warning("%s cannot be locked here: nothing keeps a second supervisor out", cdir.supervisor_lock)
    record = load_state(cdir.state_file)
    spec = cluster_spec(cdir.spec_file, record)
    if record.backend == "slurm":  # in the cluster's job: its nodes, and a requeue's fresh start
        from psctl.slurm_cluster import prepare_run

        prepare_run(record)
    record.supervisor_pid = os.getpid()
    record.supervisor_create_time = psutil.Process().create_time()
    save_state(cdir.state_file, record)
    runners = host_runners(record.hosts)
    cwd = str(spec.path.parent if spec.path else cdir.root)
    supervisor = Supervisor(cdir, spec, record, placements(cdir, record.hosts, runners, cwd=cwd))

    def on_term(signum: int) -> None:
        logging.info("received %s: stopping the cluster", signal.Signals(signum).name)
        if record.backend == "slurm" and not cdir.stop_request.exists():
            # not psctl down: Slurm preempts, requeues or cancels the job, or its time is up
            supervisor.stop_reason = "stopped by Slurm (preempted, requeued, cancelled or out of time)"
            supervisor.default_grace = spec.supervision.preemption_grace
            supervisor.finish_wait = SLURM_FINISH_WAIT
        elif not cdir.stop_request.exists():  # (psctl down leaves its request before it signals)
            supervisor.stop_reason = f"stopped by {signal.Signals(signum).name} to the supervisor (pid {os.getpid()})"
        supervisor.request_stop()

    on_signals((signal.SIGTERM,), on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal of `psctl up` only detaches
    try:
        state = supervisor.run()
    except Exception:
        logging.exception("supervisor crashed; roles left as they were (psctl down cleans up)")
        return 1
    return 0 if state in (ClusterState.SUCCEEDED, ClusterState.STOPPED) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

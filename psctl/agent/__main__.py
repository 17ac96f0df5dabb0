"""``python -m psctl.agent``: the agent of one host, started by the supervisor (locally, or over SSH).

Its configuration is one JSON object in ``PSCTL_AGENT``: ``host`` (its name in the cluster), ``supervisor``
(``host:port`` of the supervisor's agent endpoint as this host reaches it), ``tls`` (``{ca, cert, key}`` file
paths, or null), ``interval`` (seconds between reports), ``grace`` (supervision.preemption_grace).
``PSCTL_CLUSTER_ID`` names the cluster. SIGTERM (the host is going away) stops its roles (SIGTERM, then
SIGKILL after the grace: a preempted role finishes its work first) and ends it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from psctl.agent.core import Agent, host_path
from psctl.agent.orphans import find_orphans, find_records
from psctl.runtime.cluster import TlsFiles
from psctl.signals import on_signals

EXIT_CONFIG = 2
STOP_GRACE = 5.0


def main() -> int:
    os.umask(0o077)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s agent: %(message)s",
                        stream=sys.stdout)
    try:
        config = json.loads(os.environ["PSCTL_AGENT"])
        cluster_id = os.environ["PSCTL_CLUSTER_ID"]
        tls = TlsFiles(**config["tls"]) if config.get("tls") else None
        agent = Agent(str(config["host"]), str(config["supervisor"]), cluster_id=cluster_id, tls=tls,
                      interval=float(config.get("interval", 1.0)),
                      heartbeat_host=str(config.get("heartbeat_host", "127.0.0.1")))
        grace = float(config.get("grace", STOP_GRACE))
    except (KeyError, ValueError, TypeError) as exc:
        print(f"psctl.agent: bad configuration in PSCTL_AGENT / PSCTL_CLUSTER_ID: {exc!r}", file=sys.stderr)
        return EXIT_CONFIG

    def on_term(signum: int) -> None:
        logging.info("received %s: stopping this host's roles", signal.Signals(signum).name)
        agent.handle_shutdown(grace)

    on_signals((signal.SIGTERM,), on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # adopted, or stopped; and those that ended while no agent watched them, reported as ended
    records = find_records(host_path(str(config["logs"])), cluster_id) if config.get("logs") else []
    agent.start(find_orphans(cluster_id, agent.host), records)
    logging.info("host %s: agent pid %d, heartbeats at %s, supervisor at %s", agent.host, os.getpid(),
                 agent.heartbeat_address, agent.supervisor)
    agent.wait()
    agent.join(2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

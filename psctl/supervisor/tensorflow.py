"""How a role of a TensorFlow program starts (``training.framework: tensorflow``): its command line, and
the TF_CONFIG TensorFlow reads.

TF_CONFIG's cluster holds the chief, the ps and the workers; an evaluator is not part of it (TensorFlow's
ParameterServerStrategy refuses a cluster with one) and only names itself as the task.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from psctl.launch.hostset import Placement
from psctl.spec import ClusterSpec
from psctl.spec.framework import fill
from psctl.supervisor.state import RoleRecord

#: The jobs of TF_CONFIG's cluster.
CLUSTER_JOBS = ("chief", "ps", "worker")
#: What runs a ps or worker that has no command of its own.
SERVER = ("{python}", "-m", "psctl.tfserver")


def tf_cluster(roles: Sequence[RoleRecord]) -> dict[str, list[str]]:
    jobs: dict[str, list[str]] = {}
    for role in sorted(roles, key=lambda r: (r.role, r.index)):
        if role.role in CLUSTER_JOBS:
            jobs.setdefault(role.role, []).append(role.endpoint)
    return jobs


def tf_config(roles: Sequence[RoleRecord], role: RoleRecord) -> str:
    return json.dumps({"cluster": tf_cluster(roles), "task": {"type": role.role, "index": role.index},
                       "rpc_layer": "grpc"})


def command_words(spec: ClusterSpec, role: RoleRecord) -> tuple[str, ...]:
    """The role's command (placeholders unfilled): its own, else the program's for the chief and evaluator,
    else psctl's TensorFlow server."""
    own = spec.roles[role.role].command
    if own:
        return own
    if role.role in ("chief", "evaluator"):
        return tuple(spec.training["command"])
    return SERVER


def argv(spec: ClusterSpec, roles: Sequence[RoleRecord], role: RoleRecord, *, python: str, run_dir: str,
         checkpoint_dir: str) -> list[str]:
    """The role's command line, placeholders filled."""
    cluster = tf_cluster(roles)
    evaluator = next((r.endpoint for r in roles if r.role == "evaluator"), "")
    values = {
        "role": role.role, "index": str(role.index), "task": f"{role.role}:{role.index}", "address": role.endpoint,
        "port": str(role.port), "chief_host": ",".join(cluster.get("chief", [])),
        "ps_hosts": ",".join(cluster.get("ps", [])), "worker_hosts": ",".join(cluster.get("worker", [])),
        "evaluator_host": evaluator, "checkpoint_dir": checkpoint_dir, "run_dir": run_dir, "python": python,
    }
    return fill(command_words(spec, role), values, python)


def start(spec: ClusterSpec, roles: Sequence[RoleRecord], role: RoleRecord, place: Placement) -> tuple[list[str], str]:
    """The role's command line and TF_CONFIG where ``place`` runs it (its checkpoint folder:
    ``training.checkpoint.dir``, else the cluster's on that host)."""
    folder = (spec.training.get("checkpoint") or {}).get("dir") or str(place.dirs.checkpoints)
    words = argv(spec, roles, role, python=place.python, run_dir=str(place.dirs.run_dir), checkpoint_dir=folder)
    return words, tf_config(roles, role)

"""Who am I and where is everyone: the cluster as a role learns it from its environment.

The launcher writes ``PSCTL_CLUSTER`` (psctl's own JSON, below) and ``TF_CONFIG`` (TensorFlow's format, so
that tools expecting it work unchanged). ``PSCTL_CLUSTER`` wins when both are set::

    {"cluster": {"chief": ["host:port"], "ps": [...], "worker": [...], "evaluator": [...]},
     "task": {"type": "worker", "index": 0},
     "cluster_id": "digits-1f2e", "incarnation": 3,
     "training": {...}, "run_dir": "/path", "supervisor": "host:port" | null,
     "tls": {"ca": path, "cert": path, "key": path} | null, "chief_incarnation": 7}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

JOBS = ("chief", "ps", "worker", "evaluator")


class ClusterConfigError(ValueError):
    """The environment does not describe a valid cluster; the role exits with code 2."""


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str


@dataclass(frozen=True)
class ClusterInfo:
    jobs: dict[str, list[str]]
    task_type: str
    task_index: int
    cluster_id: str = "psctl"
    incarnation: int = 0
    training: dict[str, Any] = field(default_factory=dict)
    run_dir: str = "."
    supervisor: str | None = None
    tls: TlsFiles | None = None
    #: The current chief's incarnation when this role started (see fencing): a ps or worker refuses an older
    #: chief from its first request on, before any heartbeat reply could have told it.
    chief_incarnation: int = 0

    @property
    def task(self) -> str:
        """``"worker:3"``: how logs, errors and fencing name this role."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str:
        return self.jobs[self.task_type][self.task_index]

    @property
    def ps(self) -> list[str]:
        return self.jobs.get("ps", [])

    @property
    def workers(self) -> list[str]:
        return self.jobs.get("worker", [])

    def bind_address(self) -> str:
        """Listen on this task's port on every interface of its host (the address may be a name)."""
        port = self.address.rsplit(":", 1)[1]
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{port}" if host in ("127.0.0.1", "localhost", "[::1]") else f"0.0.0.0:{port}"


def parse_cluster(jobs: Any, task_type: Any, task_index: Any) -> tuple[dict[str, list[str]], str, int]:
    if not isinstance(jobs, Mapping) or not jobs:
        raise ClusterConfigError("cluster must be a mapping of job name to a list of addresses")
    out: dict[str, list[str]] = {}
    for job, addrs in jobs.items():
        if job not in JOBS:
            raise ClusterConfigError(f"unknown job {job!r} in cluster; jobs are {', '.join(JOBS)}")
        if not isinstance(addrs, list) or not all(isinstance(a, str) and ":" in a for a in addrs):
            raise ClusterConfigError(f"job {job!r} must list 'host:port' addresses")
        out[job] = list(addrs)
    for job in ("chief", "evaluator"):
        if len(out.get(job, [])) > 1:
            raise ClusterConfigError(f"at most one {job} is allowed, got {len(out[job])}")
    if task_type not in out:
        raise ClusterConfigError(f"task type {task_type!r} is not a job of the cluster ({', '.join(out)})")
    if not isinstance(task_index, int) or not 0 <= task_index < len(out[task_type]):
        raise ClusterConfigError(f"task index {task_index!r} does not exist in job {task_type!r}")
    return out, task_type, task_index


def from_env(env: Mapping[str, str] | None = None) -> ClusterInfo:
    env = os.environ if env is None else env
    raw = env.get("PSCTL_CLUSTER")
    if raw:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"PSCTL_CLUSTER is not valid JSON: {exc}") from None
        task = data.get("task", {})
        jobs, task_type, task_index = parse_cluster(data.get("cluster"), task.get("type"), task.get("index"))
        tls = data.get("tls")
        return ClusterInfo(
            jobs=jobs,
            task_type=task_type,
            task_index=task_index,
            cluster_id=str(data.get("cluster_id", "psctl")),
            incarnation=int(data.get("incarnation", 0)),
            training=dict(data.get("training", {})),
            run_dir=str(data.get("run_dir", ".")),
            supervisor=data.get("supervisor"),
            tls=TlsFiles(**tls) if tls else None,
            chief_incarnation=int(data.get("chief_incarnation", 0)),
        )
    raw = env.get("TF_CONFIG")
    if raw:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ClusterConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
        task = data.get("task", {})
        jobs, task_type, task_index = parse_cluster(data.get("cluster"), task.get("type"), task.get("index"))
        return ClusterInfo(jobs=jobs, task_type=task_type, task_index=task_index)
    raise ClusterConfigError("neither PSCTL_CLUSTER nor TF_CONFIG is set; start roles with `psctl up`")


def tf_config(jobs: Mapping[str, list[str]], task_type: str, task_index: int) -> str:
    """TensorFlow's TF_CONFIG for this task (written by the launcher beside PSCTL_CLUSTER)."""
    return json.dumps(
        {"cluster": dict(jobs), "task": {"type": task_type, "index": task_index}, "rpc_layer": "grpc"}
    )

"""The hosts of one cluster as ``up`` prepared them, and a runner for each: what the supervisor, ``status``,
``logs`` and ``down`` use to reach a role wherever it runs.

``up`` records every SSH host in the cluster's state (:class:`RemoteHost`: how to connect, the cluster's folder
there, the PYTHONPATH of a psctl copy, the number of CPUs), so that later commands need neither the spec nor
another preflight. Roles without a host run here, under the local runner (host ``localhost``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from psctl.home import ClusterDir, RoleFolders
from psctl.launch.base import Runner
from psctl.launch.local import LocalRunner
from psctl.launch.remote import HostDir
from psctl.spec.model import HostSpec
from psctl.spec.plan import LOCAL_ADDRESS, LOCAL_HOST

if TYPE_CHECKING:
    from psctl.launch.ssh import SSHRunner


@dataclass(frozen=True)
class RemoteHost:
    """One SSH host of a running cluster (persisted in the state file as a dict)."""

    spec: HostSpec
    root: str
    #: Where ``up`` copied psctl on the host (None: the host's own psctl is used).
    pythonpath: str | None = None
    cpus: int = 1

    @property
    def dirs(self) -> HostDir:
        return HostDir(PurePosixPath(self.root))

    def to_dict(self) -> dict[str, Any]:  # (asdict turns the nested jump hosts into dicts too)
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RemoteHost:
        return cls(spec=_host_spec(raw["spec"]), root=str(raw["root"]), pythonpath=raw.get("pythonpath"),
                   cpus=int(raw.get("cpus", 1)))


def _host_spec(raw: Mapping[str, Any]) -> HostSpec:
    """A HostSpec from its asdict() form (fields added since it was written keep their defaults)."""
    known = {f.name for f in fields(HostSpec)}
    values = {k: v for k, v in dict(raw).items() if k in known}
    values["jump_hosts"] = tuple(_host_spec(h) for h in values.get("jump_hosts", ()))
    return HostSpec(**values)


@dataclass(frozen=True)
class Placement:
    """How the roles of one host are run: its runner, interpreter, folders, working folder, environment."""

    host: str
    runner: Runner
    python: str
    dirs: RoleFolders[Any]  # ClusterDir here, HostDir on an SSH host
    cwd: str
    #: The environment every role there starts from: this process's own here; on a host, only what psctl
    #: sets (the login environment of the host supplies the rest).
    base_env: Mapping[str, str]
    cpus: int
    remote: bool
    #: Where roles on this host listen (the address a role moved here gets).
    address: str = LOCAL_ADDRESS


def remote_hosts(records: Mapping[str, Mapping[str, Any]]) -> dict[str, RemoteHost]:
    return {name: RemoteHost.from_dict(raw) for name, raw in records.items()}


def host_runners(records: Mapping[str, Mapping[str, Any]]) -> dict[str, Runner]:
    """A runner per host of the cluster: ``localhost`` and every recorded SSH host (connecting lazily)."""
    runners: dict[str, Runner] = {LOCAL_HOST: LocalRunner()}
    for name, host in remote_hosts(records).items():
        runners[name] = ssh_runner(host.spec)
    return runners


def ssh_runner(host: HostSpec) -> SSHRunner:
    """A runner for ``host`` over SSH (connecting lazily). paramiko is imported here, where a cluster has a
    remote host, and not by every command: it is a third of what `psctl` imports (~0.15 s a start)."""
    from psctl.launch.ssh import SSHRunner

    return SSHRunner(host)


def placements(
    cdir: ClusterDir, records: Mapping[str, Mapping[str, Any]], runners: Mapping[str, Runner], *, cwd: str,
    python: str = sys.executable,
) -> dict[str, Placement]:
    """The placement of every host: this machine runs roles from ``cwd`` (the spec's folder)."""
    out = {
        LOCAL_HOST: Placement(LOCAL_HOST, runners[LOCAL_HOST], python, cdir, cwd, dict(os.environ),
                              os.cpu_count() or 1, remote=False)
    }
    for name, host in remote_hosts(records).items():
        env = {"PYTHONUNBUFFERED": "1"}
        if host.pythonpath:
            env["PYTHONPATH"] = host.pythonpath
        out[name] = Placement(name, runners[name], host.spec.python, host.dirs, str(host.dirs.files), env,
                              host.cpus, remote=True, address=host.spec.address)
    return out

"""The cluster's state as the supervisor keeps it, persisted atomically so any ``psctl`` can read it.

Role states and their transitions::

    PENDING ──► STARTING ──► RUNNING ──► SUCCEEDED                 (exit 0 where exiting is the job: chief)
                   │            ├──► LOST ───┐  (exited, killed, or heartbeat silent)
                   │            └──► STALLED ┤  (heartbeats go on, progress stopped: reported, then restarted)
                   │                         ├──► RESTARTING ──► STARTING     (restart policy allows)
                   └─────────────────────────┴──► FAILED                      (policy exhausted, permanent exit)
    any non-terminal ──► STOPPED                                    (down, or the cluster finished)

Terminal role states: SUCCEEDED, FAILED, STOPPED. The cluster: STARTING → RUNNING → SUCCEEDED | FAILED, and
STOPPING → STOPPED on ``psctl down``.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from psctl.errors import PsctlError
from psctl.runtime.atomic import write_json_atomic, write_text_atomic
from psctl.spec.model import ClusterSpec
from psctl.spec.plan import Plan, endpoint

E = TypeVar("E", bound=Enum)


class RoleState(str, Enum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    LOST = "lost"
    STALLED = "stalled"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_ROLE_STATES


_TERMINAL_ROLE_STATES = frozenset({RoleState.SUCCEEDED, RoleState.FAILED, RoleState.STOPPED})


class ClusterState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in (ClusterState.SUCCEEDED, ClusterState.FAILED, ClusterState.STOPPED)


@dataclass
class RoleRecord:
    name: str
    role: str
    index: int
    host: str
    address: str
    port: int
    state: RoleState = RoleState.PENDING
    pid: int | None = None
    #: psutil's create_time of the process: with the pid it identifies the process, even after pid reuse.
    create_time: float | None = None
    attempt: int = 0
    restarts: int = 0
    incarnation: int = 0
    started_at: float | None = None
    exit_code: int | None = None
    reason: str = ""
    last_heartbeat: float | None = None
    global_step: int = 0
    local_step: int = 0
    loss: float | None = None
    steps_per_sec: float | None = None
    rss_bytes: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    #: ``[first attempt, host]``: where the role started, then every host it moved to (each attempt's log stays
    #: on the host that ran it).
    hosts_by_attempt: list[list[Any]] = field(default_factory=list)
    #: Scaled away (psctl scale): stopped and never restarted; out of the cluster every role sees.
    retired: bool = False
    #: backend slurm: the allocated node the role's job step runs on.
    node: str = ""

    def host_of(self, attempt: int) -> str:
        """The host where ``attempt`` of the role ran (or runs)."""
        host = self.host
        for first, where in self.hosts_by_attempt:
            if int(first) <= attempt:
                host = str(where)
        return host

    @property
    def endpoint(self) -> str:
        """Where the role listens (``address:port``)."""
        return endpoint(self.address, self.port)

    def to_dict(self) -> dict[str, Any]:
        """The role's fields (a shallow copy: what is nested is plain JSON data, serialised at once)."""
        data = dict(self.__dict__)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RoleRecord:
        data = _known_fields(cls, raw, "a role")
        data["state"] = _enum(RoleState, data.get("state", "pending"))
        return cls(**data)


@dataclass
class ClusterRecord:
    name: str
    cluster_id: str
    #: The spec file the cluster was started from (its text as it was then is kept beside the state: see
    #: ``cluster_spec``) ...
    spec_path: str = ""
    #: ... with these ``--set`` overrides.
    spec_overrides: list[str] = field(default_factory=list)
    #: Roles talk mutual TLS with certificates under the cluster's tls/ folder.
    tls: bool = True
    state: ClusterState = ClusterState.STARTING
    supervisor_pid: int | None = None
    supervisor_create_time: float | None = None
    supervisor_address: str | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    steps: int = 0
    reason: str = ""
    result: dict[str, Any] | None = None
    roles: list[RoleRecord] = field(default_factory=list)
    #: The SSH hosts the cluster uses, as ``up`` prepared them: name -> RemoteHost fields (see
    #: psctl.launch.hostset), so that status, logs and down reach them without the spec.
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: What is wrong with an SSH host now (unreachable, benched), for ``psctl status``; absent when nothing.
    host_problems: dict[str, str] = field(default_factory=dict)
    #: Where the chief writes its checkpoints: a folder here, or ``host:folder`` on an SSH host ("" until the
    #: chief is started, or when training does not checkpoint), for ``psctl export`` while it trains.
    checkpoint_dir: str = ""
    #: The agent of every host: ``{"pid", "create_time", "forward_port"}`` (the port on an SSH host that
    #: forwards to the supervisor), so that a restarted supervisor finds them and listens where they dial.
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``local``, ``ssh`` or ``slurm`` (the spec's backend).
    backend: str = "local"
    #: ``psctl`` (its own runtime) or ``tensorflow`` (a TensorFlow program it runs and watches): the spec's
    #: ``training.framework``.
    framework: str = "psctl"
    #: backend slurm: ``{"job_id", "restarts", "nodes"}`` as the supervisor found them in its job.
    slurm: dict[str, Any] = field(default_factory=dict)

    def role(self, name: str) -> RoleRecord:
        """The role named ``name`` (KeyError if none): by an index, rebuilt when the list of roles changed."""
        index = self.__dict__.get("_index")
        if index is None or index[0] is not self.roles or len(index[1]) != len(self.roles):
            index = (self.roles, {r.name: r for r in self.roles})
            self.__dict__["_index"] = index
        return index[1][name]

    def up_command(self) -> str:
        """The command that starts this cluster again: its spec with the run's ``--set`` overrides."""
        return shlex.join(["psctl", "up", self.spec_path or "SPEC",
                           *(arg for override in self.spec_overrides for arg in ("--set", override))])

    def put_role(self, role: RoleRecord) -> None:
        """Add ``role`` after the last of its kind, or in place of the record of the same name (psctl scale)."""
        self.__dict__.pop("_index", None)
        for i, old in enumerate(self.roles):
            if old.name == role.name:
                self.roles[i] = role
                return
        after = max((i for i, r in enumerate(self.roles) if r.role == role.role), default=len(self.roles) - 1)
        self.roles.insert(after + 1, role)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data (written every second for a thousand roles: no ``asdict`` deep copy;
        the nested values are plain JSON data)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["state"] = self.state.value
        data["roles"] = [role.to_dict() for role in self.roles]
        for name in ("hosts", "host_problems", "agents", "slurm"):
            data[name] = {k: dict(v) if isinstance(v, dict) else v for k, v in data[name].items()}
        return data

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterRecord:
        data = _known_fields(cls, raw, "the record")
        for key, kinds in _CLUSTER_FIELD_KINDS.items():  # (read by every command: one odd value broke `ls`)
            if key in data and not isinstance(data[key], kinds):
                raise TypeError(f"{key!r} is a JSON {type(data[key]).__name__}")
        data["state"] = _enum(ClusterState, data.get("state", "starting"))
        data["roles"] = [RoleRecord.from_dict(r) if isinstance(r, dict) else _not_a_role(r)
                         for r in data.get("roles", [])]
        return cls(**data)


#: The JSON kinds of the record's fields that commands read without a second look.
_CLUSTER_FIELD_KINDS: dict[str, type | tuple[type, ...]] = {
    "name": str, "cluster_id": str, "reason": str, "steps": int, "result": (dict, type(None)), "roles": list,
    "spec_overrides": list, "hosts": dict, "host_problems": dict, "agents": dict, "slurm": dict,
}


def _known_fields(cls: type, raw: dict[str, Any], what: str) -> dict[str, Any]:
    """The fields of ``cls`` that ``raw`` gives (others are a newer psctl's: left out); a TypeError naming a
    required one it lacks."""
    known = fields(cls)
    missing = [f.name for f in known if f.name not in raw and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise TypeError(f"{what} has no {missing[0]!r}")
    names = {f.name for f in known}
    return {k: v for k, v in raw.items() if k in names}


def _enum(kind: Callable[[Any], E], value: object) -> E:
    """``kind(value)``; a ValueError that says which state is unknown (not the enum's own words)."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown state {value!r}") from None


def _not_a_role(raw: object) -> RoleRecord:
    raise TypeError(f"a role is a JSON {type(raw).__name__}")


def new_record(spec: ClusterSpec, plan: Plan) -> ClusterRecord:
    """The record of a cluster about to start: a fresh id, every planned role pending."""
    record = ClusterRecord(
        name=spec.name,
        cluster_id=f"{spec.name}-{secrets.token_hex(4)}",
        spec_path=str(Path(spec.path).resolve()) if spec.path else "",
        spec_overrides=list(spec.overrides),
        steps=int(spec.training.get("steps") or 0),
        roles=[RoleRecord(name=i.name, role=i.role, index=i.index, host=i.host, address=i.address, port=i.port)
               for i in plan.instances],
        backend=spec.backend,
        framework=str(spec.training.get("framework") or "psctl"),
    )
    record.tls = spec.security.tls
    return record


def keep_spec(path: Path, spec: ClusterSpec) -> None:
    """Keep the spec's text as ``up`` validated it (owner-only), for ``cluster_spec``."""
    write_text_atomic(path, spec.text)


def cluster_spec(kept: Path, record: ClusterRecord) -> ClusterSpec:
    """The spec a cluster was started with, whatever its file says now (edited for the next run): the text
    ``keep_spec`` kept, read as the file it came from (for messages and relative paths), with the cluster's
    ``--set`` overrides; the file itself for a cluster started before its text was kept."""
    from psctl.spec import load_spec, load_spec_text

    try:
        text = kept.read_text(encoding="utf-8")
    except FileNotFoundError:
        return load_spec(record.spec_path, record.spec_overrides)
    return load_spec_text(text, filename=record.spec_path or "<spec>", overrides=record.spec_overrides)


def save_state(path: Path, record: ClusterRecord) -> None:
    record.updated_at = time.time()
    write_json_atomic(path, record.to_dict(), compact=True)


class DamagedState(PsctlError):
    """A cluster's state file that is not a record psctl wrote (cut short by a full disk, edited by hand)."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        name = path.parent.name
        super().__init__(f"{path}: the state of cluster {name!r} cannot be read ({why})",
                         hint=f"`psctl down --purge {name}` stops what of it runs on this machine and removes it")


def load_state(path: Path) -> ClusterRecord:
    """The record at ``path``; :class:`DamagedState` where the file is not one (a missing file raises
    FileNotFoundError, for callers that wait for it)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise TypeError(f"a JSON {type(raw).__name__}, not an object")
        return ClusterRecord.from_dict(raw)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # (bad JSON, UTF-8 or fields: ValueErrors)
        raise DamagedState(path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc

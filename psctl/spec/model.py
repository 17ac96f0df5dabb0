"""The validated cluster spec: frozen dataclasses, defaults filled, every cross-field rule already checked.

These are the blueprint (as TorchElastic's ``WorkerSpec``): what should run where. What actually runs —
instances, ports picked at launch — is a :class:`~psctl.spec.plan.Plan`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from psctl.spec.loader import SourceMap

#: The roles in the order they are listed, planned and started.
ROLE_NAMES: tuple[str, ...] = ("chief", "ps", "worker", "evaluator")

HostKeyPolicy = Literal["reject", "accept-new"]
RestartMode = Literal["never", "on-failure", "always"]


_JUMP_HOP = re.compile(
    r"(?:(?P<user>[A-Za-z0-9_.-]+)@)?(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]+))(?::(?P<port>[0-9]{1,5}))?"
)


def parse_jump(hop: str) -> tuple[str | None, str, int]:
    """One ProxyJump hop, ``[user@]host[:port]`` (``[v6addr]:port`` for IPv6), as (user, host, port): the one
    grammar for hops written in a spec and hops read from an ssh config. ValueError if it is not one."""
    match = _JUMP_HOP.fullmatch(hop)
    port = int(match["port"] or 22) if match else 0
    if match is None or not 1 <= port <= 65535:
        raise ValueError(f"{hop!r} is not [user@]host[:port] (port 1-65535)")
    return match["user"], match["v6"] or match["host"], port


@dataclass(frozen=True)
class HostSpec:
    """A machine reached over SSH. ``host_key_policy="accept-new"`` trusts a first-seen key (as OpenSSH)."""

    name: str
    address: str
    user: str | None = None
    port: int = 22
    identity_file: str | None = None
    python: str = "python3"
    workdir: str = "~/.psctl-work"
    host_key_policy: HostKeyPolicy = "reject"
    #: OpenSSH's ProxyJump: ``[user@]host[:port]`` or the name of another host of the spec, hops separated by
    #: commas (the first is reached first).
    proxy_jump: str | None = None
    #: The hosts of the spec that ``proxy_jump`` names (with their own jump hosts): a hop through one of them
    #: uses its user, port, identity_file, host_key_policy and proxy_jump, as OpenSSH does with a Host alias.
    jump_hosts: tuple[HostSpec, ...] = ()


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead role is started again; permanent exit codes stop a bad program restarting forever."""

    policy: RestartMode = "on-failure"
    max_restarts: int = 10
    backoff_seconds: float = 1.0
    max_backoff_seconds: float = 30.0
    #: 2: bad configuration, 3: training failed (a non-retryable program error): restarting cannot help.
    permanent_exit_codes: tuple[int, ...] = (2, 3)


@dataclass(frozen=True)
class RoleSpec:
    """One role's replicas and where they go.

    ``hosts`` is a pool assigned round-robin over the replicas (empty: this machine). Ports are either
    ``ports`` (one per replica) or a base ``port`` (replica i gets ``port + i``); neither means "pick free
    ports at plan time", which only works on this machine.
    """

    role: str
    replicas: int = 1
    hosts: tuple[str, ...] = ()
    ports: tuple[int, ...] | None = None
    port: int | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    #: "auto": bound to a CPU of its own on a host with more roles than CPUs (psctl.launch.cpus); "none": never.
    cpu_binding: str = "auto"
    #: With training.framework: tensorflow, the role's own command line (words, placeholders unfilled).
    command: tuple[str, ...] | None = None
    #: ps and worker: the bounds of ``psctl scale`` (and the fewest workers training goes on with). Every
    #: replica up to ``max_replicas`` gets its certificate and port at ``up``: a running cluster mints none.
    min_replicas: int = 1
    max_replicas: int | None = None

    @property
    def slots(self) -> int:
        """How many replicas the role may ever have (``max_replicas``, else ``replicas``)."""
        return max(self.replicas, self.max_replicas or self.replicas)


@dataclass(frozen=True)
class SupervisionSpec:
    """Heartbeat and progress deadlines, in seconds (a role is dead only once past ``startup_grace``), and the
    benching of SSH hosts: ``bench_after_failures`` role failures on one host within ``bench_window`` keep
    roles that can go elsewhere (workers and ps with a pool) off it for ``bench_cooloff`` (0 failures: never)."""

    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    startup_grace: float = 30.0
    stall_timeout: float = 60.0
    bench_after_failures: int = 3
    bench_window: float = 300.0
    bench_cooloff: float = 600.0
    #: Seconds a role stopped by SIGTERM (a preemption's warning) has to leave cleanly: a worker finishes the
    #: steps it runs and takes no new one. Such an exit is restarted but never counted as a failure.
    preemption_grace: float = 30.0


@dataclass(frozen=True)
class SecuritySpec:
    """Mutual TLS between roles is on by default; turning it off is allowed only for a cluster that runs
    entirely on this machine, bound to loopback. Paths in the spec stay inside its folder unless allowed."""

    tls: bool = True
    #: Folders outside the spec's own folder (and, for checkpoints, PSCTL_HOME) that the spec's program, data
    #: and checkpoint paths may point into: a spec from elsewhere cannot make roles read or write elsewhere
    #: unless its user lists the folder here.
    allowed_paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class SlurmSpec:
    """``backend: slurm``: the one batch job the cluster runs in (sbatch's options of the same names)."""

    partition: str | None = None
    account: str | None = None
    #: Slurm's time format (``MM``, ``HH:MM:SS``, ``D-HH:MM``...), or None for the partition's default.
    time: str | None = None
    qos: str | None = None
    nodes: int = 1
    cpus_per_task: int | None = None
    #: ``--requeue``: a preempted or failed node's job comes back and resumes from its latest checkpoint.
    requeue: bool = True
    #: More sbatch options, as written (``--exclusive``, ``--constraint=skylake``).
    sbatch_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterSpec:
    """A whole validated spec. ``training`` is the normalised, JSON-serialisable dict the runtime gets.

    ``source`` remembers the file and lines so that later checks (ports taken at plan time) can still
    point at the line to change.
    """

    name: str
    path: Path | None
    hosts: tuple[HostSpec, ...]
    roles: dict[str, RoleSpec]
    training: dict[str, Any]
    supervision: SupervisionSpec = field(default_factory=SupervisionSpec)
    security: SecuritySpec = field(default_factory=lambda: SecuritySpec())
    source: SourceMap = field(default_factory=lambda: SourceMap("<spec>"), repr=False, compare=False)
    #: Local files and folders (absolute) copied to every host's ``files/`` folder, beside the program.
    files: tuple[str, ...] = ()
    #: Shell commands run once on every host at ``up``, in that folder, before any role starts.
    setup: tuple[str, ...] = ()
    #: Where the roles run: ``local`` (this machine), ``ssh`` (the hosts: under ``hosts:``) or ``slurm``
    #: (one batch job; its settings in ``slurm``).
    backend: str = "local"
    slurm: SlurmSpec | None = None
    #: The ``--set`` arguments applied to the file, as written (a cluster's record keeps them).
    overrides: tuple[str, ...] = ()
    #: The file's text as it was validated (``up`` keeps it: the cluster runs this spec whatever the file says
    #: later).
    text: str = field(default="", repr=False, compare=False)

    @property
    def is_local(self) -> bool:
        """True when every role runs on this machine (no role names a host)."""
        return all(not role.hosts for role in self.roles.values())

    def host(self, name: str) -> HostSpec:
        """The host called ``name`` (KeyError if the spec defines none)."""
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

"""Loaded YAML data → :class:`ClusterSpec`: defaults, schema checks, then cross-field checks.

The order follows Ray's launcher config flow: each section is checked on its own (unknown keys refused,
types and ranges checked, defaults filled), then the rules that tie sections together — role hosts must
be defined hosts, ports must not collide on a machine, mode-specific training keys — with messages that
name every field involved.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from psctl.home import CLUSTER_NAME
from psctl.launch.cpus import CPU_BINDINGS
from psctl.spec.checks import Checker, seconds_text, show, suggestion
from psctl.spec.framework import check_command
from psctl.spec.loader import KeyPath, SourceMap, dotted
from psctl.spec.model import (
    ROLE_NAMES,
    ClusterSpec,
    HostSpec,
    RestartPolicy,
    RoleSpec,
    SecuritySpec,
    SlurmSpec,
    SupervisionSpec,
    parse_jump,
)
from psctl.spec.plan import LOCAL_HOST, conflict_error, layout, port_conflict
from psctl.spec.training import (
    CHECKPOINT_KEYS,
    TRAINING_KEYS,
    check_checkpoints_its_own,
    check_confined,
    check_local_checkpoint_folder,
    check_local_data,
    check_local_program,
    normalise_training,
)

TOP_KEYS = ("name", "hosts", "roles", "training", "supervision", "security", "files", "setup", "backend", "slurm")
BACKENDS = ("local", "ssh", "slurm")
SLURM_KEYS = ("partition", "account", "time", "qos", "nodes", "cpus_per_task", "requeue", "sbatch_options", "login")
#: Slurm's time limit formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED.
_SLURM_TIME = re.compile(r"(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite)", re.I)
HOST_KEYS = ("name", "address", "user", "port", "identity_file", "python", "workdir", "host_key_policy",
             "proxy_jump")
ROLE_KEYS = ("replicas", "min_replicas", "max_replicas", "host", "hosts", "port", "ports", "restart", "env",
             "threads", "cpu_binding", "command")
#: The roles `psctl scale` changes (and that may have min_replicas / max_replicas).
SCALABLE_ROLES = ("ps", "worker")
RESTART_KEYS = ("policy", "max_restarts", "backoff_seconds", "max_backoff_seconds", "permanent_exit_codes")
SUPERVISION_KEYS = ("heartbeat_interval", "heartbeat_timeout", "startup_grace", "stall_timeout",
                    "bench_after_failures", "bench_window", "bench_cooloff", "preemption_grace")
REQUIRED_ROLES = ("chief", "ps", "worker")
SINGLE_ROLES = ("chief", "evaluator")
MAX_REPLICAS = 1000
#: Variables psctl sets for every role itself; a user's value would break cluster discovery.
RESERVED_ENV = re.compile(r"PSCTL_.*|TF_CONFIG")

_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_ADDRESS = re.compile(r"[A-Za-z0-9:][A-Za-z0-9_.:%-]{0,252}")
#: Four dot-separated numbers: meant as an IPv4 address, never a host name (a DNS name's last label is no number).
_DOTTED_QUAD = re.compile(r"\d+\.\d+\.\d+\.\d+")


def _set_of(c: Checker, other: KeyPath, path: KeyPath) -> KeyPath | None:
    """Where an error about ``path`` that ``other`` (the other value of a pair) broke is placed: at ``other``
    where a --set gave it and not ``path`` (the file's value was fine until then), else at ``path`` (None)."""
    set_here = c.source.set_on_command_line
    return other if set_here(other) and not set_here(path) else None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PORT_FIX = "use a port number such as 7000"


def build_spec(data: Any, source: SourceMap, *, path: Path | None, base_dir: Path, default_name: str) -> ClusterSpec:
    """Validate loaded data and build the spec; the first mistake found is raised as a SpecError."""
    c = Checker(source, sections=[  # (most specific first; `name` is too common a word to place)
        ("training", TRAINING_KEYS), ("supervision", SUPERVISION_KEYS), ("training.checkpoint", CHECKPOINT_KEYS),
        ("roles.<role>", ROLE_KEYS), ("roles.<role>.restart", RESTART_KEYS),
        ("", tuple(k for k in TOP_KEYS if k != "name")),
    ])
    if data is None:
        c.fail((), "the spec is empty", "write a mapping with at least roles: and training: (see cluster_examples/)")
    if not isinstance(data, dict):
        c.fail(
            (),
            f"expected a mapping at the top level, got {show(data)}",
            "start the file with keys such as name:, roles: and training:",
        )
    top = c.mapping((), data, TOP_KEYS, example="roles: {...}")
    name = _name(c, top, default_name)
    hosts = _hosts(c, top.get("hosts"))
    roles = _roles(c, c.require((), top, "roles", "add roles: with chief, ps and worker"), hosts)
    clash = port_conflict(layout(roles, hosts))
    if clash is not None:
        raise conflict_error(source, *clash)
    backend, slurm = _backend(c, top, hosts, roles)
    security = _security(c, top.get("security"), local=backend == "local", base_dir=base_dir)
    training = normalise_training(
        c,
        c.require((), top, "training", "add training: with at least program:, data: and steps:"),
        base_dir=base_dir,
        worker_replicas=roles["worker"].replicas,
        worker_slots=roles["worker"].slots,
        allowed_paths=tuple(Path(p) for p in security.allowed_paths),
    )
    roles = _role_commands(c, roles, top["roles"], training, base_dir)
    if backend == "local" and not top.get("setup"):  # (set-up may make them)
        check_local_data(c, training, (top["training"].get("data") or {}).get("path"))
        check_local_checkpoint_folder(c, training, (top["training"].get("checkpoint") or {}).get("dir"))
        check_checkpoints_its_own(c, name, training)
    if backend == "local" and training.get("framework") != "tensorflow" and not top.get("setup"):
        check_local_program(c, training["program"], base_dir, pythonpaths={  # (a ps imports no program)
            role: [entry for entry in spec.env.get("PYTHONPATH", "").split(":") if entry]
            for role, spec in roles.items() if role != "ps"})
    if training.get("framework") == "tensorflow":
        for role, spec in roles.items():
            if spec.max_replicas is not None and spec.max_replicas > spec.replicas:
                c.fail(("roles", role, "max_replicas"),
                       "a TensorFlow program's cluster is fixed when it starts: it cannot be scaled",
                       f"remove it, or write {spec.replicas} (replicas)")
    supervision = _supervision(c, top.get("supervision"))
    allowed = tuple(Path(p) for p in security.allowed_paths)
    files = _files(c, top.get("files"), base_dir, allowed)
    setup = tuple(
        c.string(("setup", i), item, fix="write a shell command as a string")
        for i, item in enumerate(c.items(("setup",), top.get("setup") or [], fix="list shell commands"))
    )
    if setup and backend == "slurm":  # (run on each SSH host, or here for a local cluster)
        c.fail(("setup",), "a Slurm job runs no setup: commands on its nodes",
               "run them before `psctl up` where the nodes see their result (a shared folder), or remove setup:",
               key=True)
    if backend == "ssh":
        _check_single_role_pools(c, roles, training)
        _check_evaluator_host(c, roles, training, top["roles"].get("evaluator") or {})
    return ClusterSpec(name, path, hosts, roles, training, supervision, security, source, files=files, setup=setup,
                       backend=backend, slurm=slurm)


def _backend(c: Checker, top: dict[str, Any], hosts: tuple[HostSpec, ...],
             roles: dict[str, RoleSpec]) -> tuple[str, SlurmSpec | None]:
    """``backend:`` (default: ssh with hosts, else local) and, for slurm, ``slurm:``."""
    backend = c.choice(("backend",), top.get("backend", "ssh" if hosts else "local"), BACKENDS, noun="backend")
    if "slurm" in top and backend != "slurm":
        c.fail(("slurm",), "only used with backend: slurm", "add backend: slurm, or remove slurm:", key=True)
    if backend == "ssh" and not hosts:
        c.fail(("backend",), "ssh needs hosts: to run on", "list them under hosts:, or use backend: local")
    if backend == "local" and hosts and any(r.hosts for r in roles.values()):
        c.fail(("backend",), "local runs every role on this machine, but roles name hosts",
               "use backend: ssh (the default with hosts:), or remove the roles' hosts")
    if backend != "slurm":
        return backend, None
    for name, role in roles.items():
        if role.hosts:
            c.fail(("roles", name, "hosts"), "Slurm chooses the nodes: a role of backend slurm names no host",
                   "remove it (slurm.nodes sets how many nodes the job gets)", key=True)
        if role.port is None and role.ports is None:
            c.fail(("roles", name), "runs through Slurm but has no port: or ports:",
                   "add port: (a base port: replica i listens on port + i); psctl cannot pick free ports on the "
                   "nodes before the job runs", key=True)
    p: KeyPath = ("slurm",)
    d = c.mapping(p, top.get("slurm"), SLURM_KEYS, example="{partition: debug, time: '01:00:00', nodes: 2}",
                  none_ok=True)
    if "login" in d:
        c.fail((*p, "login"), "submitting over SSH to a login node is not built yet",
               "run psctl on a login node of the cluster (where sbatch is), and remove login", key=True)
    text: dict[str, str | None] = {}
    for key in ("partition", "account", "qos", "time"):
        value = d.get(key)
        text[key] = None if value is None else c.string((*p, key), c.as_written((*p, key), value),
                                                         fix=f"write the {key} as Slurm names it")
    if text["time"] is not None and not _SLURM_TIME.fullmatch(text["time"]):
        c.fail((*p, "time"), f"{text['time']!r} is not a Slurm time limit",
               "write minutes (90), HH:MM:SS ('01:30:00') or D-HH:MM ('1-12:00'), quoted")
    options = tuple(
        c.string((*p, "sbatch_options", i), item, fix="write an option such as '--exclusive'")
        for i, item in enumerate(c.items((*p, "sbatch_options"), d.get("sbatch_options") or [],
                                         fix="list options, e.g. ['--exclusive']"))
    )
    for i, option in enumerate(options):
        if not option.startswith("-"):
            c.fail((*p, "sbatch_options", i), f"{option!r} is not an sbatch option", "write e.g. '--exclusive'")
    cpus = d.get("cpus_per_task")
    slurm = SlurmSpec(
        partition=text["partition"], account=text["account"], time=text["time"], qos=text["qos"],
        nodes=c.integer((*p, "nodes"), d.get("nodes", 1), minimum=1, fix="write how many nodes, e.g. 2"),
        cpus_per_task=None if cpus is None else c.integer((*p, "cpus_per_task"), cpus, minimum=1,
                                                          fix="write e.g. 4"),
        requeue=c.boolean((*p, "requeue"), d.get("requeue", True), fix="write true or false"),
        sbatch_options=options,
    )
    return backend, slurm


def _files(c: Checker, value: object, base_dir: Path, allowed: tuple[Path, ...]) -> tuple[str, ...]:
    """Local files or folders (relative to the spec's folder) that every host gets a copy of."""
    files = []
    for i, item in enumerate(c.items(("files",), value or [], fix="list paths")):
        text = c.string(("files", i), item, fix="give a file or folder path")
        path = (base_dir / Path(text).expanduser()).resolve()
        if not path.exists():
            c.fail(("files", i), f"{show(text)} does not exist (looked for {path})",
                   "give a path relative to the spec's folder")
        check_confined(c, ("files", i), str(path), base_dir, allowed, what="file")
        files.append(str(path))
    return tuple(files)


def _check_single_role_pools(c: Checker, roles: dict[str, RoleSpec], training: dict[str, Any]) -> None:
    """The chief writes the checkpoints and the evaluator reads them: either may move to another host of a pool
    only where they are on storage every host of it shares (training.checkpoint.dir)."""
    if (training.get("checkpoint") or {}).get("dir"):
        return
    for role, does in (("chief", "writes"), ("evaluator", "reads")):
        spec = roles.get(role)
        if spec is not None and len(set(spec.hosts)) > 1:
            c.fail(("roles", role, "hosts"),
                   f"the {role} moves to another host of its pool only if the checkpoints it {does} are on storage "
                   "every host of the pool shares",
                   f"set training.checkpoint.dir to a folder on shared storage, or give it one host, e.g. host: "
                   f"{spec.hosts[0]}")


def _check_evaluator_host(
    c: Checker, roles: dict[str, RoleSpec], training: dict[str, Any], written: dict[str, Any]
) -> None:
    """The evaluator reads the checkpoints the chief writes: on hosts, it must run where they are. ``written``:
    the evaluator's mapping as the spec has it (the error names the key the user wrote)."""
    evaluator, chief = roles.get("evaluator"), roles["chief"]
    checkpoint = training.get("checkpoint") or {}
    if evaluator is None or checkpoint.get("dir") or set(evaluator.hosts) <= set(chief.hosts[:1]):
        return
    key = "hosts" if "hosts" in written else "host"
    c.fail(("roles", "evaluator", key),
           f"the evaluator must run on the chief's host ({chief.hosts[0]}): it reads the checkpoints the chief "
           "writes there", f"write host: {chief.hosts[0]}, or put training.checkpoint.dir on storage both hosts "
           "share")


def _name(c: Checker, top: dict[str, Any], default_name: str) -> str:
    rule = "lowercase letters, digits and dashes, at most 63, not starting with a dash"
    if "name" in top:
        return c.string(("name",), top["name"], pattern=CLUSTER_NAME, rule=rule, fix="write e.g. name: digits")
    if CLUSTER_NAME.fullmatch(default_name):
        return default_name
    better = re.sub(r"[^a-z0-9]+", "-", default_name.lower()).strip("-")[:63] or "cluster"
    c.fail(
        ("name",),
        f"the cluster name defaults to the file name {show(default_name)}, which is not valid ({rule})",
        f"add name: {better}",
        key=True,
    )


def _hosts(c: Checker, value: object) -> tuple[HostSpec, ...]:
    if value is None:
        return ()
    items = c.items(("hosts",), value, fix="write hosts: [{name: a, address: 10.0.0.11}]")
    seen: dict[str, int] = {}
    hosts = []
    for i, raw in enumerate(items):
        p: KeyPath = ("hosts", i)
        h = c.mapping(p, raw, HOST_KEYS, example="{name: a, address: 10.0.0.11}")
        name = c.string(
            (*p, "name"),
            c.require(p, h, "name", "add name: (what roles call this host)"),
            pattern=_HOST_NAME,
            rule="letters, digits, '.', '_' and '-'",
            fix="write e.g. name: a",
        )
        if name == LOCAL_HOST:
            c.fail(
                (*p, "name"),
                "'localhost' is reserved for this machine",
                "give the host another name (roles without hosts run on this machine)",
            )
        if name in seen:
            c.fail(
                (*p, "name"),
                f"host {name!r} is defined twice (also hosts[{seen[name]}])",
                "give each host a unique name",
            )
        seen[name] = i
        address = c.string(
            (*p, "address"),
            c.require(p, h, "address", "add address: (an IP address or hostname)"),
            pattern=_ADDRESS,
            rule="an IP address or hostname",
            fix="write e.g. address: 10.0.0.11",
        )
        if _DOTTED_QUAD.fullmatch(address) and not _is_ip(address):
            c.fail((*p, "address"), f"{show(address)} is not an IPv4 address (each part 0-255)",
                   "write e.g. address: 10.0.0.11")
        hosts.append(
            HostSpec(
                name=name,
                address=address,
                user=c.optional_string((*p, "user"), h.get("user"), fix="write e.g. user: train"),
                port=c.integer(
                    (*p, "port"), h.get("port", 22), minimum=1, maximum=65535, fix="use the SSH port, e.g. 22"
                ),
                identity_file=c.optional_string(
                    (*p, "identity_file"), h.get("identity_file"), fix="give a key file path"
                ),
                python=c.string((*p, "python"), h.get("python", "python3"), fix="write e.g. python: python3"),
                workdir=c.string((*p, "workdir"), h.get("workdir", "~/.psctl-work"), fix="give a folder path"),
                host_key_policy=c.choice(  # type: ignore[arg-type]
                    (*p, "host_key_policy"),
                    h.get("host_key_policy", "reject"),
                    ("reject", "accept-new"),
                    noun="host key policy",
                ),
                proxy_jump=c.optional_string(
                    (*p, "proxy_jump"), h.get("proxy_jump"), fix="write e.g. proxy_jump: bastion or user@10.0.0.1:22"
                ),
            )
        )
    return tuple(_with_jumps(c, hosts))


def _with_jumps(c: Checker, hosts: list[HostSpec]) -> list[HostSpec]:
    """Check every proxy_jump hop, and give each host the hosts of the spec its hops name (``jump_hosts``,
    each with its own, recursively); a chain of hosts that leads back to itself is an error."""
    by_name = {h.name: h for h in hosts}
    index = {h.name: i for i, h in enumerate(hosts)}
    done: dict[str, HostSpec] = {}

    def hops_of(host: HostSpec) -> list[str]:
        if host.proxy_jump is None or host.proxy_jump.lower() == "none":
            return []
        return [h.strip() for h in host.proxy_jump.split(",")]

    def with_jumps(host: HostSpec, path: tuple[str, ...]) -> HostSpec:
        if host.name in done:
            return done[host.name]
        where = ("hosts", index[host.name], "proxy_jump")
        named: list[HostSpec] = []
        for hop in hops_of(host):
            if hop in by_name:
                if hop == host.name:
                    c.fail(where, f"host {host.name!r} cannot be its own jump host",
                           "name another host, or remove proxy_jump")
                if hop in path:
                    loop = " -> ".join((*path[path.index(hop):], host.name, hop))
                    c.fail(where, f"jump hosts lead back to where they started: {loop}",
                           "remove proxy_jump from one of these hosts")  # fmt: skip
                named.append(with_jumps(by_name[hop], (*path, host.name)))
                continue
            try:
                parse_jump(hop)
            except ValueError:
                c.fail(where, f"{hop!r} is not a host of the spec nor [user@]host[:port]",
                       "write e.g. proxy_jump: bastion, or user@10.0.0.1:22 (hops separated by commas)")
        hops = hops_of(host)
        done[host.name] = replace(host, proxy_jump=",".join(hops) if hops else host.proxy_jump,
                                  jump_hosts=tuple(named))  # fmt: skip
        return done[host.name]

    return [with_jumps(host, ()) for host in hosts]


def _roles(c: Checker, value: object, hosts: tuple[HostSpec, ...]) -> dict[str, RoleSpec]:
    r = c.mapping(("roles",), value, ROLE_NAMES, example="roles: {chief: {}, ps: {replicas: 1}, worker: {replicas: 2}}")
    for role in REQUIRED_ROLES:
        if role not in r:
            c.fail(("roles", role), "required role missing", f"add e.g. {role}: {{replicas: 1}}", key=True)
    roles = {role: _role(c, role, r[role], hosts) for role in ROLE_NAMES if role in r}
    remote = [role for role, spec in roles.items() if spec.hosts]
    local = [role for role, spec in roles.items() if not spec.hosts]
    if remote and local:
        c.fail(
            ("roles", local[0]),
            f"has no host: but roles.{remote[0]} runs on hosts",
            "give it host: or hosts: as well (roles on other machines cannot reach 127.0.0.1; "
            "list this machine under hosts: to run it here)",
            key=True,
        )
    return roles


def _role_commands(c: Checker, roles: dict[str, RoleSpec], raw: dict[str, Any], training: dict[str, Any],
                   base_dir: Path) -> dict[str, RoleSpec]:
    """Each role's ``command:`` (only with training.framework: tensorflow), split and checked."""
    out = dict(roles)
    for name, spec in roles.items():
        value = (raw.get(name) or {}).get("command") if isinstance(raw.get(name), dict) else None
        if value is None:
            continue
        path: KeyPath = ("roles", name, "command")
        if training.get("framework") != "tensorflow":
            c.fail(path, "only used with training.framework: tensorflow",
                   "remove it: psctl's own runtime runs every role", key=True)
        out[name] = replace(spec, command=check_command(c, path, value, base_dir))
    return out


def _role(c: Checker, role: str, value: object, hosts: tuple[HostSpec, ...]) -> RoleSpec:
    p: KeyPath = ("roles", role)
    d = c.mapping(p, value, ROLE_KEYS, example="{replicas: 2}", none_ok=True)
    replicas = 1
    if "replicas" in d:
        replicas = c.integer((*p, "replicas"), d["replicas"], minimum=1, fix="write a whole number such as 2")
        if role in SINGLE_ROLES and replicas != 1:
            c.fail((*p, "replicas"), f"the {role} has exactly one replica, got {replicas}", "remove it or write 1")
        if replicas > MAX_REPLICAS:
            c.fail(
                (*p, "replicas"),
                f"{replicas} replicas is more than psctl supports ({MAX_REPLICAS})",
                "use fewer replicas",
            )
    min_replicas, max_replicas = _bounds(c, p, role, d, replicas)
    pool = _pool(c, p, d, hosts)
    port, ports = _ports(c, p, d, max(replicas, max_replicas or replicas), scaled=max_replicas is not None)
    if pool and port is None and ports is None:
        c.fail(
            p,
            "runs on remote hosts but has no port: or ports:",
            "add port: (a base port: replica i listens on port + i); psctl picks free ports only on this machine",
            key=True,
        )
    threads = d.get("threads")
    if threads is not None:
        threads = c.integer((*p, "threads"), threads, minimum=1, fix="write e.g. threads: 1")
    return RoleSpec(
        role=role,
        replicas=replicas,
        hosts=pool,
        ports=ports,
        port=port,
        restart=_restart(c, (*p, "restart"), d.get("restart")),
        env=_env(c, (*p, "env"), d.get("env")),
        threads=threads,
        cpu_binding=c.choice((*p, "cpu_binding"), d.get("cpu_binding", "auto"), CPU_BINDINGS, noun="cpu_binding"),
        min_replicas=min_replicas,
        max_replicas=max_replicas,
    )


def _bounds(c: Checker, p: KeyPath, role: str, d: dict[str, Any], replicas: int) -> tuple[int, int | None]:
    """``min_replicas`` (default 1) and ``max_replicas`` (default: none, so ``replicas``) of a ps or worker."""
    for key in ("min_replicas", "max_replicas"):
        if key in d and role not in SCALABLE_ROLES:
            c.fail((*p, key), f"the {role} has exactly one replica and is never scaled",
                   f"remove it (only roles.ps and roles.worker have {key})", key=True)
    low = c.integer((*p, "min_replicas"), d.get("min_replicas", 1), minimum=1, fix="write a whole number such as 1")
    high = None
    if d.get("max_replicas") is not None:
        high = c.integer((*p, "max_replicas"), d["max_replicas"], minimum=1, maximum=MAX_REPLICAS,
                         fix=f"write a whole number between replicas ({replicas}) and {MAX_REPLICAS}")
        if high < replicas:
            c.fail((*p, "max_replicas"), f"{high} is fewer than replicas ({replicas})",
                   f"write at least {replicas}, or lower replicas",
                   at=_set_of(c, (*p, "replicas"), (*p, "max_replicas")))
    if low > replicas:
        c.fail((*p, "min_replicas"), f"{low} is more than replicas ({replicas})",
               f"write at most {replicas}, or raise replicas",
               at=_set_of(c, (*p, "replicas"), (*p, "min_replicas")))
    return low, high


def _pool(c: Checker, p: KeyPath, d: dict[str, Any], hosts: tuple[HostSpec, ...]) -> tuple[str, ...]:
    """The role's host names (``host:`` or ``hosts:``), each one defined under ``hosts:``."""
    if "host" in d and "hosts" in d:
        c.fail(
            (*p, "hosts"),
            f"cannot be combined with {'.'.join(p)}.host",
            "keep host: (one host) or hosts: (a pool of hosts)",
            key=True,
        )
    fix = "name a host defined under hosts:"
    if "host" in d:
        refs: list[tuple[KeyPath, str]] = [((*p, "host"), c.string((*p, "host"), d["host"], fix=fix))]
    elif d.get("hosts") is not None:
        items = c.items((*p, "hosts"), d["hosts"], fix="write hosts: [a, b]")
        refs = [((*p, "hosts", i), c.string((*p, "hosts", i), h, fix=fix)) for i, h in enumerate(items)]
    else:
        refs = []
    names = [h.name for h in hosts]
    listed: dict[str, int] = {}
    for i, (path, name) in enumerate(refs):
        if name in listed:
            c.fail(path, f"host {name!r} is listed twice (also {dotted((*p, 'hosts', listed[name]))})",
                   "list each host of the pool once")
        listed[name] = i
        if not names:
            c.fail(
                path,
                f"names host {name!r} but the spec defines no hosts:",
                f"add a hosts: list that defines {name!r}, or remove it to run on this machine",
            )
        if name not in names:
            close = suggestion(name, names)
            c.fail(
                path,
                f"host {name!r} is not defined under hosts:",
                close if close.startswith("did") else f"define it, or use one of: {', '.join(names)}",
            )
    return tuple(name for _, name in refs)


def _ports(c: Checker, p: KeyPath, d: dict[str, Any], replicas: int, *,
           scaled: bool = False) -> tuple[int | None, tuple[int, ...] | None]:
    """``port`` or ``ports``, for ``replicas`` (``scaled``: that many is max_replicas)."""
    many = f"{replicas} replicas" + (" (max_replicas)" if scaled else "")
    if "port" in d and "ports" in d:
        c.fail(
            (*p, "ports"),
            f"cannot be combined with {'.'.join(p)}.port",
            "keep ports: (one per replica) or port: (a base port: port, port+1, ...)",
            key=True,
        )
    port = ports = None
    if d.get("port") is not None:
        port = c.integer((*p, "port"), d["port"], minimum=1, maximum=65535, fix=_PORT_FIX)
        if port + replicas - 1 > 65535:
            c.fail((*p, "port"), f"{many} from port {port} run past 65535", "pick a lower base port")
    if d.get("ports") is not None:
        items = c.items((*p, "ports"), d["ports"], fix="write ports: [7000, 7001] or give a base port: 7000")
        ports = tuple(
            c.integer((*p, "ports", i), x, minimum=1, maximum=65535, fix=_PORT_FIX) for i, x in enumerate(items)
        )
        if len(ports) < replicas:
            c.fail(
                p,
                f"{many} but {len(ports)} port{'s' if len(ports) != 1 else ''}",
                f"list {replicas} ports or give a base `port:`",
                at=(*p, "ports"),
                key=True,
            )
    return port, ports


def _restart(c: Checker, p: KeyPath, value: object) -> RestartPolicy:
    d = c.mapping(p, value, RESTART_KEYS, example="{policy: on-failure, max_restarts: 10}", none_ok=True)
    backoff = c.duration((*p, "backoff_seconds"), d.get("backoff_seconds", 1.0), positive=False)
    max_backoff = c.duration(
        (*p, "max_backoff_seconds"), d.get("max_backoff_seconds", max(30.0, backoff)), positive=False
    )
    if max_backoff < backoff:
        c.fail(
            (*p, "max_backoff_seconds"),
            f"{seconds_text(max_backoff)} is less than {'.'.join(p)}.backoff_seconds ({seconds_text(backoff)})",
            "raise max_backoff_seconds or lower backoff_seconds",
        )
    codes = c.items((*p, "permanent_exit_codes"), d.get("permanent_exit_codes", [2, 3]), fix="write e.g. [2, 3]")
    return RestartPolicy(
        policy=c.choice(
            (*p, "policy"),
            d.get("policy", "on-failure"),
            ("never", "on-failure", "always"),  # type: ignore[arg-type]
            noun="restart policy",
        ),
        max_restarts=c.integer((*p, "max_restarts"), d.get("max_restarts", 10), minimum=0, fix="write e.g. 10"),
        backoff_seconds=backoff,
        max_backoff_seconds=max_backoff,
        permanent_exit_codes=tuple(
            c.integer((*p, "permanent_exit_codes", i), x, minimum=1, maximum=255, fix="use exit codes 1 to 255")
            for i, x in enumerate(codes)
        ),
    )


def _env(c: Checker, p: KeyPath, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        c.fail(p, f"expected a mapping, got {show(value)}", 'write e.g. env: {OMP_NUM_THREADS: "1"}')
    c.string_keys(p, value)
    env: dict[str, str] = {}
    for key, raw in value.items():
        if not _ENV_NAME.fullmatch(key):
            c.fail((*p, key), "not a valid environment variable name", "use letters, digits and '_'", key=True)
        if RESERVED_ENV.fullmatch(key):
            c.fail((*p, key), "psctl sets this variable for every role itself", "remove it", key=True)
        if (isinstance(raw, int) and raw.bit_length() <= 64) or (isinstance(raw, float) and math.isfinite(raw)):
            raw = c.as_written((*p, key), raw)  # OMP_NUM_THREADS: 1 means "1", UMASK: 0022 "0022"
        if not isinstance(raw, str) or "\x00" in raw:
            c.fail((*p, key), f"expected a string, got {show(raw)}", 'quote the value, e.g. "1"')
        env[key] = raw
    return env


def _security(c: Checker, value: object, *, local: bool, base_dir: Path) -> SecuritySpec:
    p: KeyPath = ("security",)
    d = c.mapping(p, value, ("tls", "allowed_paths"), example="{tls: true}", none_ok=True)
    tls = c.boolean((*p, "tls"), d.get("tls", True), fix="write true or false")
    if not tls and not local:
        c.fail((*p, "tls"), "TLS can be turned off only for a cluster on this machine (bound to loopback)",
               "remove `tls: false`: roles on other hosts always talk mutual TLS")
    allowed = []
    for i, item in enumerate(c.items((*p, "allowed_paths"), d.get("allowed_paths", []), fix="list folders")):
        text = c.string((*p, "allowed_paths", i), item, fix="give a folder path")
        allowed.append(str((base_dir / Path(text).expanduser()).resolve()))
    return SecuritySpec(tls=tls, allowed_paths=tuple(allowed))


def _supervision(c: Checker, value: object) -> SupervisionSpec:
    p: KeyPath = ("supervision",)
    d = c.mapping(p, value, SUPERVISION_KEYS, example="{heartbeat_interval: 1s, heartbeat_timeout: 5s}", none_ok=True)
    interval = c.duration((*p, "heartbeat_interval"), d.get("heartbeat_interval", 1.0))
    timeout = c.duration((*p, "heartbeat_timeout"), d.get("heartbeat_timeout", max(5.0, 5 * interval)))
    if timeout <= interval:
        c.fail(
            (*p, "heartbeat_timeout"),
            f"{seconds_text(timeout)} must be longer than supervision.heartbeat_interval ({seconds_text(interval)})",
            "allow a few missed heartbeats, e.g. 5 times the interval",
            at=_set_of(c, (*p, "heartbeat_interval"), (*p, "heartbeat_timeout")),
        )
    return SupervisionSpec(
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        startup_grace=c.duration((*p, "startup_grace"), d.get("startup_grace", 30.0), positive=False),
        stall_timeout=c.duration((*p, "stall_timeout"), d.get("stall_timeout", 60.0)),
        bench_after_failures=c.integer((*p, "bench_after_failures"), d.get("bench_after_failures", 3), minimum=0,
                                       fix="give a count of role failures, or 0 to never bench a host"),
        bench_window=c.duration((*p, "bench_window"), d.get("bench_window", 300.0)),
        bench_cooloff=c.duration((*p, "bench_cooloff"), d.get("bench_cooloff", 600.0)),
        preemption_grace=c.duration((*p, "preemption_grace"), d.get("preemption_grace", 30.0), positive=False),
    )

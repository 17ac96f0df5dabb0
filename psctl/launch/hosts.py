"""Where an SSH host is, and whether to trust it: ssh_config look-up, known_hosts files, host key policies.

:func:`resolve` turns a :class:`~psctl.spec.model.HostSpec` into the :class:`Target` that ``connect()`` needs.
The spec wins; ``~/.ssh/config`` (OpenSSH's ``Host`` blocks, read with paramiko's ``SSHConfig``, which applies
nothing by itself) fills what the spec leaves open: ``HostName``, ``User``, ``Port`` (only where the spec keeps
the default 22), ``IdentityFile``, ``UserKnownHostsFile``, ``ConnectTimeout`` and ``ProxyJump`` (hops
``[user@]host[:port]`` or a host of the spec, comma-separated, each looked up in the ssh_config in turn; a hop
that names a host of the spec uses that host's settings, and a hop without an identity of its own uses the
host's). ``ProxyCommand`` is refused with a clear error: psctl runs no local commands to
connect.

Host keys are always verified. Keys are read from ``/etc/ssh/ssh_known_hosts`` and from the user's known_hosts
file (``~/.ssh/known_hosts``, or the one given, which replaces it as OpenSSH's ``UserKnownHostsFile`` does).
An unknown key is refused (:class:`RejectUnknownPolicy`) or, with ``host_key_policy: accept-new``, appended
to the user's known_hosts file and trusted (:class:`AcceptNewPolicy`, OpenSSH's ``StrictHostKeyChecking
accept-new``). A key that differs from the recorded one is refused under both policies (paramiko raises
``BadHostKeyException`` before consulting any policy).
"""

from __future__ import annotations

import fcntl
import getpass
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko

from psctl.spec.model import HostSpec, parse_jump

DEFAULT_SSH_CONFIG = Path("~/.ssh/config")
DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
GLOBAL_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")

_record_lock = threading.Lock()  # threads of one process; flock() guards against other processes


@dataclass(frozen=True)
class Target:
    """Everything ``SSHClient.connect`` needs for one host, resolved (no ``~`` left in paths)."""

    name: str
    hostname: str
    port: int
    user: str
    key_filenames: tuple[str, ...]
    #: The user's known_hosts file: read, and written by ``accept-new``.
    known_hosts: Path
    host_key_policy: str
    #: ssh_config's ConnectTimeout for this host (None: the runner's own).
    connect_timeout: float | None = None
    #: The last ProxyJump hop: this host is reached through a tunnel from there (it may have a jump of its own).
    jump: Target | None = None

    @property
    def known_hosts_name(self) -> str:
        """The name this host's key is filed under in known_hosts (``[addr]:port`` for ports other than 22)."""
        return known_hosts_name(self.hostname, self.port)


def known_hosts_name(hostname: str, port: int) -> str:
    return hostname if port == 22 else f"[{hostname}]:{port}"


#: At most this many ProxyJump hops (counting those an ssh_config adds): more is a loop in the config.
MAX_JUMPS = 8


class ConfigError(ValueError):
    """An ssh_config or proxy_jump setting psctl cannot follow."""


def resolve(host: HostSpec, *, ssh_config: Path | None = DEFAULT_SSH_CONFIG,
            known_hosts: Path | None = None, _depth: int = 0) -> Target:
    """The connection target for ``host``; reads ``ssh_config`` (None: none) if the file exists.
    ConfigError for a ProxyCommand, a malformed jump, or a jump chain that loops."""
    if _depth > MAX_JUMPS:
        raise ConfigError(f"more than {MAX_JUMPS} ProxyJump hops (a loop in the ssh config?)")
    options: dict[str, object] = {}
    if ssh_config is not None:
        path = ssh_config.expanduser()
        if path.is_file():
            options = dict(paramiko.SSHConfig.from_path(str(path)).lookup(host.address))
    if options.get("proxycommand") and str(options["proxycommand"]).lower() != "none":
        raise ConfigError(f"ProxyCommand is not supported (host {host.address}); use ProxyJump")
    hostname = str(options.get("hostname") or host.address)
    port = host.port
    if port == 22 and options.get("port"):
        port = int(str(options["port"]))
    user = host.user or str(options.get("user") or getpass.getuser())
    if host.identity_file:
        keys: tuple[str, ...] = (os.path.expanduser(host.identity_file),)
    else:
        found = options.get("identityfile")
        keys = tuple(os.path.expanduser(k) for k in found if isinstance(k, str)) if isinstance(found, list) else ()
    if known_hosts is None:
        configured = str(options.get("userknownhostsfile") or "").split()
        known_hosts = Path(configured[0]) if configured else DEFAULT_KNOWN_HOSTS
    timeout = options.get("connecttimeout")
    jumps = host.proxy_jump if host.proxy_jump is not None else str(options.get("proxyjump") or "")
    jump = None
    if jumps and jumps.lower() != "none":
        *before, last = [hop.strip() for hop in jumps.split(",")]
        spec_hosts = {h.name: h for h in host.jump_hosts}
        if last in spec_hosts:  # a host of the spec: its own settings, and its own jumps unless hops precede it
            named = spec_hosts[last]
            hop = replace(named, proxy_jump=",".join(before) if before else named.proxy_jump,
                          jump_hosts=(*named.jump_hosts, *host.jump_hosts))  # fmt: skip
        else:
            try:
                jump_user, jump_host, jump_port = parse_jump(last)
            except ValueError as exc:
                # (the spec's own hops were checked when it was loaded: this one is from ~/.ssh/config)
                raise ConfigError(f"proxy jump of host {host.name}: {exc}; fix its ProxyJump in the ssh config "
                                  "or set proxy_jump: in the spec") from None
            hop = HostSpec(name=f"{host.name} jump", address=jump_host, user=jump_user, port=jump_port,
                           identity_file=None, host_key_policy=host.host_key_policy,
                           proxy_jump=",".join(before) if before else None, jump_hosts=host.jump_hosts)
        jump = resolve(hop, ssh_config=ssh_config, known_hosts=known_hosts, _depth=_depth + 1)
        if not jump.key_filenames:  # no key of its own: the host's (one key for a cluster's machines)
            jump = replace(jump, key_filenames=keys)
    return Target(
        name=host.name,
        hostname=hostname,
        port=port,
        user=user,
        key_filenames=keys,
        known_hosts=known_hosts.expanduser(),
        host_key_policy=host.host_key_policy,
        connect_timeout=float(str(timeout)) if timeout and str(timeout).isdigit() else None,
        jump=jump,
    )


def load_known_hosts(client: paramiko.SSHClient, target: Target) -> None:
    """Load the global and the user's known_hosts into ``client`` (read-only: paramiko never rewrites them)."""
    for path in (GLOBAL_KNOWN_HOSTS, target.known_hosts):
        if path.is_file():
            client.load_system_host_keys(str(path))


def record_host_key(path: Path, name: str, key: paramiko.PKey) -> None:
    """Append ``name``'s key to a known_hosts file (created 0600, its folder 0700), keeping every other line."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{name} {key.get_name()} {key.get_base64()}\n".encode("ascii")
    with _record_lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size > 0:
                with open(path, "rb") as existing:
                    if not existing.read().endswith(b"\n"):
                        line = b"\n" + line
            os.write(fd, line)
        finally:
            os.close(fd)


class UnknownHostKey(paramiko.SSHException):
    """The server's key is in no known_hosts file and the policy is ``reject``."""


class RejectUnknownPolicy(paramiko.RejectPolicy):
    """paramiko's ``RejectPolicy``, raising an exception of its own so that the caller can name the fix."""

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(f"{hostname}: {key.get_name()} key {key.get_fingerprint().hex()} is not known")


class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """OpenSSH's ``accept-new``: a host seen for the first time has its key recorded and trusted.

    Only called for hosts with no recorded key at all; a changed key never reaches a policy.
    """

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        record_host_key(self.known_hosts, hostname, key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def host_key_policy(target: Target) -> paramiko.MissingHostKeyPolicy:
    if target.host_key_policy == "accept-new":
        return AcceptNewPolicy(target.known_hosts)
    if target.host_key_policy == "reject":
        return RejectUnknownPolicy()
    raise ValueError(f"host {target.name}: unknown host_key_policy {target.host_key_policy!r}")

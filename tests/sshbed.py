"""A multi-host SSH test bed on this machine: real OpenSSH servers, one per test host (recipe:
/work/shared/reference/ssh-testbed.md).

Host ``hN`` is a network namespace ``tbhN`` whose ``eth0`` (10.231.0.(10+N)/24) is one end of a veth pair;
the other end sits on the bridge ``tbbr0`` holding 10.231.0.1/24 in the root namespace. Inside, sshd runs as
PID 1 of its own PID, mount and UTS namespaces (``unshare --uts --mount --pid --fork --kill-child
--mount-proc``), so each host has its own hostname, its own process table and ``/etc/hosts`` naming h1..hN;
killing sshd crashes the host (the kernel kills everything in its PID namespace). The filesystem is shared.
Root logs in with a generated ed25519 key; inside the hosts root's login shell is ``/bin/sh`` (a private
``/etc/passwd`` bind-mounted over the real one, so no ``.bashrc`` slows every command down).

Only 10.231.0.0/24 is ever addressed; while the bed is up the route ``unreachable 10.231.0.0/24 metric 4242``
keeps that traffic from leaving by the default route should the bridge go down. Faults: :meth:`SSHBed.kill_sshd`
(crash), :meth:`~SSHBed.restart_sshd`, :meth:`~SSHBed.partition`/:meth:`~SSHBed.heal` (nft drop rules on the
host's eth0, or the root-side veth link down), :meth:`~SSHBed.freeze`/:meth:`~SSHBed.thaw` (SIGSTOP/SIGCONT
every process of the host), :meth:`~SSHBed.regenerate_host_key`.

Needs root, ``sshd``, ``ip``, ``ssh-keygen``, ``unshare``, ``nsenter`` and ``nft`` (Debian: ``apt-get install
openssh-server iproute2 nftables procps``). The ``sshbed`` fixture skips with the reason where they are
missing, except under ``CI`` where it fails: CI must run the SSH tests. Use it with ``from sshbed import
sshbed_fixture  # noqa: F401`` in a test module (the fixture is named ``sshbed``), or ``pytest_plugins =
["sshbed"]`` in the root conftest.py. One bed per machine (a lock file);
leftovers of a bed whose process was killed are swept away by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from psctl.launch.ssh import SSHRunner
from psctl.spec.model import HostSpec

SUBNET = "10.231.0"
BRIDGE = "tbbr0"
NS_PREFIX = "tbh"
SAFETY_ROUTE = ["unreachable", f"{SUBNET}.0/24", "metric", "4242"]
STATE_DIR = Path("/run/psctl-sshbed")  # root-owned path components: sshd's StrictModes accepts it
LOCK_FILE = Path("/run/psctl-sshbed.lock")
NFT_TABLE = "psctl_partition"
TOOLS = ("sshd", "ip", "ssh-keygen", "unshare", "nsenter", "nft")
SYSTEM_PYTHON = "/usr/bin/python3"
INSTALL_HINT = "apt-get install -y openssh-server iproute2 nftables procps"


class BedError(RuntimeError):
    """The bed could not be brought up or torn down completely."""


def which(tool: str) -> str | None:
    """Like shutil.which, also looking in the sbin folders that a non-root PATH lacks."""
    path = os.environ.get("PATH", "") + ":/usr/local/sbin:/usr/sbin:/sbin"
    return shutil.which(tool, path=path)


def unavailable_reason() -> str | None:
    """Why the bed cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "the SSH test bed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the SSH test bed needs root (ip netns add); run the SSH tests as root"
    missing = [tool for tool in TOOLS if which(tool) is None]
    if missing:
        return f"the SSH test bed needs {', '.join(missing)} ({INSTALL_HINT})"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``; in CI (env ``CI`` set) fail instead: a skipped SSH test there is a failure."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: the SSH tests must run)", pytrace=False)
    pytest.skip(reason)


def _run(
    *argv: str, input: str | None = None, check: bool = True, timeout: float = 20.0
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                          stdin=None if input is not None else subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise BedError(f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}")
    return done


def _keygen(path: Path, comment: str) -> subprocess.Popen[bytes]:
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".pub").unlink(missing_ok=True)
    return subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_keygen(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=20)
        if proc.returncode != 0:
            raise BedError(f"ssh-keygen failed: {err.decode(errors='replace').strip()}")


def _wait_for(condition: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise BedError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class BedHost:
    name: str
    index: int
    state: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)  # `unshare`, parent of sshd

    @property
    def address(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def netns(self) -> str:
        return f"{NS_PREFIX}{self.index}"

    @property
    def veth(self) -> str:
        """The root-namespace end of the host's veth pair (on the bridge)."""
        return f"{NS_PREFIX}{self.index}-r"

    @property
    def host_key(self) -> Path:
        return self.state / "ssh_host_ed25519_key"

    @property
    def config(self) -> Path:
        return self.state / "sshd_config"

    def sshd_pid(self) -> int | None:
        """The global pid of the host's sshd (PID 1 of its namespace), or None when it is down."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return None
        return children[0].pid if children else None

    def answers(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((self.address, 22), timeout=0.5):
            return True
        return False


class SSHBed:
    """N test hosts h1..hN with real sshd; a context manager (``with SSHBed(3) as bed:``)."""

    def __init__(self, n: int = 3, *, state_dir: Path = STATE_DIR) -> None:
        if not 1 <= n <= 200:
            raise ValueError("1 to 200 hosts")
        self.state = state_dir
        self.hosts = {f"h{i}": BedHost(f"h{i}", i, state_dir / f"h{i}") for i in range(1, n + 1)}
        self.client_key = state_dir / "client_key"  # authorized on every host
        self.other_key = state_dir / "other_key"  # authorized nowhere
        self.known_hosts = state_dir / "known_hosts"  # every host's current key
        # The hosts' python: the system one (starts fastest), else this one (the filesystem is shared).
        self.python = SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else sys.executable
        self._lock_fd: int | None = None
        self.is_up = False

    def __enter__(self) -> SSHBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- for tests ------------------------------------------------------------------------------------
    def spec(self, host_name: str, /, **overrides: Any) -> HostSpec:
        """The HostSpec of a bed host: root, the bed's client key, the bed's python."""
        host = self.hosts[host_name]
        spec = HostSpec(name=host_name, address=host.address, user="root", identity_file=str(self.client_key),
                        python=self.python, workdir="/tmp")
        return replace(spec, **overrides)

    def runner(self, host_name: str, /, **overrides: Any) -> SSHRunner:
        """An SSHRunner for a bed host that trusts the bed's known_hosts and reads no ssh_config."""
        return SSHRunner(self.spec(host_name, **overrides), known_hosts=self.known_hosts, ssh_config=None)

    def exec(
        self, name: str, cmd: str, *, check: bool = False, timeout: float = 10.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``sh -c cmd`` on the host, seeing its own process table and hostname (nsenter into sshd's
        namespaces); with sshd down, in its network namespace only (``ip netns exec``)."""
        host = self.hosts[name]
        pid = host.sshd_pid()
        if pid is not None:
            argv = ["nsenter", "-t", str(pid), "-m", "-u", "-n", "-p", "--", "sh", "-c", cmd]
        else:
            argv = ["ip", "netns", "exec", host.netns, "sh", "-c", cmd]
        return _run(*argv, check=check, timeout=timeout)

    def kill_sshd(self, name: str) -> None:
        """Crash the host: SIGKILL its sshd, PID 1 of its namespace, so that every process on it dies."""
        host = self.hosts[name]
        pid = host.sshd_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if host.proc is not None:
            host.proc.wait(timeout=10)
            host.proc = None
        _wait_for(lambda: not self._netns_pids(host), timeout=5, what=f"every process of {name} to die")

    def restart_sshd(self, name: str) -> None:
        """Boot the host again (a fresh process table), after :meth:`kill_sshd`."""
        host = self.hosts[name]
        if host.sshd_pid() is not None:
            raise BedError(f"{name}: sshd still runs")
        self._start_sshd(host)

    def regenerate_host_key(self, name: str) -> None:
        """A new host key for ``name`` (its sshd restarts, its processes die); the bed's known_hosts follows."""
        host = self.hosts[name]
        self.kill_sshd(name)
        _wait_keygen([_keygen(host.host_key, f"{name}-regenerated")])
        self._write_known_hosts()
        self._start_sshd(host)

    def partition(self, name: str, *, how: str = "nft") -> None:
        """Cut the host off: ``nft`` drops everything in and out of its eth0; ``link`` downs its veth."""
        host = self.hosts[name]
        if how == "nft":
            self._drop(host, input_rule='iifname "eth0" drop', output_rule='oifname "eth0" drop')
        elif how == "link":
            _run("ip", "link", "set", host.veth, "down")
        else:
            raise ValueError(f"how: 'nft' or 'link', not {how!r}")

    def ssh_only_from_hosts(self, name: str) -> None:
        """Let the host accept SSH only from the other test hosts, not from this machine (a bastion setup);
        :meth:`heal` undoes it."""
        self._drop(self.hosts[name], input_rule=f'iifname "eth0" ip saddr {SUBNET}.1 tcp dport 22 drop')

    @staticmethod
    def _drop(host: BedHost, *, input_rule: str, output_rule: str | None = None) -> None:
        """Install drop rules in the host's namespace, in the table :meth:`heal` deletes."""
        chains = [f"  chain input {{ type filter hook input priority -300; {input_rule}; }}"]
        if output_rule is not None:
            chains.append(f"  chain output {{ type filter hook output priority -300; {output_rule}; }}")
        rules = f"table inet {NFT_TABLE} {{\n" + "\n".join(chains) + "\n}\n"
        _run("ip", "netns", "exec", host.netns, "nft", "-f", "-", input=rules)

    def heal(self, name: str) -> None:
        """Undo :meth:`partition` (either kind)."""
        host = self.hosts[name]
        _run("ip", "netns", "exec", host.netns, "nft", "delete", "table", "inet", NFT_TABLE, check=False)
        _run("ip", "link", "set", host.veth, "up")

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of the host (a hung machine: TCP still answers, nothing else does)."""
        for pid in self._netns_pids(self.hosts[name]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        for pid in self._netns_pids(self.hosts[name]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    # -- up and down ----------------------------------------------------------------------------------
    def up(self) -> None:
        if self.is_up:
            return
        self._take_lock()
        try:
            self._sweep()
            self._setup()
        except BaseException:
            with contextlib.suppress(BedError):
                self.down()
            raise
        self.is_up = True

    def down(self) -> None:
        """Tear everything down, best effort and complete; BedError lists whatever could not be removed."""
        if self._lock_fd is None:
            return
        problems = self._sweep(strict=False)
        self.is_up = False
        os.close(self._lock_fd)
        self._lock_fd = None
        if problems:
            raise BedError("SSH test bed cleanup: " + "; ".join(problems))

    def _take_lock(self) -> None:
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BedError(f"another SSH test bed is up on this machine ({LOCK_FILE} is locked)") from None
        self._lock_fd = fd

    def _setup(self) -> None:
        self.state.mkdir(mode=0o700)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation folder
        keygens = [_keygen(self.client_key, "psctl-sshbed-client"), _keygen(self.other_key, "psctl-sshbed-other")]
        for host in self.hosts.values():
            host.state.mkdir(mode=0o700)
            keygens.append(_keygen(host.host_key, host.name))
        _wait_keygen(keygens)
        shutil.copyfile(self.client_key.with_name("client_key.pub"), self.state / "authorized_keys")
        (self.state / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        )
        passwd = Path("/etc/passwd").read_text().splitlines()
        (self.state / "passwd").write_text(
            "".join((_with_shell(line, "/bin/sh") if line.startswith("root:") else line) + "\n" for line in passwd)
        )
        self._write_known_hosts()
        # The safety route first, so that no test packet can leave by the default route at any moment.
        root_cmds = [
            f"route add {' '.join(SAFETY_ROUTE)}",
            f"link add {BRIDGE} type bridge",
            f"addr add {SUBNET}.1/24 dev {BRIDGE}",
            f"link set {BRIDGE} up",
        ]
        for host in self.hosts.values():
            root_cmds += [
                f"netns add {host.netns}",
                f"link add {host.veth} type veth peer name eth0 netns {host.netns}",
                f"link set {host.veth} master {BRIDGE} up",
            ]
        _run("ip", "-batch", "-", input="\n".join(root_cmds) + "\n")
        for host in self.hosts.values():
            ns_cmds = [f"addr add {host.address}/24 dev eth0", "link set eth0 up", "link set lo up"]
            _run("ip", "-n", host.netns, "-batch", "-", input="\n".join(ns_cmds) + "\n")
            host.config.write_text(self._sshd_config(host))
        for host in self.hosts.values():
            self._start_sshd(host, wait=False)
        for host in self.hosts.values():
            _wait_for(host.answers, timeout=10, what=f"sshd of {host.name} to listen on {host.address}:22")

    def _sshd_config(self, host: BedHost) -> str:
        return "\n".join([
            f"ListenAddress {host.address}",
            "Port 22",
            f"HostKey {host.host_key}",
            "PidFile none",
            f"AuthorizedKeysFile {self.state / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes yes",
            "UseDNS no",
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "Subsystem sftp internal-sftp",
            "",
        ])

    def _start_sshd(self, host: BedHost, *, wait: bool = True) -> None:
        inner = (
            f"hostname {host.name} && mount --bind {self.state / 'hosts'} /etc/hosts && "
            f"mount --bind {self.state / 'passwd'} /etc/passwd && "
            f"exec {which('sshd')} -D -f {host.config} -E {host.state / 'sshd.log'}"
        )
        with open(host.state / "unshare.log", "ab") as log:
            host.proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--pid", "--fork",
                 "--kill-child", "--mount-proc", "sh", "-c", inner],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        if wait:
            _wait_for(host.answers, timeout=10, what=f"sshd of {host.name} to listen on {host.address}:22")

    def _write_known_hosts(self) -> None:
        lines = []
        for host in self.hosts.values():
            if host.host_key.with_name(host.host_key.name + ".pub").exists():
                kind, key = host.host_key.with_name(host.host_key.name + ".pub").read_text().split()[:2]
                lines.append(f"{host.address} {kind} {key}\n")
        self.known_hosts.write_text("".join(lines))
        self.known_hosts.chmod(0o600)

    @staticmethod
    def _netns_pids(host: BedHost) -> list[int]:
        done = _run("ip", "netns", "pids", host.netns, check=False)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def _sweep(self, *, strict: bool = True) -> list[str]:
        """Remove this bed's namespaces, processes, bridge, route and state, and leftovers of an earlier bed
        (same names: only one bed per machine, under the lock). Returns what could not be removed."""
        problems: list[str] = []
        for host in self.hosts.values():
            if host.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    host.proc.kill()  # --kill-child takes sshd, PID 1, and with it the host's processes
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.proc.wait(timeout=10)
                host.proc = None
        names = _run("ip", "netns", "list", check=False).stdout.split()
        stale = sorted({n for n in names if n.startswith(NS_PREFIX) and n[len(NS_PREFIX):].isdigit()}
                       | {h.netns for h in self.hosts.values() if h.netns in names})
        for netns in stale:
            pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).stdout.split() if p.isdigit()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                _wait_for(lambda ns=netns: not _run("ip", "netns", "pids", ns, check=False).stdout.split(),
                          timeout=10, what=f"the processes of {netns} to die")
            except BedError as exc:
                problems.append(str(exc))
            done = _run("ip", "netns", "del", netns, check=False)
            if done.returncode != 0:
                problems.append(f"ip netns del {netns}: {done.stderr.strip()}")
        # A namespace outlives its name while the kernel still holds it (an orphaned TCP socket of a killed
        # sshd retrying for a minute or two): delete the root-side veth ends explicitly, taking their peers.
        for link in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = link.split(":")[1].strip().split("@")[0] if link.count(":") >= 2 else ""
            if name.startswith(NS_PREFIX) and name.endswith("-r") and name[len(NS_PREFIX):-2].isdigit():
                done = _run("ip", "link", "del", name, check=False)
                if done.returncode != 0 and _run("ip", "link", "show", name, check=False).returncode == 0:
                    problems.append(f"ip link del {name}: {done.stderr.strip()}")
        if _run("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            done = _run("ip", "link", "del", BRIDGE, check=False)
            if done.returncode != 0:
                problems.append(f"ip link del {BRIDGE}: {done.stderr.strip()}")
        routes = _run("ip", "route", "show", f"{SUBNET}.0/24", check=False).stdout
        if "unreachable" in routes and "metric 4242" in routes:  # last: it guards the subnet until now
            done = _run("ip", "route", "del", *SAFETY_ROUTE, check=False)
            if done.returncode != 0:
                problems.append(f"ip route del {' '.join(SAFETY_ROUTE)}: {done.stderr.strip()}")
        shutil.rmtree(self.state, ignore_errors=True)
        if self.state.exists():
            problems.append(f"cannot remove {self.state}")
        if strict and problems:
            raise BedError("cannot clear the leftovers of an earlier SSH test bed: " + "; ".join(problems))
        return problems


def _with_shell(passwd_line: str, shell: str) -> str:
    fields = passwd_line.split(":")
    fields[-1] = shell
    return ":".join(fields)


# -- the pytest fixture: one bed per session, shared by every module that imports the fixture ------------
_shared: SSHBed | None = None
_users = 0
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_bed(n: int = 3) -> Iterator[SSHBed]:
    """The session's bed (brought up by its first user, torn down when its last user is done)."""
    global _shared, _users
    with _shared_lock:
        if _shared is None:
            bed = SSHBed(n)
            bed.up()
            _shared = bed
        elif len(_shared.hosts) < n:
            raise BedError(f"the shared SSH test bed has {len(_shared.hosts)} hosts, {n} wanted")
        _users += 1
        bed = _shared
    try:
        yield bed
    finally:
        with _shared_lock:
            _users -= 1
            if _users == 0:
                _shared = None
                bed.down()


@pytest.fixture(scope="session", name="sshbed")
def sshbed_fixture() -> Iterator[SSHBed]:
    """Three SSH test hosts h1..h3 (skipped without root and the tools, except under CI: failed)."""
    reason = unavailable_reason()
    if reason is not None:
        skip_or_fail(reason)
    with contextlib.ExitStack() as stack:
        try:
            bed = stack.enter_context(shared_bed(3))
        except BedError as exc:
            skip_or_fail(f"the SSH test bed could not start: {exc}")
            raise  # not reached: skip_or_fail raises
        yield bed

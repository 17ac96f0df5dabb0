"""Processes on another machine, over SSH (paramiko): the :class:`Runner` interface for one host.

Connect lazily: the constructor does no I/O; the first operation connects, and a broken connection is
replaced on the next call. Every remote command runs under a timeout, so a crashed, frozen or cut-off host is
reported within seconds as a one-line :class:`LaunchError` naming the host and the fix (TCP keepalive alone
would take minutes). Roles start detached, each the leader of its own session and process group, with output
appended to a log file on that host::

    cd DIR || exit 1; setsid nohup env K=V ... CMD >> LOG 2>&1 < /dev/null & echo $!

Remote commands are POSIX ``sh``; remote paths are absolute, or relative to the remote user's home (``~/x``
or ``x``). Linux hosts only (``/proc`` is read for start times and environments).

To run one operation on many hosts at once, see :mod:`psctl.launch.fanout`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import posixpath
import re
import selectors
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

import paramiko

from psctl.errors import LaunchError, PsctlError
from psctl.launch import hosts
from psctl.launch.base import ProcessHandle, Runner, sh_path
from psctl.launch.local import UNKNOWN_EXIT
from psctl.runtime.exits import EXIT_FILE_VARIABLE
from psctl.spec.model import HostSpec

log = logging.getLogger("psctl.ssh")

CONNECT_TIMEOUT = 5.0
#: How often an idle SSH connection's thread wakes up (paramiko's default: every 0.1 s).
TRANSPORT_IDLE_WAKEUP = 2.0
COMMAND_TIMEOUT = 5.0
#: A process whose start time differs by more than this from its handle's is another process (pid reused).
#: Start times are computed as psutil does (boot time + start ticks / CLK_TCK), so one process always gets the
#: same value; as with psutil, a step of the host's clock (which moves its boot time) breaks the comparison.
START_TIME_TOLERANCE = 0.01
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Lists the pids (and /proc stat fields) of processes whose environment holds PSCTL_CLUSTER_ID=argv[1].
_FIND_CLUSTER = """\
import os, sys
needle = b"PSCTL_CLUSTER_ID=" + sys.argv[1].encode()
skip = {str(os.getpid()), str(os.getppid())}
for pid in os.listdir("/proc"):
    if not pid.isdigit() or pid in skip:
        continue
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            env = f.read().split(b"\\0")
        with open("/proc/%s/stat" % pid, "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        continue
    if needle in env:
        print(pid, stat.strip())
"""


class HostUnreachable(LaunchError):
    """The host did not answer (connection refused, timed out, lost, or no reply to a command)."""


class _NoReply(Exception):
    """A remote command did not finish within its timeout."""


def _sftp_path(path: str | PurePath) -> str:
    """SFTP paths are relative to the remote home: ``~/x`` becomes ``x``."""
    text = str(path)
    if text == "~":
        return "."
    return text[2:] if text.startswith("~/") else text


def _parse_stat(line: str) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from a /proc/PID/stat line, or None."""
    try:
        fields = line[line.rindex(")") + 2 :].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def _pump(channel: paramiko.Channel, local_port: int) -> None:
    """Copy bytes both ways between a forwarded SSH channel and a new connection to ``local_port``.

    A selector (epoll), not ``select.select``: a supervisor of hundreds of hosts has descriptors past 1023."""
    try:
        sock = socket.create_connection(("127.0.0.1", local_port), timeout=5.0)
    except OSError:
        channel.close()
        return
    sock.settimeout(None)
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        selector.register(channel, selectors.EVENT_READ)
        try:
            while not channel.closed:
                for key, _ in selector.select(1.0):
                    source, sink = (sock, channel) if key.fileobj is sock else (channel, sock)
                    data = source.recv(65536)
                    if not data:
                        return
                    sink.sendall(data)
        except (OSError, paramiko.SSHException, EOFError):
            pass
        finally:
            channel.close()
            sock.close()


#: How Python ends what it prints of an error: ``ModuleNotFoundError: No module named 'numpy'``.
_PYTHON_ERROR = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class SSHRunner(Runner):
    """Starts and controls processes on one host over SSH. Besides the :class:`Runner` methods it offers
    :meth:`run`, :meth:`put_file`, :meth:`put_bytes`, :meth:`get_file`, :meth:`listdir`, :meth:`check_python`,
    :meth:`python_error`, and the reverse forwards of :meth:`forward_remote_port` and :meth:`remote_port`.

    ``known_hosts``: the user's known_hosts file (read, and written by ``accept-new``); default
    ``~/.ssh/known_hosts`` or the ssh_config's ``UserKnownHostsFile``. ``ssh_config``: an OpenSSH client
    config consulted for what the spec leaves open (None: none).
    """

    def __init__(
        self,
        host: HostSpec,
        *,
        known_hosts: str | Path | None = None,
        ssh_config: str | Path | None = hosts.DEFAULT_SSH_CONFIG,
        connect_timeout: float = CONNECT_TIMEOUT,
        command_timeout: float = COMMAND_TIMEOUT,
        allow_agent: bool = True,
    ) -> None:
        self.spec = host
        self.host = host.name
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._known_hosts = Path(known_hosts) if known_hosts is not None else None
        self._ssh_config = Path(ssh_config) if ssh_config is not None else None
        self._allow_agent = allow_agent
        self._lock = threading.RLock()
        self._target: hosts.Target | None = None
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._boot: tuple[float, int] | None = None  # (boot time, clock ticks per second) of this connection
        self._poll_lock = threading.RLock()
        self._watched: dict[ProcessHandle, None] = {}  # processes poll() looks at (an ordered set)
        self._exited: dict[ProcessHandle, int] = {}
        self._exit_files: dict[ProcessHandle, str] = {}
        #: Reverse port forwards: remote port on the host -> local port here, re-requested after a reconnect.
        self._forwards: dict[int, int] = {}
        self._forwarded_on: paramiko.Transport | None = None
        self._jump_clients: list[paramiko.SSHClient] = []  # ProxyJump hosts of the current connection

    def __enter__(self) -> SSHRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SSHRunner({self.host!r}, {self.spec.address}:{self.spec.port})"

    # -- the Runner interface -------------------------------------------------------------------------
    def start(self, *, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: PurePath) -> ProcessHandle:
        if not argv:
            raise ValueError("argv is empty")
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"invalid environment variable name {name!r}")
        log_text = str(log_path)
        if not log_text.startswith(("/", "~")):
            log_text = "~/" + log_text  # relative to the remote home, as read_file reads it, not to ``cwd``
        log = sh_path(log_text)
        # A role is not our child here, so its exit code cannot be waited for: it leaves it in this file.
        exit_file = str(env.get(EXIT_FILE_VARIABLE) or posixpath.splitext(log_text)[0] + ".exit")
        env = {**env, EXIT_FILE_VARIABLE: exit_file}
        assign = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        command = " ".join(shlex.quote(a) for a in argv)
        script = (
            f"mkdir -p -m 700 {sh_path(posixpath.dirname(log_text))} && : >> {log} "
            f"&& chmod 600 {log} && rm -f {sh_path(exit_file)} || exit 1; cd {sh_path(cwd)} || exit 1; "
            f"setsid nohup env {assign} {command} >> {log} 2>&1 < /dev/null & "
            "pid=$!; echo $pid; cat /proc/$pid/stat 2>/dev/null; exit 0"
        )
        code, out, err = self._exec(script)
        lines = out.splitlines()
        if code != 0 or not lines or not lines[0].strip().isdigit():
            raise LaunchError(
                f"host {self.host}: cannot start {argv[0]}: {_last_line(err)}; check the working folder "
                f"{cwd!r} and the log folder exist or can be created"
            )
        pid = int(lines[0])
        stat = _parse_stat(lines[1]) if len(lines) > 1 else None
        created = self._start_time(stat[1]) if stat else None
        handle = ProcessHandle(self.host, pid, created)
        with self._poll_lock:
            self._exit_files[handle] = exit_file
            self._watched[handle] = None
        return handle

    def poll(self, handle: ProcessHandle) -> int | None:
        """None while running, else its exit code (from its exit file; -255 if it left none: killed).

        One command looks at every process this runner watches: polling 20 processes on a host costs one round
        trip, not 20. (Roles are watched by the host's agent; this is for the agent itself and for ``down``.)
        """
        self._check_pid(handle)
        with self._poll_lock:
            if handle in self._exited:
                return self._exited[handle]
            self._watched.setdefault(handle, None)
        self._refresh_status()
        with self._poll_lock:
            return self._exited.get(handle)

    def _refresh_status(self) -> None:
        """Read /proc/PID/stat and the exit file of every watched process, in one command."""
        with self._poll_lock:
            watched = list(self._watched)
            exit_files = [self._exit_files.get(h) for h in watched]
        if not watched:
            return
        parts = []
        for i, (h, exit_file) in enumerate(zip(watched, exit_files, strict=True)):
            parts.append(f"echo P{i} $(cat /proc/{h.pid}/stat 2>/dev/null)")
            if exit_file is not None:
                parts.append(f"echo E{i} $(cat {sh_path(exit_file)} 2>/dev/null)")
        _, out, _ = self._exec("; ".join(parts) + "; exit 0")
        stats: dict[int, str] = {}
        codes: dict[int, str] = {}
        for line in out.splitlines():
            tag, _, rest = line.partition(" ")
            if tag[1:].isdigit():
                (stats if tag[0] == "P" else codes)[int(tag[1:])] = rest.strip()
        live = set()
        exited = {}
        for i, h in enumerate(watched):
            stat = _parse_stat(stats.get(i, ""))
            alive = stat is not None and stat[0] not in "ZXx"  # gone, or a zombie (`ps -o stat=` shows Z)
            if alive and h.create_time is not None and stat is not None:
                alive = abs(self._start_time(stat[1]) - h.create_time) <= START_TIME_TOLERANCE  # else pid reused
            if alive:
                live.add(h)
            else:
                text = codes.get(i, "")
                exited[h] = int(text) if text.lstrip("-").isdigit() else UNKNOWN_EXIT
        with self._poll_lock:
            self._exited.update(exited)
            for h in exited:
                self._watched.pop(h, None)

    def signal_group(self, handle: ProcessHandle, sig: int) -> None:
        pid = self._check_pid(handle)
        if self.poll(handle) is not None:
            return
        # pgid == pid (setsid); fall back to the process alone if the group cannot be signalled
        code, _, err = self._exec(f"kill -{int(sig)} -{pid} 2>/dev/null || kill -{int(sig)} {pid}")
        if code != 0 and self.poll(handle) is None:
            raise LaunchError(f"host {self.host}: cannot signal process group {pid}: {_last_line(err)}")

    def cluster_processes(self, cluster_id: str) -> list[ProcessHandle]:
        python = sh_path(self.spec.python)
        code, out, err = self._exec(f"{python} -S -c {shlex.quote(_FIND_CLUSTER)} {shlex.quote(cluster_id)}")
        if code != 0:
            raise self.python_error(code, err)
        found = []
        for line in out.splitlines():
            pid, _, rest = line.partition(" ")
            stat = _parse_stat(rest)
            if pid.isdigit() and stat is not None and stat[0] not in "ZXx":
                found.append(ProcessHandle(self.host, int(pid), self._start_time(stat[1])))
        return found

    def close(self) -> None:
        """Close the connection (the next call would reconnect)."""
        self._disconnect()

    def _disconnect(self) -> None:
        with self._lock:
            sftp, client, jumps = self._sftp, self._client, self._jump_clients
            self._sftp = self._client = None
            self._jump_clients = []
            self._boot = None
        if sftp is not None:
            sftp.close()
        if client is not None:
            client.close()
        for jump in jumps:
            jump.close()

    # -- extras ---------------------------------------------------------------------------------------
    def run(self, cmd: str, timeout: float | None = None) -> tuple[int, str, str]:
        """Run a shell command; returns (exit code, stdout, stderr). -1: killed by a signal.

        If it does not finish within ``timeout`` (default: ``command_timeout``) the host is probed: an
        answering host gives "command timed out", a silent one :class:`HostUnreachable`.
        """
        return self._exec(cmd, timeout=timeout, probe=True)

    def read_file(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        """The bytes of a remote file from ``offset`` on (SFTP; negative: from the end), at most ``size`` of them
        (all if negative), e.g. the new part of a role's log. FileNotFoundError if it does not exist."""
        return self._read(path, lambda end: max(0, end + offset) if offset < 0 else offset, size)[0]

    def read_end(self, path: str, nbytes: int) -> tuple[bytes, int]:
        return self._read(path, lambda end: max(0, end - nbytes))

    def _read(self, path: str, start: Callable[[int], int], size: int = -1) -> tuple[bytes, int]:
        """The file's bytes from ``start(its size)`` to its end or ``size`` of them (read over SFTP), and where
        they end (at the end: its size)."""

        def read(sftp: paramiko.SFTPClient) -> tuple[bytes, int]:
            with sftp.open(_sftp_path(path), "rb") as remote:
                begin = start(remote.stat().st_size)
                remote.seek(begin)
                data = remote.read(size if size >= 0 else None)
                return data, begin + len(data)

        return self._sftp_call(path, read)  # type: ignore[no-any-return]

    def put_file(self, local: str | Path, remote: str, mode: int = 0o600) -> None:
        """Copy a local file to the host (SFTP); its mode is set before any content is written, and it
        replaces ``remote`` atomically. The remote folder is created if missing."""
        self.put_bytes(Path(local).read_bytes(), remote, mode)

    def put_bytes(self, data: bytes, remote: str, mode: int = 0o600) -> None:
        """Write ``data`` to a file on the host, as :meth:`put_file` does."""
        folder = posixpath.dirname(remote)
        if folder:
            code, _, err = self._exec(f"mkdir -p {sh_path(folder)}")
            if code != 0:
                raise LaunchError(f"host {self.host}: cannot create {folder!r}: {_last_line(err)}")
        target = _sftp_path(remote)
        partial = f"{target}.{uuid.uuid4().hex[:8]}.part"

        def write(sftp: paramiko.SFTPClient) -> None:
            with sftp.open(partial, "wb") as out:
                out.chmod(mode)
                out.write(data)
            sftp.posix_rename(partial, target)

        self._sftp_call(remote, write, verb="write", undo=lambda sftp: sftp.remove(partial))

    def get_file(self, remote: str, local: str | Path) -> None:
        """Copy a file of the host here (SFTP, streamed); FileNotFoundError if it does not exist."""
        self._sftp_call(remote, lambda sftp: sftp.get(_sftp_path(remote), str(local)))

    def listdir(self, remote: str) -> list[str]:
        """The names in a folder of the host; FileNotFoundError if it does not exist."""
        return self._sftp_call(remote, lambda sftp: sftp.listdir(_sftp_path(remote)))  # type: ignore[no-any-return]

    def _sftp_call(
        self, path: str, call: Callable[[paramiko.SFTPClient], Any], *, verb: str = "read",
        undo: Callable[[paramiko.SFTPClient], object] | None = None,
    ) -> Any:
        """``call(sftp)`` with its failures as psctl's errors: no reply or a lost connection make the host
        unreachable; any other OSError is a LaunchError that cannot ``verb`` ``path`` (after ``undo``), except
        that a missing file stays FileNotFoundError when reading."""
        sftp = None
        try:
            sftp = self._sftp_client()
            return call(sftp)
        except OSError as exc:
            if isinstance(exc, TimeoutError):
                raise self._lost(f"no reply within {self.command_timeout:g}s") from exc
            if isinstance(exc, FileNotFoundError) and verb == "read":
                raise
            if undo is not None and sftp is not None:
                with contextlib.suppress(OSError, paramiko.SSHException):
                    undo(sftp)
            raise LaunchError(f"host {self.host}: cannot {verb} {path!r}: {exc.strerror or exc}") from exc
        except (paramiko.SSHException, EOFError) as exc:
            raise self._lost("connection lost") from exc

    def check_python(self) -> str:
        """The version of the host's ``python`` (e.g. ``3.11.2``); LaunchError if missing or older than 3.10."""
        code, out, err = self._exec(
            f"{sh_path(self.spec.python)} -c 'import sys; print(\"%d.%d.%d\" % sys.version_info[:3])'"
        )
        if code != 0:
            raise self.python_error(code, err)
        version = _last_line(out)
        try:
            too_old = tuple(int(p) for p in version.split(".")[:2]) < (3, 10)
        except ValueError:
            raise LaunchError(f"host {self.host}: python {self.spec.python!r} printed {version!r} for its version; "
                              "set hosts[].python") from None
        if too_old:
            raise LaunchError(
                f"host {self.host}: python {self.spec.python!r} is {version}; psctl needs 3.10 or newer; "
                "set hosts[].python"
            )
        return version

    def forward_remote_port(self, local_port: int, remote_port: int = 0) -> int:
        """Make ``127.0.0.1:PORT`` on the host reach ``127.0.0.1:local_port`` here, through this SSH
        connection (``ssh -R``); returns PORT. It works where the host cannot open a connection back to this
        machine, and it is requested again, on the same port, whenever the connection is replaced."""
        transport = self._transport()
        with self._lock:
            try:
                port = transport.request_port_forward("127.0.0.1", remote_port, handler=self._on_forwarded)
            except paramiko.SSHException as exc:
                raise LaunchError(
                    f"host {self.host}: sshd refused a reverse port forward ({exc}); allow it with "
                    "`AllowTcpForwarding yes` (or `remote`) in the host's sshd_config"
                ) from exc
            self._forwards[port] = local_port
            self._forwarded_on = transport
            return port

    def _on_forwarded(self, channel: paramiko.Channel, origin: object, server: tuple[str, int]) -> None:
        """A connection arrived on a forwarded port (paramiko's transport thread: hand it off at once)."""
        local_port = self._forwards.get(server[1])
        if local_port is None:
            channel.close()
            return
        threading.Thread(target=_pump, args=(channel, local_port), daemon=True, name="psctl-forward").start()

    def remote_port(self, local_port: int) -> int | None:
        """The port on the host that now forwards to ``local_port`` here (it can change after a reconnect)."""
        return next((r for r, loc in self._forwards.items() if loc == local_port), None)

    def _restore_forwards(self, transport: paramiko.Transport) -> None:
        """Ask a new connection for the forwards the old one had, on the same ports; where the host still holds
        a port (the old session has not noticed it is dead), on a new one: processes started from now on get
        the new port from :meth:`remote_port`, older ones lose their way and are replaced."""
        if not self._forwards or self._forwarded_on is transport:
            return
        restored: dict[int, int] = {}
        try:
            for remote_port, local_port in self._forwards.items():
                try:
                    port = transport.request_port_forward("127.0.0.1", remote_port, handler=self._on_forwarded)
                except paramiko.SSHException:
                    port = transport.request_port_forward("127.0.0.1", 0, handler=self._on_forwarded)
                    log.warning("host %s: port %d still taken there; forwarding from port %d instead",
                                self.host, remote_port, port)
                restored[port] = local_port
        except paramiko.SSHException as exc:
            log.warning("host %s: reverse port forward not restored yet: %s", self.host, exc)
            return
        self._forwards = restored
        self._forwarded_on = transport

    # -- connection -----------------------------------------------------------------------------------
    def _unreachable(self, target: hosts.Target, what: str, fix: str) -> HostUnreachable:
        if target.name != self.spec.name:
            return HostUnreachable(f"{self._where(target)}: unreachable: {what}; {fix}")
        return HostUnreachable(f"host {self.host} ({target.hostname}:{target.port}): unreachable: {what}; {fix}")

    def _lost(self, what: str) -> HostUnreachable:
        """Forget the connection (the next call reconnects) and describe why."""
        self._disconnect()
        target = self._target or hosts.resolve(self.spec, ssh_config=None)
        return self._unreachable(target, what, "check that the host is up and the network (the next call "
                                               "reconnects)")

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    self._restore_forwards(transport)
                    return transport
                self._disconnect()
            self._client = self._connect()
            transport = self._client.get_transport()
            assert transport is not None
            self._restore_forwards(transport)
            return transport

    def _connect(self) -> paramiko.SSHClient:
        try:
            target = hosts.resolve(self.spec, ssh_config=self._ssh_config, known_hosts=self._known_hosts)
        except hosts.ConfigError as exc:
            raise LaunchError(f"host {self.host}: {exc}; fix hosts[].proxy_jump or {self._ssh_config}") from exc
        except (OSError, ImportError, paramiko.SSHException) as exc:
            raise LaunchError(f"host {self.host}: cannot use the ssh config {self._ssh_config}: {exc}") from exc
        self._target = target
        for key in target.key_filenames if self.spec.identity_file else ():
            if not Path(key).is_file():
                raise LaunchError(f"host {self.host}: identity_file {key!r} not found; set hosts[].identity_file")
        jumps: list[paramiko.SSHClient] = []
        try:
            client = self._handshake(target, self._open_socket(target, jumps))
        except BaseException:
            for jump in jumps:
                jump.close()
            raise
        with self._lock:
            self._jump_clients = jumps
        for connected in (client, *jumps):
            transport = connected.get_transport()
            if transport is not None:
                # paramiko's transport thread wakes every 0.1 s to see whether it was closed: 10 wake-ups a
                # second per host, most of an idle supervisor's CPU with tens of hosts. close() closes the
                # socket, which ends a waiting read at once, so a slower wake-up costs nothing.
                transport.sock.settimeout(TRANSPORT_IDLE_WAKEUP)
        return client

    def _where(self, target: hosts.Target) -> str:
        """How messages name the machine ``target`` is: the host itself, or one of its jump hosts."""
        if target.name == self.spec.name:
            return f"host {self.host}"
        return f"host {self.host}: jump host {target.hostname}:{target.port}"

    def _handshake(self, target: hosts.Target, sock: socket.socket | paramiko.Channel) -> paramiko.SSHClient:
        """SSH over ``sock`` to ``target``: host key verified, authenticated; a clear error otherwise."""
        timeout = target.connect_timeout or self.connect_timeout
        where = self._where(target)
        client = paramiko.SSHClient()
        try:
            hosts.load_known_hosts(client, target)
        except OSError as exc:
            raise LaunchError(f"host {self.host}: cannot read known_hosts: {exc}; check its permissions") from exc
        client.set_missing_host_key_policy(hosts.host_key_policy(target))
        try:
            client.connect(
                target.hostname,
                port=target.port,
                username=target.user,
                key_filename=list(target.key_filenames) or None,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                allow_agent=self._allow_agent,
                look_for_keys=not target.key_filenames,
                sock=sock,
            )
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise LaunchError(
                f"{where}: host key CHANGED (possible attack); remove the old key from "
                f"{target.known_hosts} if the change is expected"
            ) from exc
        except hosts.UnknownHostKey as exc:
            client.close()
            raise LaunchError(
                f"{where}: unknown host key; add it to known_hosts (ssh-keyscan) or set "
                "host_key_policy: accept-new"
            ) from exc
        except paramiko.AuthenticationException as exc:
            client.close()
            raise LaunchError(
                f"{where}: authentication failed for user {target.user}; check identity_file or ssh-agent"
            ) from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            client.close()
            raise self._unreachable(
                target, f"ssh handshake failed ({exc or type(exc).__name__})",
                f"check that sshd runs on port {target.port}"
            ) from exc
        return client

    def _open_socket(self, target: hosts.Target, jumps: list[paramiko.SSHClient]) -> socket.socket | paramiko.Channel:
        """A connection to ``target``'s sshd: a TCP socket, or a tunnel from its jump host (connected first,
        recursively; each jump's client is appended to ``jumps``, to close with the connection)."""
        timeout = target.connect_timeout or self.connect_timeout
        if target.jump is not None:
            jump = self._handshake(target.jump, self._open_socket(target.jump, jumps))
            jumps.append(jump)
            transport = jump.get_transport()
            assert transport is not None
            try:
                return transport.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                                              timeout=timeout)
            except (paramiko.SSHException, OSError) as exc:
                raise self._unreachable(
                    target, f"jump host {target.jump.hostname} cannot connect to it ({exc or type(exc).__name__})",
                    "check the address, that sshd runs, and that the jump host allows TCP forwarding") from exc
        fix = "check the address and that sshd runs"
        try:
            sock = socket.create_connection((target.hostname, target.port), timeout=timeout)
        except socket.gaierror as exc:
            fix = "check hosts[].address" if target.name == self.spec.name else (
                f"check hosts[].proxy_jump of {self.host}: {target.hostname!r} is neither a host of the spec nor "
                "an address this machine resolves")
            raise self._unreachable(target, "unknown address", fix) from exc
        except TimeoutError as exc:
            raise self._unreachable(target, f"connection timed out after {timeout:g}s", fix) from exc
        except ConnectionRefusedError as exc:
            raise self._unreachable(target, "connection refused", "check the port and that sshd runs") from exc
        except OSError as exc:
            what = {errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network is unreachable"}.get(
                exc.errno or 0, exc.strerror or str(exc)
            )
            raise self._unreachable(target, what, "check the address and the network") from exc
        # A backstop for the few paramiko calls without a timeout: the kernel drops a connection whose data
        # stays unacknowledged, or whose idle probes go unanswered, for a few seconds.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                            ("TCP_USER_TIMEOUT", int(2000 * max(self.command_timeout, self.connect_timeout)))):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        return sock

    def _sftp_client(self) -> paramiko.SFTPClient:
        transport = self._transport()
        with self._lock:
            if self._sftp is None:
                try:
                    self._sftp = paramiko.SFTPClient.from_transport(transport)
                except (paramiko.SSHException, EOFError, OSError) as exc:
                    raise self._lost(f"cannot open SFTP ({exc})") from exc
                assert self._sftp is not None
                self._sftp.get_channel().settimeout(self.command_timeout)  # type: ignore[union-attr]
            return self._sftp

    # -- commands -------------------------------------------------------------------------------------
    def _exec(self, cmd: str, *, timeout: float | None = None, probe: bool = False) -> tuple[int, str, str]:
        timeout = self.command_timeout if timeout is None else timeout
        transport = self._transport()
        try:
            channel = transport.open_session(timeout=timeout)
        except paramiko.ChannelException as exc:  # sshd answered, and said no
            raise LaunchError(f"host {self.host}: sshd refused a session ({exc}); check MaxSessions") from exc
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if transport.is_active():  # alive but silent: a frozen host or a cut network
                raise self._lost(f"no reply within {timeout:g}s") from exc
            self._disconnect()  # the connection broke before the command was sent: reconnect once
            try:
                channel = self._transport().open_session(timeout=timeout)
            except (paramiko.SSHException, EOFError, OSError) as again:
                raise self._lost("connection lost") from again
        try:
            channel.settimeout(timeout)
            channel.exec_command(cmd)
            code, out, err = self._collect(channel, time.monotonic() + timeout)
        except _NoReply:
            if probe and self._answers():
                raise LaunchError(f"host {self.host}: command timed out after {timeout:g}s: {cmd[:80]}") from None
            raise self._lost(f"no reply within {timeout:g}s") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(f"connection lost ({exc or type(exc).__name__})") from exc
        finally:
            channel.close()
        return code, out.decode(errors="replace"), err.decode(errors="replace")

    @staticmethod
    def _collect(channel: paramiko.Channel, deadline: float) -> tuple[int, bytes, bytes]:
        """Read stdout and stderr until end of output and exit status, or raise _NoReply at ``deadline``."""
        out, err = bytearray(), bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(channel, selectors.EVENT_READ)
            while True:
                if channel.recv_ready():
                    out += channel.recv(65536)
                elif channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                elif channel.closed or (channel.eof_received and channel.exit_status_ready()):
                    return channel.recv_exit_status(), bytes(out), bytes(err)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise _NoReply
                    if channel.eof_received:  # the fileno stays readable after EOF: wait for the status instead
                        channel.status_event.wait(min(remaining, 0.05))
                    else:
                        selector.select(min(remaining, 0.5))

    def _answers(self) -> bool:
        """Whether the host still answers at all (opens a channel within the command timeout)."""
        try:
            probe = self._transport().open_session(timeout=min(self.command_timeout, 3.0))
        except (PsctlError, paramiko.SSHException, EOFError, OSError):
            return False
        probe.close()
        return True

    # -- helpers --------------------------------------------------------------------------------------
    def _check_pid(self, handle: ProcessHandle) -> int:
        if handle.host != self.host:
            raise ValueError(f"handle of host {handle.host!r} given to the runner of host {self.host!r}")
        if handle.pid <= 1:
            raise ValueError(f"refusing to act on pid {handle.pid}")
        return handle.pid

    def _start_time(self, ticks: int) -> float:
        """Seconds since the epoch, as psutil computes ``create_time`` (boot time + ticks / CLK_TCK)."""
        if self._boot is None:
            _, out, err = self._exec("awk '/^btime/ {print $2}' /proc/stat; getconf CLK_TCK")
            try:
                btime_text, hz_text = out.split()
                self._boot = float(btime_text), int(hz_text)
            except ValueError:
                raise LaunchError(f"host {self.host}: cannot read the boot time ({_last_line(err)}); "
                                  "psctl needs a Linux host") from None
        boot, hz = self._boot
        return boot + ticks / hz

    def python_error(self, code: int, err: str) -> LaunchError:
        """The error for a failed run of the host's python: not found, not a Python (a shell, say, whose words
        are not Python's), or what it printed last."""
        if code in (126, 127):
            return LaunchError(f"host {self.host}: python {self.spec.python!r} not found; set hosts[].python")
        last = _last_line(err)
        if "Traceback (most recent call last)" not in err and not _PYTHON_ERROR.match(last):
            said = last if len(last) <= 100 else f"{last[:100]}..."
            return LaunchError(f"host {self.host}: python {self.spec.python!r} is not a Python (it said: {said}); "
                               "set hosts[].python to a python >= 3.10")
        return LaunchError(f"host {self.host}: python {self.spec.python!r} failed: {last}")

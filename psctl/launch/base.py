"""The launch backend interface, and teardown written once on top of it.

A backend starts a role as the leader of its own process group (so that everything the role spawns is
signalled with it), reports whether it has exited, signals its group, and finds every process of a cluster
by the ``PSCTL_CLUSTER_ID`` it carries in its environment (so that ``down`` verifies nothing is left, even
processes the state file no longer knows about).
"""

from __future__ import annotations

import shlex
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import TypeVar

from psctl.launch.fanout import run_on_all

T = TypeVar("T")


@dataclass(frozen=True)
class ProcessHandle:
    host: str
    pid: int
    #: Process creation time as psutil reports it: guards against acting on a reused pid.
    create_time: float | None = None


class Runner(ABC):
    """Starts and controls processes on one kind of host. Constructors do no I/O."""

    #: The host's name, as role records and process handles name it (``localhost`` for this machine).
    host: str

    @abstractmethod
    def start(self, *, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: PurePath) -> ProcessHandle:
        """Start ``argv`` detached in a new session and process group, output appended to ``log_path``."""

    @abstractmethod
    def poll(self, handle: ProcessHandle) -> int | None:
        """None while running; else the exit code (negative: killed by that signal; -255: unknown)."""

    @abstractmethod
    def signal_group(self, handle: ProcessHandle, sig: int) -> None:
        """Signal the handle's process group; a group already gone is not an error."""

    @abstractmethod
    def cluster_processes(self, cluster_id: str) -> list[ProcessHandle]:
        """Every live process (not zombie) whose environment has PSCTL_CLUSTER_ID=cluster_id."""

    @abstractmethod
    def read_file(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        """The bytes of a file on this runner's host from ``offset`` on (a negative offset counts from the
        end), at most ``size`` of them (all if negative); FileNotFoundError if it does not exist."""

    def read_end(self, path: str, nbytes: int) -> tuple[bytes, int]:
        """The last ``nbytes`` of a file and its size (where a reader following it goes on); backends
        override it to read only that end. FileNotFoundError if it does not exist."""
        data = self.read_file(path)
        return data[max(0, len(data) - nbytes):], len(data)

    def forward_remote_port(self, local_port: int, remote_port: int = 0) -> int:
        """Make a loopback port on the host reach ``127.0.0.1:local_port`` here; returns that port. On this
        machine it is ``local_port`` itself; over SSH a reverse forward (which works where the host cannot open
        connections back to this machine). ``remote_port`` asks for a port there (0: any)."""
        return local_port

    def remote_port(self, local_port: int) -> int | None:
        """The port on the host that reaches ``local_port`` here now (None: none yet)."""
        return local_port

    def close(self) -> None:  # noqa: B027 - optional hook: backends without connections need nothing
        """Release connections; safe to call twice."""


def stop_processes(
    runner: Runner,
    handles: Sequence[ProcessHandle],
    *,
    grace: float = 5.0,
    get_time: Callable[[], float] = time.monotonic,
    poll_interval: float = 0.05,
) -> list[ProcessHandle]:
    """SIGTERM every group, wait up to ``grace`` seconds, SIGKILL what is left; returns what survived.

    Best effort and keeps going: a process that is already gone is fine, one failure does not stop the rest.
    """
    live = [h for h in handles if runner.poll(h) is None]
    for handle in live:
        runner.signal_group(handle, signal.SIGTERM)
    deadline = get_time() + grace
    while live and get_time() < deadline:
        live = [h for h in live if runner.poll(h) is None]
        if live:
            time.sleep(poll_interval)
    for handle in live:
        runner.signal_group(handle, signal.SIGKILL)
    deadline = get_time() + 5.0
    while live and get_time() < deadline:
        live = [h for h in live if runner.poll(h) is None]
        if live:
            time.sleep(poll_interval)
    return live


def on_their_hosts(
    runners: Mapping[str, Runner], handles: Sequence[ProcessHandle],
    fn: Callable[[Runner, list[ProcessHandle]], T],
) -> dict[str, tuple[list[ProcessHandle], T | Exception]]:
    """``fn(runner, handles on its host)`` on every host that has some, all at once: per host, its handles
    and what ``fn`` returned or raised."""
    by_host: dict[str, list[ProcessHandle]] = {}
    for handle in handles:
        by_host.setdefault(handle.host, []).append(handle)
    results = run_on_all([runners[host] for host in by_host], lambda runner: fn(runner, by_host[runner.host]))
    return {host: (by_host[host], result) for host, result in results.items()}


def stop_on_hosts(
    runners: Mapping[str, Runner], handles: Sequence[ProcessHandle], *, grace: float = 5.0
) -> tuple[list[ProcessHandle], dict[str, Exception]]:
    """:func:`stop_processes` on every host at once: what survived, and the hosts that could not be reached
    (whose processes count as survivors)."""
    survivors: list[ProcessHandle] = []
    errors: dict[str, Exception] = {}
    done = on_their_hosts(runners, handles, lambda runner, group: stop_processes(runner, group, grace=grace))
    for host, (group, result) in done.items():
        if isinstance(result, Exception):
            errors[host] = result
            survivors += group
        else:
            survivors += result
    return survivors, errors


def sh_path(path: str | PurePath) -> str:
    """Quote a remote path for ``sh``, keeping a leading ``~/`` expandable."""
    text = str(path)
    if text == "~":
        return '"$HOME"'
    if text.startswith("~/"):
        return '"$HOME"/' + shlex.quote(text[2:])
    return shlex.quote(text)

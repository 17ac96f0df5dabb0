"""Roles an earlier agent of this host left running (it died), and taking them over.

An agent starts each role in a session of its own, so a role outlives its agent. A new agent of the host finds
them by their environment (cluster id and host name, as ``psctl down`` does) and adopts each that its agent
described there (``ADOPTION_VARIABLE``: name, incarnation, attempt, log, exit file, CPU file, and the address its
heartbeats go to): it serves heartbeats on that same port, so the roles' beats reach it unchanged, and its
hello names them, so the supervisor sees its roles still running instead of losing and restarting them (a ps
restarted loses the steps since its last checkpoint). An adopted role is not the new agent's child: its exit
shows by ``/proc`` when the agent looks (every ``WATCH_INTERVAL``), and its exit code is what the runtime wrote
to its exit file as it ended (``psctl.runtime.__main__.record_exit``; for a framework's program, the keeper it
runs under: ``psctl.agent.keeper``); where there is none, the signal its log's crash report names
(``psctl.agent.logs``), else SIGKILL's.
A role that ended while no agent watched it (between one agent's death and the next one's start) is not a
process any more: its agent also left its adoption record beside its log (``record_path``), removed when an agent
collects its end, and the next agent reports each such role as ended, with its exit file's code
(``find_records``), instead of leaving the supervisor to find it missing and restart it.
Only the process its agent started is adopted (its command line is the one described): a Slurm job step's task
inherits its srun's environment and leads a group of its own, and goes with its srun. Roles it cannot adopt (no
description, another port, or that port taken) are SIGKILLed: nothing reports on them, and they hold their
ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from psctl.agent.leftovers import kill_tree
from psctl.agent.logs import crash_signal
from psctl.agent.procfs import create_time, still_running
from psctl.runtime.exits import read_exit_file

#: Roles of the cluster started by an agent of this host carry this variable (its name in the cluster).
HOST_VARIABLE = "PSCTL_AGENT_HOST"
#: What a later agent needs to adopt a role, as JSON in the role's environment (see ``adoption_record``).
ADOPTION_VARIABLE = "PSCTL_AGENT_ROLE"
#: A role's adoption record beside its log: ``logs/worker-0.3.role`` (see ``record_path``).
RECORD_SUFFIX = ".role"


def adoption_record(*, name: str, incarnation: int, attempt: int, argv: Sequence[str], log_path: str,
                    exit_file: str, cpus_file: str, heartbeats: str, watched_only: bool = False,
                    cluster_id: str = "") -> str:
    """The ``ADOPTION_VARIABLE`` value for a role this agent starts with ``argv`` (``watched_only``: a
    framework's program, which sends no heartbeats), also left in ``record_path`` beside its log."""
    return json.dumps({"name": name, "incarnation": incarnation, "attempt": attempt, "argv": list(argv),
                       "log": log_path, "exit_file": exit_file, "cpus_file": cpus_file, "heartbeats": heartbeats,
                       "watched_only": watched_only, "cluster_id": cluster_id})


def record_path(log_path: str) -> str:
    """Where a role's adoption record lies while its end is not collected: beside its log."""
    return os.path.splitext(log_path)[0] + RECORD_SUFFIX


def find_records(logs_dir: str, cluster_id: str) -> list[dict[str, Any]]:
    """The adoption records left in ``logs_dir`` for roles of this cluster whose end no agent collected: the
    newest attempt of each role (an older attempt's record is stale, and removed)."""
    found: list[tuple[str, dict[str, Any]]] = []
    try:
        entries = [n for n in os.listdir(logs_dir) if n.endswith(RECORD_SUFFIX)]
    except OSError:
        return []
    for entry in entries:
        path = os.path.join(logs_dir, entry)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if (isinstance(record, dict) and record.get("cluster_id") == cluster_id
                and isinstance(record.get("name"), str) and isinstance(record.get("attempt"), int)):
            found.append((path, record))
    newest: dict[str, dict[str, Any]] = {}
    for _, record in sorted(found, key=lambda item: int(item[1]["attempt"])):
        newest[str(record["name"])] = record
    for path, record in found:
        if newest[str(record["name"])] is not record:
            with contextlib.suppress(OSError):
                os.remove(path)
    return list(newest.values())


def ended_code(exit_file: str, log: str) -> int:
    """How a role that is no longer running ended: the code in its exit file, else the signal of the crash its log
    ends with, else SIGKILL's (-9)."""
    code = read_exit_file(exit_file)
    return code if code is not None else -(crash_signal(log) or signal.SIGKILL)


@dataclass(frozen=True)
class Orphan:
    """A running role of this cluster and host that no agent of this process started."""

    pid: int
    create_time: float
    #: What its agent wrote to adopt it by (``adoption_record``); None: it cannot be adopted.
    record: dict[str, Any] | None
    #: The process its agent started (its command line is the record's argv), not one that inherited the
    #: record from it: a Slurm job step's task, which leads a process group of its own under slurmstepd.
    started_by_agent: bool = True

    @property
    def heartbeats(self) -> str:
        return str((self.record or {}).get("heartbeats", ""))

    @property
    def role(self) -> str:
        return str((self.record or {}).get("name", ""))


def _of_the_roles(cluster_id: str, host: str) -> Iterator[tuple[int, list[bytes]]]:
    """Every process (but this one) whose environment names this cluster and this host as a role's, with that
    environment: the roles, and whatever they started (it inherits their environment)."""
    me = os.getpid()
    needles = (f"PSCTL_CLUSTER_ID={cluster_id}".encode(), f"{HOST_VARIABLE}={host}".encode())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(n in env for n in needles):
            yield int(entry), env


def find_orphans(cluster_id: str, host: str) -> list[Orphan]:
    """The processes whose environment names this cluster and this host as a role's (a role's process group
    leader: its own children go with it)."""
    found = []
    for pid, env in _of_the_roles(cluster_id, host):
        try:
            if os.getpgid(pid) != pid:  # a role's own child (its group is signalled with it)
                continue
        except OSError:
            continue
        if not any(v.startswith(b"PSCTL_ROLE=") for v in env):
            continue
        prefix = f"{ADOPTION_VARIABLE}=".encode()
        raw = next((v[len(prefix):] for v in env if v.startswith(prefix)), None)
        record = None
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            record = json.loads(raw) if raw else None
        if not isinstance(record, dict):
            found.append(Orphan(pid, create_time(pid), None))
            continue
        found.append(Orphan(pid, create_time(pid), record, _command_line(pid) == record.get("argv")))
    return found


def end_strays(cluster_id: str, host: str) -> list[int]:
    """SIGKILL what this host's roles left once they all ended: processes that carry a role's environment and
    that no signal to a role's group or tree reached (a daemon that forked twice and whose parent ended; see
    ``psctl.agent.leftovers``); their pids. (They ran on until ``psctl down`` looked for them.)"""
    strays = {pid: create_time(pid) for pid, _ in _of_the_roles(cluster_id, host)}
    for pid, started in strays.items():
        if still_running(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return sorted(strays)


def _command_line(pid: int) -> list[str] | None:
    """The argv the process was started with (None if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode(errors="surrogateescape") for arg in f.read().split(b"\0")[:-1]]
    except OSError:
        return None


def left_to_their_roles(orphans: Sequence[Orphan], adopted: Sequence[Orphan]) -> list[Orphan]:
    """The orphans to stop, given those adopted: every other, but those that inherited an adopted role's record
    from the process its agent started (a job step's task goes with its srun, which Slurm ends it with)."""
    taken = {o.pid for o in adopted}
    roles = {o.role for o in adopted}
    return [o for o in orphans if o.pid not in taken and (o.started_by_agent or o.role not in roles)]


def adoptable(orphans: Sequence[Orphan]) -> list[Orphan]:
    """The orphans an agent may adopt: processes an agent started, that it described."""
    return [o for o in orphans if o.record is not None and o.started_by_agent]


def adoptable_port(orphans: Sequence[Orphan], heartbeat_host: str) -> int:
    """The port every adoptable orphan's heartbeats go to, where they agree and go to ``heartbeat_host``; 0
    where there is none."""
    addresses = {o.heartbeats for o in adoptable(orphans)}
    if len(addresses) != 1:
        return 0
    host, _, port = addresses.pop().rpartition(":")
    return int(port) if host == heartbeat_host and port.isdigit() else 0


def kill_orphans(orphans: Sequence[Orphan]) -> list[int]:
    """SIGKILL the orphans' process groups (those still the processes found); returns their pids."""
    killed = []
    for orphan in orphans:
        if still_running(orphan.pid, orphan.create_time):
            kill_tree(orphan.pid)
            killed.append(orphan.pid)
    return killed


class AdoptedProcess:
    """An orphan taken over: what the agent needs of a role's process (``psctl.agent.core.Process``), for one
    that is not its child."""

    def __init__(self, orphan: Orphan) -> None:
        self.pid = orphan.pid
        self._created = orphan.create_time
        self._exit_file = str((orphan.record or {}).get("exit_file", ""))
        self._log = str((orphan.record or {}).get("log", ""))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it ended: the one it wrote to its exit file, else the signal of the crash its log
        ends with (a native crash), else SIGKILL's (-9)."""
        if self.returncode is None and not still_running(self.pid, self._created):
            self.returncode = ended_code(self._exit_file, self._log)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal its process group (it leads one, as every role does); SIGKILL also every process below it
        (psctl.agent.leftovers). What is left in its group once it ended is not: not being its parent, this
        agent cannot see its end before its pid, and so its group's id, may be another process's."""
        if self.returncode is None and still_running(self.pid, self._created):
            if sig == signal.SIGKILL:
                kill_tree(self.pid)
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

"""Finding a cluster and reading what it wrote: which cluster a command means, whether its supervisor still
runs, and its roles' logs, on whichever host ran each attempt.

What the read-only commands (``psctl status``, ``logs``, ``top``, ``events``, ``ls``) need, kept apart from
the launch machinery in :mod:`psctl.operations` (spec validation, certificates, the agents' gRPC endpoint),
so that they start without importing numpy, cryptography or gRPC.
"""

from __future__ import annotations

import collections
import heapq
import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from psctl.errors import ClusterNotFound, LogNotFound, PsctlError, UsageError
from psctl.home import ClusterDir, list_clusters, lock_held
from psctl.launch.base import ProcessHandle
from psctl.launch.hostset import Placement, host_runners, placements
from psctl.launch.local import LocalRunner
from psctl.supervisor.state import ClusterRecord, DamagedState, RoleRecord, RoleState, load_state


def supervisor_alive(cdir: ClusterDir, record: ClusterRecord) -> bool:
    """Whether the cluster's supervisor runs, or is starting: it holds the cluster's supervisor lock from its first
    moment, before it records its pid, to its last (the kernel drops it however it ends). A Slurm cluster's runs in
    its job, on a node of its own: the job decides. Where the lock says nothing (a file system without locks), the
    pid the supervisor recorded."""
    if record.backend == "slurm":
        from psctl.slurm_cluster import job_alive

        return job_alive(record)
    held = lock_held(cdir.supervisor_lock)
    return recorded_supervisor_runs(record) if held is None else held


def recorded_supervisor_runs(record: ClusterRecord) -> bool:
    """Whether the supervisor process the record names (pid and start time) runs."""
    if not record.supervisor_pid:
        return False
    try:
        proc = psutil.Process(record.supervisor_pid)
        if record.supervisor_create_time and abs(proc.create_time() - record.supervisor_create_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_stale(cdir: ClusterDir, record: ClusterRecord) -> bool:
    """The state file says the cluster runs, but its supervisor is gone: what it shows is the last known."""
    return not record.state.terminal and not supervisor_alive(cdir, record)


def is_cluster(name: str) -> bool:
    """Whether ``name`` names a cluster psctl knows (under PSCTL_HOME)."""
    try:
        return ClusterDir.named(_cluster_name(name)).state_file.is_file()
    except PsctlError:  # (not a name a cluster can have)
        return False


def resolve_cluster(name: str | None) -> ClusterDir:
    """The named cluster, or the only one (the only one not finished, if several exist). A spec's path names the
    cluster it describes (``psctl status cluster.yaml``, as it was started)."""
    if name:
        cluster = _cluster_name(name)
        if cluster == name and Path(name).suffix in (".yaml", ".yml"):  # (a spec it would have read)
            raise ClusterNotFound(f"no cluster named {name!r}, and no spec file there to name one; "
                                  "check the path, or `psctl ls` for the clusters")
        cdir = ClusterDir.named(cluster)
        if not cdir.state_file.is_file():
            known = ", ".join(c.name for c in list_clusters()) or "none"
            named = repr(name) if cluster == name else f"{cluster!r} (the name {name} gives its cluster)"
            raise ClusterNotFound(f"no cluster named {named} (known: {known}); start one with `psctl up SPEC`")
        return cdir
    clusters = list_clusters()
    if not clusters:
        raise ClusterNotFound("no cluster found; start one with `psctl up SPEC`")
    if len(clusters) == 1:
        return clusters[0]
    active = [c for c in clusters if _unfinished(c)]
    if len(active) == 1:
        return active[0]
    names = ", ".join(c.name for c in (active or clusters))
    raise UsageError(f"several clusters exist ({names}); name the one you mean")


def _unfinished(cdir: ClusterDir) -> bool:
    """Whether a cluster has not ended; a damaged one counts (what it is doing is unknown), so that a command
    without a name does not pick another cluster in its place."""
    try:
        return not load_state(cdir.state_file).state.terminal
    except DamagedState:
        return True


def resolve_clusters(names: Sequence[str]) -> list[ClusterDir]:
    """Each named cluster once, in order (a command over the runs of a sweep), every name looked up before the
    caller acts on any; no name: ``resolve_cluster(None)``."""
    by_folder = {cdir.root: cdir for cdir in map(resolve_cluster, names)}  # (two names of one cluster: once)
    return list(by_folder.values()) or [resolve_cluster(None)]


def _cluster_name(name: str) -> str:
    """``name`` itself, or the name a spec file at that path gives its cluster (its ``name:``, else its stem)."""
    path = Path(name)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return name
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None  # `psctl up` would say what is wrong with it; the name is then the default one
    given = data.get("name") if isinstance(data, dict) else None
    return given if isinstance(given, str) and given else path.stem


def role_names(record: ClusterRecord) -> list[str]:
    return [r.name for r in record.roles]


def check_role(record: ClusterRecord, role: str) -> RoleRecord:
    """The role ``role`` names: its name (``worker-2``), its task as the runtime's logs write it (``worker:2``),
    or a kind that only one role has (``chief``); a UsageError that lists the roles otherwise."""
    name = role.replace(":", "-", 1) if role.count(":") == 1 else role
    try:
        return record.role(name)
    except KeyError:
        pass
    of_kind = [r for r in record.roles if r.role == role and not r.retired]
    if len(of_kind) == 1:
        return of_kind[0]
    if of_kind:
        raise UsageError(f"{role!r} names {len(of_kind)} roles of cluster {record.name!r}: "
                         f"{', '.join(r.name for r in of_kind)}; name one")
    raise UsageError(f"no role {role!r} in cluster {record.name!r}; roles are: {', '.join(role_names(record))}")


@dataclass
class RoleLog:
    """A role's log files (one per attempt) on whatever host ran each attempt, read through its runner."""

    role: str
    places: Mapping[str, Placement]
    #: The role's record: which host ran which attempt (``follow`` refreshes it as the role restarts).
    record: RoleRecord

    def read(self, attempt: int, offset: int = 0, size: int = -1) -> bytes | None:
        """The attempt's log from ``offset`` on, at most ``size`` bytes (all if negative); None if it does not
        exist (yet)."""
        place = self.places[self.record.host_of(attempt)]
        try:
            return place.runner.read_file(str(place.dirs.role_log(self.role, attempt)), offset, size)
        except FileNotFoundError:
            return None

    def read_end(self, attempt: int, nbytes: int) -> tuple[bytes, int] | None:
        """The last ``nbytes`` of the attempt's log and its size; None if it does not exist (yet)."""
        place = self.places[self.record.host_of(attempt)]
        try:
            return place.runner.read_end(str(place.dirs.role_log(self.role, attempt)), nbytes)
        except FileNotFoundError:
            return None

    def where(self, attempt: int) -> str:
        """The attempt's log file, as ``host:path`` where it is on an SSH host."""
        place = self.places[self.record.host_of(attempt)]
        path = place.dirs.role_log(self.role, attempt)
        return f"{place.host}:{path}" if place.remote else str(path)

    def still_running(self) -> bool:
        """Whether the role's latest process still runs, asked of its host (for when no supervisor says)."""
        rec = self.record
        if rec.pid is None:
            return False
        try:
            return self.places[rec.host].runner.poll(ProcessHandle(rec.host, rec.pid, rec.create_time)) is None
        except (PsctlError, OSError, KeyError):
            return False

    def close(self) -> None:
        for place in self.places.values():
            place.runner.close()


def role_log(cdir: ClusterDir, record: ClusterRecord, role: str) -> RoleLog:
    rec = check_role(record, role)
    runners = host_runners(record.hosts)
    return RoleLog(rec.name, placements(cdir, record.hosts, runners, cwd=str(cdir.root)), rec)


def cluster_logs(cdir: ClusterDir, record: ClusterRecord) -> list[RoleLog]:
    """The log of every role of the cluster (one runner per host, shared: close one of them to close all)."""
    places = placements(cdir, record.hosts, host_runners(record.hosts), cwd=str(cdir.root))
    return [RoleLog(r.name, places, r) for r in record.roles]


#: A line's time as psctl's runtime writes it (``2026-11-25 10:00:01,000``) or TensorFlow's C++ log
#: (``2026-11-25 10:00:01.123456: I tensorflow/...``), read to the millisecond in one comparable form.
_LINE_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[.,](\d{3})")


def merged_tail(logs: Sequence[RoleLog], n: int) -> tuple[Iterator[str], Callable[[], dict[str, int]],
                                                          list[tuple[str, bool]]]:
    """The last ``n`` lines (all if n <= 0, read as they are iterated) of every role's attempts, merged in time
    order and prefixed ``role: `` (an earlier attempt's ``role (attempt K): ``; a line without a time, such as a
    traceback's, keeps the time of the line above it); where each role's latest log was read up to, once the
    lines are read (to follow them from there); and the logs that are missing (``host:path``, and whether it is
    a role's latest attempt's: an earlier one may never have started)."""
    streams: list[Iterator[tuple[str, int, str]]] = []
    latest_lines: dict[str, LogLines] = {}
    missing: list[tuple[str, bool]] = []
    for log in logs:
        latest = max(log.record.attempt, 1)
        for attempt in range(1, latest + 1):
            try:
                check_log_exists(log, attempt)
            except LogNotFound:
                missing.append((log.where(attempt), attempt == latest))
            lines = tail_log(log, attempt, n)
            prefix = f"{log.role}: " if attempt == latest else f"{log.role} (attempt {attempt}): "
            streams.append(_timed(lines, prefix, len(streams)))
        latest_lines[log.role] = lines
    merged: Iterator[str] = (text for _, _, text in heapq.merge(*streams, key=lambda item: (item[0], item[1])))
    if n > 0:  # (every stream is a tail already: few lines)
        merged = iter(collections.deque(merged, maxlen=n))
    return merged, lambda: {role: lines.offset for role, lines in latest_lines.items()}, missing


def _timed(lines: Iterable[str], prefix: str, order: int) -> Iterator[tuple[str, int, str]]:
    """Each line as (its time, ``order``, ``prefix`` + line), to merge streams by; a line without a time has the
    time of the line above it."""
    stamp = ""
    for line in lines:
        timed = _LINE_TIME.match(line)
        if timed:
            stamp = f"{timed[1]},{timed[2]}"
        yield stamp, order, f"{prefix}{line}"


def follow_all(cdir: ClusterDir, logs: Sequence[RoleLog], offsets: Mapping[str, int]) -> Iterator[str]:
    """Every role's new lines as they are written, prefixed ``role: `` (in the order they are read), across
    restarts; ends when the cluster has finished and all is read."""
    lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()

    def pump(log: RoleLog) -> None:
        try:
            for line in follow(cdir, log, start_attempt=max(log.record.attempt, 1), offset=offsets.get(log.role)):
                lines.put(f"{log.role}: {line}")
        finally:
            lines.put(None)

    for log in logs:
        threading.Thread(target=pump, args=(log,), daemon=True, name=f"psctl-logs-{log.role}").start()
    running = len(logs)
    while running:
        line = lines.get()
        if line is None:
            running -= 1
        else:
            yield line


def check_log_exists(log: RoleLog, attempt: int) -> None:
    """A LogNotFound if the attempt's log is gone (deleted, moved), where it printed nothing and exited 0. A role
    not yet started (its attempt 0) or starting (its agent is about to create the log) has none yet."""
    rec = log.record
    if rec.attempt < 1 or (attempt == rec.attempt and rec.state == RoleState.STARTING):
        return
    if log.read_end(attempt, 0) is None:
        others = f"--attempt 1..{rec.attempt} reads another attempt's; " if rec.attempt > 1 else ""
        raise LogNotFound(f"the log of {rec.name}'s attempt {attempt} is missing: {log.where(attempt)}",
                          hint=f"deleted or moved, or the attempt never started; {others}`psctl events` has its "
                               "state changes and their reasons")


def check_attempt(record: ClusterRecord, role: str, attempt: int | None) -> int:
    """The attempt asked for (default: the latest); a UsageError if the role never had it."""
    rec = check_role(record, role)
    last = max(rec.attempt, 1)
    if attempt is None:
        return last
    if not 1 <= attempt <= last:
        raise UsageError(f"{rec.name} has attempts 1..{last}; --attempt {attempt} does not exist")
    return attempt


def tail_lines(path: Path, n: int) -> Iterable[str]:
    """The last ``n`` lines of a local file (all if n <= 0, read as they are iterated; none if it does not
    exist). Only the end of a long file is read for its last lines."""
    here = LocalRunner()

    def read_end(nbytes: int) -> tuple[bytes, int] | None:
        try:
            return here.read_end(str(path), nbytes)
        except FileNotFoundError:
            return None

    def read(offset: int) -> bytes | None:
        try:
            return here.read_file(str(path), offset, READ_CHUNK)
        except FileNotFoundError:
            return None

    return _last_of(read_end, n) if n > 0 else LogLines(read=read)


def event_text(line: str) -> str | None:
    """One line of events.jsonl as ``psctl events`` shows it; None for a line that is not an event (torn by a
    crash, or not psctl's: skipped, not a traceback)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    when = event.get("time")
    try:
        stamp = time.strftime("%H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "??:??:??"
    except (OverflowError, OSError, ValueError):  # a time out of range
        stamp = "??:??:??"
    reason = f"  {event['reason']}" if event.get("reason") else ""
    return f"{stamp}  {event.get('role', '?')!s:<12} {event.get('from')} -> {event.get('to')}{reason}"


def _last_lines(data: bytes, n: int) -> list[str]:
    lines = _decoded(data)
    return lines[-n:] if n > 0 else lines


class LogLines:
    """Lines of a file to print, and ``offset``: where reading stopped (for a follower to go on from), known once
    they have been iterated. Given ``read`` (the file's bytes from an offset, at most READ_CHUNK of them), the
    file is read a chunk at a time as the lines are iterated: a log of gigabytes is never held whole."""

    def __init__(self, lines: Sequence[str] = (), offset: int = 0, *,
                 read: Callable[[int], bytes | None] | None = None) -> None:
        self._lines, self.offset, self._read = lines, offset, read

    def __iter__(self) -> Iterator[str]:
        if self._read is None:
            yield from self._lines
            return
        offset, pending = 0, b""
        while data := self._read(offset):
            offset += len(data)
            lines, pending = complete_lines(pending, data)
            yield from lines
            self.offset = offset - len(pending)
        if pending:  # a last line without its newline (yet): printed; a follower goes on after it
            yield from _decoded(pending)
        self.offset = offset


def complete_lines(pending: bytes, data: bytes) -> tuple[list[str], bytes]:
    """The lines ``pending + data`` ends (as ``psctl logs`` prints them), and the start of one not ended yet.
    (Cut at a newline byte: a multi-byte character never holds one.)"""
    joined = pending + data
    cut = joined.rfind(b"\n") + 1
    return _decoded(joined[:cut]), joined[cut:]


def _decoded(data: bytes) -> list[str]:
    return data.decode("utf-8", errors="replace").splitlines()


#: ``logs -f`` of a cluster without a supervisor asks this often whether the role's process still runs.
FOLLOW_ASK_EVERY = 2.0

#: ``logs --tail`` reads this much of the log's end first, and four times more while lines are missing.
TAIL_CHUNK = 64 << 10
#: A whole log (``logs`` without ``--tail``, ``-f``) is read this much at a time.
READ_CHUNK = 1 << 20


def tail_log(log: RoleLog, attempt: int, n: int) -> LogLines:
    """The last ``n`` lines (all if n <= 0, read as they are iterated) of the attempt's log, and the offset where
    reading stopped. Only the end of a long log is read for its last lines (it may be on another host)."""
    if n <= 0:
        return LogLines(read=lambda offset: log.read(attempt, offset, READ_CHUNK))
    return _last_of(lambda nbytes: log.read_end(attempt, nbytes), n)


def _last_of(read_end: Callable[[int], tuple[bytes, int] | None], n: int) -> LogLines:
    """The last ``n`` (> 0) lines of a file, given ``read_end`` (its last bytes and its size; None if it does not
    exist), which is asked for more of the end while lines are missing."""
    nbytes = TAIL_CHUNK
    while True:
        found = read_end(nbytes)
        if found is None:
            return LogLines()
        data, size = found
        whole = len(data) >= size
        if not whole:  # the first line is cut: it is not one of the last n unless more is read
            data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
        if whole or data.count(b"\n") > n:
            return LogLines(_last_lines(data, n), size)
        nbytes *= 4


def follow(
    cdir: ClusterDir, log: RoleLog, *, start_attempt: int, offset: int | None = None, poll: float = 0.2
) -> Iterator[str]:
    """Yield new log lines of the role as they are written, from ``offset`` (default: the end), moving on to
    the next attempt's log when the role restarts; ends when the cluster has finished and all is read."""
    attempt = start_attempt
    if offset is None:
        end = log.read_end(attempt, 0)  # its size: nothing of it is read
        offset = end[1] if end is not None else 0
    pending = b""  # (bytes: a character can be cut between two reads)
    asked = float("-inf")
    while True:
        data = log.read(attempt, offset, READ_CHUNK)
        if data:
            offset += len(data)
            lines, pending = complete_lines(pending, data)  # (split as `psctl logs` splits them)
            yield from lines
            continue
        end = log.read_end(attempt, 0)
        if end is not None and end[1] < offset:  # cut short (truncated, rotated in place): from its start again
            offset, pending = 0, b""
            continue
        record = load_state(cdir.state_file)
        log.record = record.role(log.role)  # the next attempt may run on another host
        if log.read_end(attempt + 1, 0) is not None:  # the next attempt has begun (its log exists)
            yield from _decoded(pending)
            pending = b""
            attempt += 1
            offset = 0
            yield f"--- {log.role}: attempt {attempt} ---"
            continue
        ended = record.state.terminal
        if not ended and is_stale(cdir, record) and time.monotonic() - asked >= FOLLOW_ASK_EVERY:
            asked = time.monotonic()  # no supervisor to say when it ends: its process says (over SSH, a command)
            ended = not log.still_running()
        if ended:
            yield from _decoded(pending)
            return
        time.sleep(poll)

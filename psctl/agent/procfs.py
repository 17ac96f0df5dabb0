"""Processes of this host as ``/proc`` shows them: who a pid is (its start time, as psutil's ``create_time``, so
that a pid reused by a later process is told apart), whether it still runs, and what runs below it.

Read directly rather than through psutil: an agent reads one file per process, and on a host of many roles it
does so on every look at an adopted role.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Sequence


@functools.cache
def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        return next(float(line.split()[1]) for line in f if line.startswith(b"btime"))


def _fields(stat: bytes) -> list[bytes]:
    """The fields of a ``/proc/PID/stat`` after the command name (which may hold spaces and parentheses):
    state, parent pid, ..., start ticks at index 19."""
    return stat[stat.rindex(b")") + 2:].split()


def _start_time(fields: Sequence[bytes]) -> float:
    """The start time a process's stat fields give, as psutil's ``create_time``: boot time + ticks / CLK_TCK."""
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _state_and_start(pid: int) -> tuple[str, float] | None:
    """The process's state letter and start time, from one read of ``/proc/PID/stat``; None if it cannot be
    read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = _fields(f.read())
        return fields[0].decode(errors="replace"), _start_time(fields)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def create_time(pid: int) -> float:
    """The process's start time as psutil reports it; 0.0 if unknown."""
    found = _state_and_start(pid)
    return found[1] if found is not None else 0.0


def still_running(pid: int, created: float) -> bool:
    """The process ``pid`` started at ``created`` still runs (not a zombie, not a later process of that pid)."""
    found = _state_and_start(pid)
    return found is not None and found[0] not in ("Z", "X") and abs(found[1] - created) < 0.05


def _children() -> dict[int, list[tuple[int, float]]]:
    """Every process's children with their start times, by parent pid, from one read of each process's stat."""
    children: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = _fields(f.read())
            children[int(fields[1])].append((int(entry.name), _start_time(fields)))
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # (it ended meanwhile)
    return children


def descendants(pid: int) -> dict[int, float]:
    """Every process below ``pid`` now (its children, theirs, ...), with its start time."""
    children = _children()
    found: dict[int, float] = {}
    below = list(children.get(pid, ()))
    while below:
        child, started = below.pop()
        if child not in found:
            found[child] = started
            below.extend(children.get(child, ()))
    return found


def tree_usage(pid: int) -> tuple[float, int] | None:
    """The CPU seconds (user and system) and resident bytes of ``pid`` and every process below it, found
    through the kernel's children lists (no scan of /proc); None if ``pid`` cannot be read."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu, rss, seen = 0.0, 0, set()
    below = [pid]
    while below:
        current = below.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/stat", "rb") as f:
                fields = _fields(f.read())
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            rss += int(fields[21]) * page
            for task in os.scandir(f"/proc/{current}/task"):
                with open(f"{task.path}/children", "rb") as f:
                    below.extend(int(child) for child in f.read().split())
        except (OSError, ValueError, IndexError):
            if current == pid:
                return None
    return cpu, rss

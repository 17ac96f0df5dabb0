"""Processes of this host as ``/proc`` shows them: who a pid is (its start time, as psutil's ``create_time``, so
that a pid reused by a later process is told apart), whether it still runs, and what runs below it.

Read directly rather than through psutil: an agent reads one file per process, and on a host of many roles it
does so on every look at an adopted role.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict


@functools.cache
def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        return next(float(line.split()[1]) for line in f if line.startswith(b"btime"))


def _state_and_start(pid: int) -> tuple[str, float] | None:
    """The process's state letter and start time (as psutil's ``create_time``: boot time + start ticks /
    CLK_TCK), from one read of ``/proc/PID/stat``; None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        fields = stat[stat.rindex(")") + 2:].split()
        return fields[0], _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
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


def _children() -> dict[int, list[int]]:
    """Every process's children, by parent pid, from one pass over ``/proc``."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            parent = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # (it ended meanwhile)
        children[parent].append(int(entry.name))
    return children


def descendants(pid: int) -> dict[int, float]:
    """Every process below ``pid`` now (its children, theirs, ...), with its start time."""
    children = _children()
    found: dict[int, float] = {}
    below = list(children.get(pid, ()))
    while below:
        child = below.pop()
        if child not in found:
            found[child] = create_time(child)
            below.extend(children.get(child, ()))
    return found

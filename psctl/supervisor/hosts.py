"""Which host a role restarts on: hosts that keep failing are benched for a while, and a role whose host is
benched or cannot be reached moves to another host of its pool.

Pure logic on an injected clock (the supervisor passes ``now``), so that it is tested without processes.
Workers and ps move: the chief follows their new addresses, and the workers the ps', through their heartbeat
replies (a moved ps is restored from the latest checkpoint, as a restarted one is). The chief and the evaluator have a
pool only where the spec puts the checkpoints on shared storage (``training.checkpoint.dir``): a moved chief
reads the global step from the ps and carries on, and no role dials either of them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: The roles other roles dial, whose moves they are told of in their heartbeat replies.
DIALED_ROLES = ("ps", "worker")


@dataclass
class _HostRecord:
    failures: collections.deque[float] = field(default_factory=collections.deque)
    benched_until: float | None = None


class HostBench:
    """Counts role failures per host; ``failures`` of them within ``window`` seconds bench the host for
    ``cooloff`` seconds (``failures`` 0: never). A benched host gets no role that can go elsewhere."""

    def __init__(self, *, failures: int, window: float, cooloff: float) -> None:
        self.failures = failures
        self.window = window
        self.cooloff = cooloff
        self._hosts: dict[str, _HostRecord] = collections.defaultdict(_HostRecord)

    def record_failure(self, host: str, now: float) -> bool:
        """A role failed on ``host`` (exited badly or was lost); True if that benched the host just now."""
        if self.failures <= 0 or self.is_benched(host, now):  # failures while benched do not count towards the next
            return False
        record = self._hosts[host]
        record.failures.append(now)
        while record.failures and now - record.failures[0] > self.window:
            record.failures.popleft()
        if len(record.failures) < self.failures:
            return False
        record.benched_until = now + self.cooloff
        record.failures.clear()
        return True

    def is_benched(self, host: str, now: float) -> bool:
        record = self._hosts.get(host)
        return record is not None and record.benched_until is not None and now < record.benched_until

    def benched_until(self, host: str) -> float | None:
        record = self._hosts.get(host)
        return None if record is None else record.benched_until

    def released(self, now: float) -> list[str]:
        """Hosts whose cooling-off has ended since the last call (each reported once)."""
        out = []
        for host, record in self._hosts.items():
            if record.benched_until is not None and now >= record.benched_until:
                record.benched_until = None
                out.append(host)
        return out


@dataclass(frozen=True)
class Occupant:
    """A role of the cluster as placement sees it: where it is and the port it listens on."""

    name: str
    host: str
    port: int


def restart_host(
    name: str,
    current: str,
    port: int,
    pool: Sequence[str],
    occupants: Iterable[Occupant],
    usable: Callable[[str], bool],
) -> str:
    """The host role instance ``name`` (listening on ``port``) should restart on.

    Its current host while that is ``usable`` (reachable and not benched), or when its pool has no other. Else
    the usable host of its pool with the fewest roles of the cluster whose ``port`` no other role already
    uses there (ties: pool order); its current host when there is none.
    """
    if usable(current):
        return current
    others = [o for o in occupants if o.name != name]
    load: Mapping[str, int] = collections.Counter(o.host for o in others)
    candidates = [
        h for h in pool
        if h != current and usable(h) and not any(o.host == h and o.port == port for o in others)
    ]
    if not candidates:
        return current
    return min(candidates, key=lambda h: (load.get(h, 0), pool.index(h)))

"""Fencing a replaced chief: a chief that moved to another host of its pool leaves its old process behind on a
host that was cut off; when that host answers again the old chief would go on scheduling steps and restoring
ps. Every request a chief makes of a ps or a worker carries its incarnation, which the supervisor raises at
each start; a ps or worker refuses one from an older incarnation than the newest it has heard of (from a
request, or from its own heartbeat reply, which names the current chief's) with ABORTED, and the old chief,
told so, stops. The usual fencing token: the old process may still run, but it can no longer act.
"""

from __future__ import annotations

import threading

import grpc

#: Starts the details of the ABORTED status a fenced chief gets.
REPLACED = "chief incarnation"


class ChiefReplaced(Exception):
    """This chief's incarnation was replaced by a newer one: it must stop (its steps are the new chief's)."""


class ChiefFence:
    """The newest chief incarnation a ps or worker has heard of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest = 0

    @property
    def newest(self) -> int:
        return self._newest

    def admit(self, incarnation: int) -> None:
        """Accept a request from chief ``incarnation`` (and remember it if it is the newest), or raise
        ChiefReplaced if a newer chief is known. 0 is no chief's (a worker, a tool, a chief started by hand
        without a launcher): always accepted, never remembered."""
        with self._lock:
            if incarnation == 0:
                return
            if incarnation < self._newest:
                raise ChiefReplaced(f"{REPLACED} {incarnation} was replaced by incarnation {self._newest}")
            self._newest = incarnation

    def check(self, incarnation: int) -> None:
        """``admit`` for a request that relays a chief's incarnation (a worker's push of the chief's step): refused
        if older than the newest known, never remembered (only the chief's own word, or the supervisor's, raises
        the fence: a member that named a huge one would fence every real chief for good)."""
        with self._lock:
            if 0 < incarnation < self._newest:
                raise ChiefReplaced(f"{REPLACED} {incarnation} was replaced by incarnation {self._newest}")

    def learn(self, incarnation: int) -> None:
        """The supervisor says chief ``incarnation`` is the current one."""
        with self._lock:
            self._newest = max(self._newest, incarnation)



def replaced(error: grpc.RpcError) -> ChiefReplaced | None:
    """The ChiefReplaced a refused request means, if ``error`` is that refusal."""
    code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
    if code == grpc.StatusCode.ABORTED and details.startswith(REPLACED):
        return ChiefReplaced(details)
    return None


#: The process's fence (a ps or worker role serves one cluster): its servicers check it, its heartbeat feeds it.
CHIEF_FENCE = ChiefFence()

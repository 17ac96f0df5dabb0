"""Heartbeats from a role to its supervisor: liveness plus progress, at a steady interval.

Best effort by design: a role never depends on its supervisor (if the supervisor is gone, training goes on),
so a failed heartbeat is retried at the next tick and never raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.cluster import ClusterInfo
from psctl.runtime.fencing import CHIEF_FENCE, ChiefFence
from psctl.runtime.metrics import CPU_METRIC
from psctl.runtime.rpc import make_channel

log = logging.getLogger("psctl.heartbeat")


@dataclass
class Progress:
    """What a role reports; updated by the role, read by the heartbeat thread."""

    global_step: int = 0
    local_step: int = 0
    loss: float = float("nan")
    steps_per_second: float = 0.0
    status: str = "starting"
    metrics: dict[str, float] = field(default_factory=dict)


#: The process's current progress; roles update it in place.
PROGRESS = Progress()


class ClusterAddresses:
    """Where the supervisor says each ps and worker is now (heartbeat replies bring it back): a role restarted
    on another host of its pool has a new address. The coordinator and the PS clients subscribe to follow."""

    def __init__(self) -> None:
        # Held while callbacks run, so that a subscriber's replay and the updates reach it in order.
        self._lock = threading.RLock()
        self._known: dict[str, str] = {}
        self._subscribers: list[Callable[[dict[str, str]], None]] = []

    def subscribe(self, callback: Callable[[dict[str, str]], None]) -> Callable[[], None]:
        """Call ``callback({"ps:0": "host:port", "worker:0": ..., ...})`` with every address now (if any are
        known) and whenever one differs from the last reply; returns the function that unsubscribes."""
        with self._lock:
            self._subscribers.append(callback)
            if self._known:
                _deliver(callback, self._known)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def update(self, addresses: dict[str, str]) -> None:
        """A heartbeat reply's map; a callback that fails is logged and given the map again with the next."""
        with self._lock:
            if addresses == self._known:
                return
            if all([_deliver(callback, addresses) for callback in self._subscribers]):
                self._known = dict(addresses)

    def known(self) -> dict[str, str]:
        with self._lock:
            return dict(self._known)


def _deliver(callback: Callable[[dict[str, str]], None], addresses: dict[str, str]) -> bool:
    try:
        callback(dict(addresses))
        return True
    except Exception:  # the heartbeat thread must go on (a role that stops heartbeating is declared lost)
        log.exception("following the cluster's new addresses failed; trying again with the next heartbeat")
        return False


def tasks_of(job: str, addresses: Mapping[str, str]) -> dict[int, str]:
    """``{index: address}`` of one job's tasks in an address map such as ``{"ps:0": "h:7110", ...}``."""
    out = {}
    for task, address in addresses.items():
        name, _, index = task.partition(":")
        if name == job and index.isdigit():
            out[int(index)] = address
    return out


#: Filled from this role's heartbeat replies.
ADDRESSES = ClusterAddresses()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _rss() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Heartbeater:
    def __init__(
        self,
        info: ClusterInfo,
        *,
        interval: float | None = None,
        progress: Progress = PROGRESS,
        on_fenced: Callable[[], None] | None = None,
        addresses: ClusterAddresses = ADDRESSES,
        chief_fence: ChiefFence = CHIEF_FENCE,
    ) -> None:
        self.info = info
        # the launcher passes supervision.heartbeat_interval in the environment
        self.interval = interval or float(os.environ.get("PSCTL_HEARTBEAT_INTERVAL", "1.0"))
        self.progress = progress
        self.on_fenced = on_fenced or (lambda: os._exit(0))
        self.addresses = addresses
        self.chief_fence = chief_fence
        self._stop = threading.Event()
        self._final = False
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, *, final_within: float = 0.0) -> None:
        """Stop beating; with ``final_within`` > 0, first send one last beat with the progress as it is now (a role's
        final step and metrics: an evaluator's last evaluation), waiting at most that long for it."""
        self._final = final_within > 0
        self._stop.set()
        if self._final and self._thread.is_alive():
            self._thread.join(final_within)

    def _run(self) -> None:
        assert self.info.supervisor is not None
        channel = make_channel(self.info.supervisor, self.info.tls)
        stub = pb_grpc.SupervisorStub(channel)
        cpu_before, at_before = _cpu_seconds(), time.monotonic()
        while True:
            stopping = self._stop.is_set()
            if stopping and not self._final:
                break
            p = self.progress
            cpu_now, at_now = _cpu_seconds(), time.monotonic()
            cpu = (cpu_now - cpu_before) / max(1e-6, at_now - at_before)  # cores this process used lately
            cpu_before, at_before = cpu_now, at_now
            request = pb.HeartbeatRequest(
                task=self.info.task,
                incarnation=self.info.incarnation,
                pid=os.getpid(),
                global_step=p.global_step,
                local_step=p.local_step,
                loss=p.loss,
                steps_per_second=p.steps_per_second,
                rss_bytes=_rss(),
                status=p.status,
                metrics={**p.metrics, CPU_METRIC: cpu},
            )
            try:
                reply = stub.Heartbeat(request, timeout=max(1.0, self.interval))
                if reply.fenced and not stopping:  # (a role on its way out exits with its own code)
                    log.error("%s incarnation %d was replaced: exiting", self.info.task, self.info.incarnation)
                    self.on_fenced()
                if reply.addresses:
                    self.addresses.update(dict(reply.addresses))
                self.chief_fence.learn(reply.chief_incarnation)
            except grpc.RpcError:
                pass
            if stopping:
                break
            self._stop.wait(self.interval)
        channel.close()

"""The coordinator: TensorFlow's ClusterCoordinator API (schedule / join / done / fetch) over gRPC.

One thread per worker takes closures from a shared queue and runs them one at a time on its worker.

What differs from TensorFlow, on purpose:
- A training closure is bound to a data position (shard, batch index) the first time a worker takes it, and
  keeps that binding through retries. A step re-run elsewhere after its worker died consumes exactly the batch
  the dead worker would have; the shard's cursor is never rewound, so nothing is repeated or skipped.
- A closure keeps its step id through retries; the PS applies a step id at most once, so a retried closure
  never double-applies (TensorFlow's closures run at least once and can).

Worker failures (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, a fenced worker) put the closure back at the
front of the queue and mark the worker dead; its thread probes it until a process answers again (the same
address, usually a new incarnation) and then gives it work again. A lost PS pauses the coordinator: no new
closure starts, and once nothing is in flight ``join()`` raises PsFailure so the chief can restore the PS and
call ``recover()``. Any other error is not retryable: queued closures are cancelled and ``join()`` raises it,
naming the worker and the cause.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.fencing import replaced
from psctl.runtime.rpc import close_later, make_channel

log = logging.getLogger("psctl.coordinator")

#: How gRPC words an RPC that failed before any connection carried it (the channel could not connect).
NEVER_SENT = "failed to connect to all addresses"
#: ``step_timeout`` that sets a training step's deadline from the steps seen: this many times the slowest, and at
#: least this many seconds (a step hung in a program held the chief's checkpoints and end, and so the cluster).
#: The floor is twice a worker's own timeout for a ps call (PsClient's 60 s): a ps that hangs is the worker's to
#: report ("ps unavailable"), not the worker's hang.
AUTO = "auto"
AUTO_DEADLINE_FACTOR = 20.0
AUTO_DEADLINE_FLOOR = 120.0
#: The longest a call's deadline grows to, doubled per expiry (the spec's longest duration).
MAX_DEADLINE = 7 * 24 * 3600.0
_WORKER_LOST = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.PERMISSION_DENIED,  # a fenced zombie: its replacement will answer at the same address
}
#: Starts the details of the RESOURCE_EXHAUSTED a worker that ran out of memory answers (it leaves, to be
#: restarted: a lost worker); any other RESOURCE_EXHAUSTED (a message too large) is the step's own error.
OUT_OF_MEMORY = "out of memory:"


class StepError(Exception):
    """A closure failed in a way that retrying elsewhere cannot fix."""

    def __init__(self, task: str, cause: str) -> None:
        super().__init__(f"{task}: {cause}")
        self.task = task
        self.cause = cause


class CancelledError(Exception):
    """The closure was cancelled because another one failed; schedule it again."""


class PsFailure(Exception):
    """A PS was lost: the coordinator has paused, and the chief must restore the PS before resuming."""


class RemoteValue:
    """The future result of a scheduled closure."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError("the closure has not finished")
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class Closure:
    function: str
    step_id: int
    remote: RemoteValue
    shard: int | None = None
    position: int | None = None
    sync_step: int | None = None
    #: Consecutive training steps in this closure: step ids step_id .. step_id + steps - 1, batches from
    #: position on (each worker's cursor moves on by as many).
    steps: int = 1
    attempts: int = 0
    tried_on: list[int] = field(default_factory=list)
    #: Times it ran past its deadline: each doubles the next one (steps that grew slower than the deadline
    #: allows are given the time, not retried without end).
    expired: int = 0


@dataclass
class WorkerState:
    index: int
    address: str
    alive: bool = True
    incarnation: int | None = None
    steps: int = 0
    failures: int = 0
    #: The synchronous round (global step) of the last closure this worker took.
    last_round: int | None = None
    #: Scaled away (psctl scale): its thread ends once its step is done; it is never given work again.
    removed: bool = False
    #: The ps layout (ClusterCoordinator.layout) this process has been sent; -1: none yet.
    layout_sent: int = -1


ResultCallback = Callable[[Closure, pb.StepResponse, int], None]

#: A worker reads its own data shard (index modulo the shard count) unless that shard is this many batches
#: ahead of the least-read one: then it reads that one. Shards stay evenly read whatever the worker count.
SHARD_SLACK = 16


class ClusterCoordinator:
    def __init__(
        self,
        workers: Sequence[str],
        *,
        tls: TlsFiles | None = None,
        step_id_base: int = 0,
        cursors: dict[int, int] | None = None,
        step_timeout: float | str | None = AUTO,
        worker_wait: float = 3600.0,
        probe_interval: float = 0.5,
        on_result: ResultCallback | None = None,
        on_worker_event: Callable[[str], None] | None = None,
        staleness: int | None = None,
        one_per_round: bool = False,
        steps_in_flight: int = 1,
        chief_incarnation: int = 0,
        num_shards: int | None = None,
        ps_addresses: Sequence[str] = (),
    ) -> None:
        """``steps_in_flight``: steps each worker is given at once (pipelined asynchronous training: 2, so that
        a worker computes its next step while its last one's push travels; 1 in every other mode).
        ``chief_incarnation``: stamped on every probe and step; a worker that knows a newer chief refuses them,
        and this coordinator then fails with ChiefReplaced (see fencing).
        ``num_shards``: the training data's shards (default: one per worker); ``ps_addresses``: the chief's ps
        layout, sent with every step (a worker whose layout differs takes this one first).
        ``step_timeout``: seconds a step may take (a call of several: each of them) before it goes to another
        worker; None: no deadline; AUTO: a training step's deadline is AUTO_DEADLINE_FACTOR times the slowest
        step seen yet, at least AUTO_DEADLINE_FLOOR (none before the first has ended)."""
        self.chief_incarnation = chief_incarnation
        self.num_shards = num_shards or len(workers)
        self.ps_addresses = list(ps_addresses)
        #: Bumped with every new ps layout: a step carries the layout only to a worker process not yet sent it.
        self.layout = 0
        # Every worker is probed before its first step: its incarnation is known from the start (so a restart
        # is recognised), and one still starting is waited for rather than counted as lost.
        self.workers = [WorkerState(i, a, alive=False) for i, a in enumerate(workers)]
        self._tls = tls
        self._channels = [make_channel(a, tls) for a in workers]
        self._stubs = [pb_grpc.WorkerStub(c) for c in self._channels]
        self._next_step_id = step_id_base
        self.cursors: dict[int, int] = {i: 0 for i in range(self.num_shards)}
        self.cursors.update(cursors or {})
        self.step_timeout = step_timeout
        #: The slowest training step yet, in seconds (a call's time over its steps, from when it was sent).
        self.slowest_step: float | None = None
        self.worker_wait = worker_wait
        self.probe_interval = probe_interval
        self.on_result = on_result
        self.on_worker_event = on_worker_event or (lambda message: log.warning("%s", message))
        self.retries = 0
        #: Steps a preempted worker handed back before running them (not retries: nothing was recomputed).
        self.handed_back = 0
        #: Bounded staleness: a worker may start a step only while it is at most this many steps ahead of
        #: the slowest live worker (None: no bound).
        self.staleness = staleness
        #: Synchronous mode counting distinct replicas: a worker takes at most one closure of a round, so a
        #: fast worker cannot take the closure a slower one needs to contribute its replica.
        self.one_per_round = one_per_round
        self.max_observed_lag = 0
        #: Sent with every step; changes when the PS variables may have been replaced wholesale (recover(), or
        #: another coordinator: a new chief), so that workers reuse the variables a push brought back only
        #: while they are still the PS's.
        self.params_epoch = 1 + secrets.randbits(62)
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self.ps_failed = threading.Event()
        self._ps_failure = ""
        if steps_in_flight < 1 or (steps_in_flight > 1 and (one_per_round or staleness is not None)):
            raise ValueError("more than one step in flight per worker is for asynchronous training only")
        self.steps_in_flight = steps_in_flight
        self._threads: list[threading.Thread] = []
        for worker in self.workers:
            self._start_threads(worker)

    def _start_threads(self, worker: WorkerState) -> None:
        for k in range(self.steps_in_flight):
            thread = threading.Thread(target=self._run_worker, args=(worker,), name=f"coord-worker-{worker.index}-{k}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    # -- TensorFlow's API ---------------------------------------------------------------------------------
    def schedule(
        self,
        function: str = "train",
        *,
        shard: int | None = None,
        position: int | None = None,
        sync_step: int | None = None,
        steps: int = 1,
    ) -> RemoteValue:
        """Queue a step (``steps`` > 1: that many consecutive asynchronous training steps, run in one call);
        returns at once. The data position is bound when a worker takes it, unless given."""
        if steps < 1 or (steps > 1 and (function != "train" or sync_step is not None)):
            raise ValueError("several steps in one closure are for asynchronous training steps only")
        with self._cond:
            if self._error is not None:
                raise self._error
            closure = Closure(function, self._next_step_id + 1, RemoteValue(), shard, position, sync_step, steps)
            self._next_step_id += steps
            self._queue.append(closure)
            self._cond.notify_all()
            return closure.remote

    def done(self) -> bool:
        """True when nothing is queued or running; raises (and clears) a non-retryable error."""
        with self._cond:
            self._raise_error()
            return not self._queue and self._inflight == 0

    def join(self, timeout: float | None = None, *, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait until nothing is queued or running (True), or ``give_up()`` says to stop waiting (False: the
        chief is stopping, and so are the workers that would take what is queued)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._inflight:
                if self._error is not None:
                    break
                if give_up():
                    return False
                self._raise_ps_failure()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{len(self._queue)} queued and {self._inflight} running steps remain")
                self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
            self._raise_error()
            return True

    def wait_for_workers(self, timeout: float) -> int:
        """Wait (bounded) until every worker answers, so the first steps are not all taken by the quickest
        to start; returns how many answered. Training starts anyway after ``timeout``. A worker scaled away
        meanwhile (psctl scale) is not waited for: it never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping.is_set():
            if all(w.alive or w.removed for w in self.workers):
                break
            self._stopping.wait(0.05)
        return sum(w.alive for w in self.workers)

    def check(self) -> None:
        """Raise a pending non-retryable error, or PsFailure once a lost PS has paused everything."""
        with self._cond:
            self._raise_error()
            self._raise_ps_failure()

    def settle(self, timeout: float) -> int:
        """Stopping: cancel what is queued (and what workers hand back meanwhile) and wait up to ``timeout``
        seconds for the closures running; returns how many still run."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._queue:
                    self._queue.popleft().remote._fail(CancelledError("cancelled: the chief is stopping"))
                remaining = deadline - time.monotonic()
                if self._inflight == 0 or remaining <= 0:
                    return self._inflight
                self._cond.wait(min(0.2, remaining))

    def in_flight(self) -> int:
        """Closures running on workers now (a queued one has touched nothing)."""
        with self._cond:
            return self._inflight

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._inflight

    def wait_below(self, limit: int, *, give_up: Callable[[], bool] = lambda: False) -> None:
        """Block until fewer than ``limit`` closures are pending (keeps the queue short), an error, or
        ``give_up()`` (the chief is stopping: its workers too, so the queue may never shrink)."""
        with self._cond:
            while len(self._queue) + self._inflight >= limit and self._error is None and not give_up():
                self._raise_ps_failure()
                self._cond.wait(timeout=0.2)
            self._raise_error()

    @staticmethod
    def fetch(values: Any) -> Any:
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, (list, tuple)):
            return type(values)(ClusterCoordinator.fetch(v) for v in values)
        return values

    def tell_training_over(self, timeout: float = 2.0) -> None:
        """Tell every worker that training is over (no step comes any more): one stopped from now on goes at
        once. Best effort: a worker that does not hear it only waits a moment longer when stopped."""
        self._tell_workers(pb.PingRequest(chief_incarnation=self.chief_incarnation, training_over=True), timeout)

    def _tell_workers(self, request: pb.PingRequest, timeout: float) -> None:
        with self._cond:
            stubs = [self._stubs[w.index] for w in self.workers if not w.removed]
        for call in [stub.Ping.future(request, timeout=timeout) for stub in stubs]:
            try:
                call.result()
            except grpc.RpcError:
                continue

    def shutdown(self, *, tell_stopped: bool = False) -> None:
        """Stop scheduling; ``tell_stopped``: the chief stops before the end, and once no step is being sent any
        more, each worker hears that none will come (one stopped with it then goes at once)."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if tell_stopped:
            self._tell_workers(pb.PingRequest(chief_incarnation=self.chief_incarnation, feeding_stopped=True), 1.0)
        for channel in self._channels:
            channel.close()

    def active_workers(self) -> int:
        """Workers not scaled away (alive or expected back)."""
        with self._cond:
            return sum(not w.removed for w in self.workers)

    def live_workers(self) -> int:
        """Workers answering now (not lost, not restarting, not scaled away)."""
        with self._cond:
            return sum(w.alive and not w.removed for w in self.workers)

    def set_workers(self, addresses: Mapping[int, str]) -> None:
        """The workers are now exactly ``{index: address}`` (psctl scale, or a move): a new index gets a
        worker (probed before its first step), a missing one is removed once its step is done (a removed
        worker drains: what it refuses is handed to the others, not retried), a changed address is followed."""
        added, removed = [], []
        with self._cond:
            for index in sorted(addresses):
                if index < len(self.workers) and not self.workers[index].removed:
                    continue
                worker = WorkerState(index, addresses[index], alive=False)
                channel = make_channel(worker.address, self._tls)
                if index < len(self.workers):
                    close_later(self._channels[index])
                    self.workers[index], self._channels[index] = worker, channel
                    self._stubs[index] = pb_grpc.WorkerStub(channel)
                else:
                    while len(self.workers) < index:  # never happens with psctl's contiguous indexes
                        self.workers.append(WorkerState(len(self.workers), "", alive=False, removed=True))
                        self._channels.append(channel)
                        self._stubs.append(pb_grpc.WorkerStub(channel))
                    self.workers.append(worker)
                    self._channels.append(channel)
                    self._stubs.append(pb_grpc.WorkerStub(channel))
                added.append(worker)
            for worker in self.workers:
                if worker.index not in addresses and not worker.removed:
                    worker.removed, worker.alive = True, False
                    removed.append(worker.index)
            self._cond.notify_all()
        for worker in added:
            self.on_worker_event(f"worker:{worker.index} joins at {worker.address}")
            self._start_threads(worker)
        for index in removed:
            self.on_worker_event(f"worker:{index} leaves (scaled down): it gets no more steps")
        for index, address in addresses.items():
            self.set_worker_address(index, address)

    def set_ps_addresses(self, addresses: Sequence[str]) -> None:
        """The ps layout every later step carries (after the chief resharded the variables onto it)."""
        with self._cond:
            self.ps_addresses = list(addresses)
            self.layout += 1

    def set_worker_address(self, index: int, address: str) -> None:
        """Worker ``index`` now listens at ``address`` (its supervisor restarted it on another host of its pool).

        A step still in flight at the old address fails there (keepalive, or the old process's refusal) and goes
        back on the queue; the worker is probed at its new address before it gets work again.
        """
        with self._cond:
            worker = self.workers[index]
            if worker.address == address:
                return
            old = self._channels[index]
            moved = f"worker:{index} moved from {worker.address} to {address}"
            worker.address = address
            self._channels[index] = make_channel(address, self._tls)
            self._stubs[index] = pb_grpc.WorkerStub(self._channels[index])
            worker.alive = False
        close_later(old)
        self.on_worker_event(moved)

    def recover(self, cursors: dict[int, int]) -> int:
        """After the chief restored the PS: drop every queued closure (their data positions are from before
        the restore), move each shard's cursor to the restored position, and resume. Returns how many
        closures were dropped."""
        with self._cond:
            dropped = len(self._queue)
            while self._queue:
                self._queue.popleft().remote._fail(CancelledError("cancelled by a PS restore"))
            self.cursors = {i: 0 for i in range(self.num_shards)}
            self.cursors.update(cursors)
            self.params_epoch += 1
            self.ps_failed.clear()
            self._cond.notify_all()
            return dropped

    # -- internals ------------------------------------------------------------------------------------
    def _raise_ps_failure(self) -> None:
        if self.ps_failed.is_set() and self._inflight == 0:
            raise PsFailure(self._ps_failure)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _fail_all(self, error: BaseException) -> None:
        """Record a non-retryable error and cancel everything queued (caller holds the lock)."""
        self._error = error
        while self._queue:
            self._queue.popleft().remote._fail(CancelledError("cancelled, please reschedule"))
        self._cond.notify_all()

    def drop_queued(self) -> int:
        """Cancel closures not yet started (a synchronous step finished without them)."""
        with self._cond:
            dropped = len(self._queue)
            while self._queue:
                self._queue.popleft().remote._fail(CancelledError("not needed: its step finished without it"))
            self._cond.notify_all()
            return dropped

    def _lag(self, worker: WorkerState) -> int:
        alive = [w.steps for w in self.workers if w.alive and not w.removed]
        return worker.steps - min(alive, default=worker.steps)

    def _shard_for(self, worker: WorkerState) -> int:
        """The data shard of this worker's next step (caller holds the lock): see SHARD_SLACK."""
        own = worker.index % self.num_shards
        least = min(self.cursors, key=lambda shard: (self.cursors[shard], shard))
        return least if self.cursors[own] - self.cursors[least] > SHARD_SLACK else own

    def _next_for(self, worker: WorkerState) -> Closure | None:
        """The first queued closure this worker may run now (caller holds the lock)."""
        if self.ps_failed.is_set():
            return None
        if self.staleness is not None and self._lag(worker) > self.staleness:
            return None
        for closure in self._queue:
            if not (self.one_per_round and closure.sync_step is not None and closure.sync_step == worker.last_round):
                return closure
        return None

    def _take(self, worker: WorkerState) -> Closure | None:
        with self._cond:
            closure = None
            while not self._stopping.is_set() and not worker.removed:
                closure = self._next_for(worker)
                if closure is not None:
                    break
                self._cond.wait(timeout=0.5)
            if self._stopping.is_set() or worker.removed or closure is None:
                return None
            self._queue.remove(closure)
            if closure.sync_step is not None:
                worker.last_round = closure.sync_step
            self.max_observed_lag = max(self.max_observed_lag, self._lag(worker))
            self._inflight += 1
            return closure

    def _finish(self, closure: Closure, *, requeue: bool = False, retry: bool = True,
                error: BaseException | None = None) -> None:
        """A closure is done with, or goes back on the queue (``retry``: counted as a retry, for it may have
        run in part)."""
        with self._cond:
            self._inflight -= 1
            if requeue:
                self.retries += retry
                self._queue.appendleft(closure)
            if error is not None:
                closure.remote._fail(error)
                if self._error is None:
                    self._fail_all(error)
            self._cond.notify_all()

    def _probe(self, worker: WorkerState) -> bool:
        try:
            reply = self._stubs[worker.index].Ping(pb.PingRequest(chief_incarnation=self.chief_incarnation),
                                                   timeout=max(1.0, self.probe_interval * 2))
        except grpc.RpcError:
            return False
        if worker.incarnation is not None and reply.incarnation != worker.incarnation:
            self.on_worker_event(f"worker:{worker.index} is back as a new process (incarnation {reply.incarnation})")
        if reply.incarnation != worker.incarnation:
            worker.layout_sent = -1  # a new process: it learns the layout again with its next step
        worker.incarnation = reply.incarnation
        return True

    def _wait_for_worker(self, worker: WorkerState) -> bool:
        deadline = time.monotonic() + self.worker_wait
        while not self._stopping.is_set() and not worker.removed and time.monotonic() < deadline:
            if self._probe(worker):
                worker.alive = True
                return True
            self._stopping.wait(self.probe_interval)
        return False

    def _run_worker(self, worker: WorkerState) -> None:
        try:
            self._serve_worker(worker)
        except Exception as exc:  # a bug here must fail the run loudly, not leave join() waiting forever
            log.exception("coordinator thread for worker:%d failed", worker.index)
            with self._cond:
                if self._error is None:
                    self._fail_all(StepError("chief", f"coordinator error: {type(exc).__name__}: {exc}"))

    def _serve_worker(self, worker: WorkerState) -> None:
        while not self._stopping.is_set() and not worker.removed:
            if not worker.alive and not self._wait_for_worker(worker):
                if not self._stopping.is_set() and not worker.removed:
                    self.on_worker_event(f"worker:{worker.index} did not come back within {self.worker_wait:.0f}s")
                return
            closure = self._take(worker)
            if closure is None:
                return
            if not worker.alive:  # lost or preempted (said to another of its threads) meanwhile: never sent
                self._finish(closure, requeue=True, retry=False)
                continue
            if closure.function == "train" and closure.shard is None:
                with self._cond:
                    closure.shard = self._shard_for(worker)
                    closure.position = self.cursors[closure.shard]
                    self.cursors[closure.shard] += closure.steps
            closure.attempts += 1
            closure.tried_on.append(worker.index)
            request = pb.StepRequest(
                step_id=closure.step_id,
                shard=closure.shard if closure.shard is not None else worker.index,
                position=closure.position or 0,
                function=closure.function,
                sync_step=0 if closure.sync_step is None else closure.sync_step + 1,
                params_epoch=self.params_epoch,
                steps=closure.steps,
                chief_incarnation=self.chief_incarnation,
                ps_addresses=self.ps_addresses if worker.layout_sent != self.layout else (),
            )
            layout = self.layout
            sent, deadline = time.monotonic(), self._deadline(closure)
            try:
                response = self._stubs[worker.index].RunStep(request, timeout=deadline)
            except grpc.RpcError as exc:
                self._on_rpc_error(worker, closure, exc, deadline)
                continue
            with self._cond:
                if closure.function == "train":
                    took = (time.monotonic() - sent) / max(1, closure.steps)
                    self.slowest_step = max(took, self.slowest_step or 0.0)
                worker.steps += closure.steps
                worker.layout_sent = layout
                self._cond.notify_all()  # a slow worker's progress may unblock workers held by the bound
            if self.on_result is not None:
                self.on_result(closure, response, worker.index)
            closure.remote._set(response)
            self._finish(closure)

    def _deadline(self, closure: Closure) -> float | None:
        """The call's timeout: the step timeout for each of its steps (see ``__init__``)."""
        if self.step_timeout != AUTO:
            each = float(self.step_timeout or 0.0)
        elif closure.function != "train" or self.slowest_step is None:
            return None  # (an evaluation is its own length; the first steps load data, connect, compile)
        else:
            each = max(AUTO_DEADLINE_FLOOR, AUTO_DEADLINE_FACTOR * self.slowest_step)
        # (doubled per expiry, up to a week: gRPC's timeout and the clock's arithmetic overflow far beyond)
        return min(each * closure.steps * 2.0 ** min(closure.expired, 64), MAX_DEADLINE) if each else None

    def _on_rpc_error(self, worker: WorkerState, closure: Closure, exc: grpc.RpcError,
                      deadline: float | None = None) -> None:
        code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        refused = replaced(exc)
        if refused is not None:  # a newer chief runs: this one must stop, and its step is not retried
            self._finish(closure, error=refused)
            return
        if code == grpc.StatusCode.UNAVAILABLE and details.startswith("preempted:"):
            worker.alive = False  # until its successor answers; the step never ran there: not a retry
            self.handed_back += 1
            self.on_worker_event(f"worker:{worker.index} preempted: step {closure.step_id} goes to another worker")
            self._finish(closure, requeue=True, retry=False)
            return
        if code in _WORKER_LOST or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(OUT_OF_MEMORY)):
            worker.alive = False
            worker.failures += 1
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # hung in the program? (the worker leaves by itself
                # once a step of its runs past the deadline: psctl.runtime.worker, and is restarted)
                closure.expired += 1
                self.on_worker_event(
                    f"worker:{worker.index}: step {closure.step_id} ran past its deadline of "
                    f"{deadline or 0:.3g}s (hung, or training.step_timeout shorter than its steps?); it goes back "
                    "on the queue")
            else:
                self.on_worker_event(
                    f"worker:{worker.index} lost ({code.name}: {details.strip()[:200]}); "
                    f"step {closure.step_id} goes back on the queue"
                )
            # no connection, so the step was never sent (a preempted worker that already left): not a retry
            never_sent = code == grpc.StatusCode.UNAVAILABLE and NEVER_SENT in details
            self._finish(closure, requeue=True, retry=not never_sent)
            return
        if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("ps unavailable"):
            with self._cond:
                if not self.ps_failed.is_set():
                    self._ps_failure = details
                    self.ps_failed.set()
                    self.on_worker_event(f"{details}; pausing training")
            self._finish(closure, requeue=True)
            return
        task = f"worker:{worker.index}"
        # a program error names its worker already ("worker:0: program error: ValueError: ..."): said once
        program_error = code == grpc.StatusCode.INTERNAL and details.startswith(f"{task}: ")
        cause = details.removeprefix(f"{task}: ") if program_error else f"{code.name}: {details}"
        self._finish(closure, error=StepError(task, cause))

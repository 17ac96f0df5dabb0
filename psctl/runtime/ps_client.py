"""Talking to every PS at once: one pull and one push rpc per PS per step, all in flight together.

Arrays travel in frames (psctl.runtime.wire) over the PS's framed rpcs: small payloads as one unary message
(lowest latency), large ones streamed in chunks.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import limits, wire
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.fencing import ChiefReplaced, replaced
from psctl.runtime.heartbeat import tasks_of
from psctl.runtime.rpc import REPLACED_CHANNEL_GRACE, close_later, make_channel
from psctl.runtime.sessions import Exchange, SessionEnded, SessionPool
from psctl.runtime.wire import Entry

log = logging.getLogger("psctl.ps_client")


class PsUnavailable(Exception):
    """A PS could not be reached; names which one."""

    def __init__(self, ps: int, address: str, detail: str) -> None:
        super().__init__(f"ps:{ps} at {address} is unavailable: {detail}")
        self.ps = ps


@dataclass(frozen=True)
class PushHeader:
    step_id: int
    task: str
    incarnation: int
    #: Each PS's global step when this step's parameters were pulled from it (synchronous modes).
    local_steps: Mapping[int, int] | None = None
    shard: int = -1
    position: int = -1
    #: The chief whose step this is (fenced on the PS; 0: not known).
    chief_incarnation: int = 0


_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)

#: One rpc to one PS: a unary rpc (or its sessions) with its request, or a function that makes a streaming call
#: (a thread each).
Call = tuple[grpc.UnaryUnaryMultiCallable | SessionPool, bytes] | Callable[[], Any]


class FramedStub:
    """The framed rpcs of one PS, bytes in and bytes out: psctl.runtime.wire writes and reads the frames.
    With ``sessions``, one-message pulls and pushes go over sessions (psctl.runtime.sessions)."""

    def __init__(self, channel: grpc.Channel, *, sessions: bool = False) -> None:
        def rpc(name: str) -> grpc.UnaryUnaryMultiCallable | SessionPool:
            unary = channel.unary_unary(f"/{wire.PS_SERVICE}/{name}")
            return SessionPool(channel.stream_stream(f"/{wire.PS_SERVICE}/{name}Session"), unary) if sessions else unary

        self.pull = rpc("PullFramed")
        self.pull_stream = channel.unary_stream(f"/{wire.PS_SERVICE}/PullFramedStream")
        self.push = rpc("PushFramed")
        self.push_stream = channel.stream_unary(f"/{wire.PS_SERVICE}/PushFramedStream")
        self.assign_stream = channel.stream_unary(f"/{wire.PS_SERVICE}/AssignFramedStream")

    def close(self) -> None:
        """Close its sessions (before its channel)."""
        for rpc in (self.pull, self.push):
            if isinstance(rpc, SessionPool):
                rpc.close()


def _push_reply(frame: bytes) -> tuple[pb.PushResponse, list[Entry]]:
    response, entries = wire.read_frame(frame, pb.PushResponse)
    del response.entries[:]  # they are the entries returned beside it
    return response, entries


def _apart(
    replies: Mapping[int, tuple[pb.PushResponse, list[Entry]]],
) -> tuple[dict[int, pb.PushResponse], dict[int, list[Entry]]]:
    """Each PS's push response, and the entries it brought back."""
    return {ps: r for ps, (r, _) in replies.items()}, {ps: e for ps, (_, e) in replies.items()}


def _all_or_raise(guard: Callable[[int, Callable[[], Any]], Any], runs: Sequence[tuple[int, Callable[[], Any]]],
                  *, wait_all: bool) -> dict[int, Any]:
    """Every ps's result (``guard(ps, run)``). A worker's client raises the first failure at once; a chief's
    (``wait_all``) waits for every answer and raises ChiefReplaced before any other failure: a replaced chief
    must stop, not retry a ps that is merely down (only chief requests are fenced)."""
    out: dict[int, Any] = {}
    errors: list[Exception] = []
    for ps, run in runs:
        try:
            out[ps] = guard(ps, run)
        except Exception as exc:
            if not wait_all:
                raise
            errors.append(exc)
    if errors:
        raise next((e for e in errors if isinstance(e, ChiefReplaced)), errors[0])
    return out


#: The synchronous training's counters a PS reports (StateResponse) and a restore hands back (AssignRequest), by
#: their names in ``result.json``'s ``sync``.
SYNC_COUNTERS = ("gradients_applied", "stale_dropped", "timed_out_steps")


def sync_counters(state: pb.StateResponse) -> dict[str, int]:
    """A PS's synchronous training counters, by the names of ``SYNC_COUNTERS``."""
    return {"gradients_applied": state.sync_gradients_applied, "stale_dropped": state.stale_dropped,
            "timed_out_steps": state.timed_out_steps}

def new_model_id() -> int:
    """The id of a model every PS is given at once (an Init or a restore of all of them): PS left holding
    different ids hold parts of different models, one such call cut short (see InitResponse.model_id)."""
    return secrets.randbits(64) or 1


class PsClient:
    def __init__(self, addresses: Sequence[str], *, tls: TlsFiles | None = None, timeout: float = 60.0,
                 chief_incarnation: int = 0, sessions: bool = False) -> None:
        """``chief_incarnation``: a chief's client stamps it on Init, Assign and SyncFlush (see fencing).
        ``sessions``: one-message pulls and pushes over sessions (a worker's: it makes them every step)."""
        self.addresses = list(addresses)
        self.timeout = timeout
        self.chief_incarnation = chief_incarnation
        self._tls = tls
        self._sessions = sessions
        self._lock = threading.Lock()
        self._channels = [make_channel(a, tls) for a in self.addresses]
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        self._framed = [FramedStub(c, sessions=sessions) for c in self._channels]
        # Streaming calls need a thread each to be issued in parallel; unary calls use grpc futures.
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.addresses)), thread_name_prefix="ps-stream")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for framed in self._framed:
            framed.close()
        for channel in self._channels:
            channel.close()

    def close_later(self) -> None:
        """Close once no call can still be starting on it (a client replaced by another ps layout)."""
        timer = threading.Timer(REPLACED_CHANNEL_GRACE, self.close)
        timer.daemon = True
        timer.start()

    def set_address(self, ps: int, address: str) -> None:
        """PS ``ps`` now listens at ``address`` (its supervisor restarted it on another host of its pool): later
        calls go there; calls in flight to the old address fail as for a lost PS."""
        with self._lock:
            if self.addresses[ps] == address:
                return
            log.warning("ps:%d moved from %s to %s", ps, self.addresses[ps], address)
            old, old_framed = self._channels[ps], self._framed[ps]
            channel = make_channel(address, self._tls)
            self.addresses[ps] = address
            self._channels[ps] = channel
            self.stubs[ps] = pb_grpc.ParameterServerStub(channel)
            self._framed[ps] = FramedStub(channel, sessions=self._sessions)
        old_framed.close()
        close_later(old)

    def follow(self, addresses: Mapping[str, str]) -> None:
        """Apply the ps addresses of a supervisor's address map (``{"ps:1": "host:port", ...}``)."""
        for ps, address in tasks_of("ps", addresses).items():
            if ps < len(self.addresses):
                self.set_address(ps, address)

    def _wrap(self, ps: int, exc: grpc.RpcError) -> Exception:
        code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        if code in _UNAVAILABLE:
            return PsUnavailable(ps, self.addresses[ps], details or str(code))
        if code == grpc.StatusCode.FAILED_PRECONDITION and "no variables" in details:
            return PsUnavailable(ps, self.addresses[ps], "it restarted and lost its variables")
        return replaced(exc) or exc

    def _on_every_ps(self, calls: Mapping[int, Call]) -> dict[int, Any]:
        """Make every call, all in flight at once, and return their results. The first runs in this thread: a
        blocking gRPC call saves the hand-off from gRPC's completion thread that a future costs."""
        return self._start_every_ps(calls, first_here=True)()

    def _start_every_ps(self, calls: Mapping[int, Call], *, first_here: bool = False) -> Callable[[], dict[int, Any]]:
        """Start every call; returns what waits for their results (``first_here``: the first is made then, in
        the waiting thread)."""
        order = sorted(calls)
        first = order.pop(0) if first_here else None
        pending: dict[int, Future[Any] | grpc.Future | Exchange] = {}
        for ps in order:
            call = calls[ps]
            pending[ps] = self._pool.submit(call) if callable(call) else call[0].future(call[1], timeout=self.timeout)

        def results() -> dict[int, Any]:
            runs: list[tuple[int, Callable[[], Any]]] = [(ps, future.result) for ps, future in pending.items()]
            if first is not None:
                call = calls[first]
                runs.insert(0, (first, call if callable(call) else lambda: call[0](call[1], timeout=self.timeout)))
            try:
                return _all_or_raise(self._guard, runs, wait_all=bool(self.chief_incarnation))
            except BaseException:
                for future in pending.values():  # a session whose answer is never read must not carry another
                    if isinstance(future, Exchange):
                        future.cancel()
                raise

        return results

    def _guard(self, ps: int, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except grpc.RpcError as exc:
            raise self._wrap(ps, exc) from None
        except SessionEnded as exc:
            raise PsUnavailable(ps, self.addresses[ps], str(exc)) from None

    # -- pull -----------------------------------------------------------------------------------------
    def pull(
        self,
        plan: Mapping[int, Sequence[Entry]],
        expected_bytes: Mapping[int, int] | None = None,
        *,
        include_slots: bool = False,
    ) -> tuple[dict[int, list[Entry]], int]:
        """Pull from every PS in the plan in parallel; returns entries per PS and ps 0's global step."""
        entries, steps = self.pull_with_steps(plan, expected_bytes, include_slots=include_slots)
        return entries, steps.get(0, 0)

    def pull_with_steps(
        self,
        plan: Mapping[int, Sequence[Entry]],
        expected_bytes: Mapping[int, int] | None = None,
        *,
        include_slots: bool = False,
    ) -> tuple[dict[int, list[Entry]], dict[int, int]]:
        """Like pull, returning every PS's own global step at the time it answered."""
        calls: dict[int, Call] = {}
        for ps in range(len(self._framed)):
            request = wire.encode_frame(pb.PullRequest(include_slots=include_slots), plan.get(ps, []))
            if include_slots or (expected_bytes or {}).get(ps, 0) > limits.UNARY_MAX_BYTES:
                calls[ps] = partial(self._pull_stream, ps, request)
            else:
                calls[ps] = (self._framed[ps].pull, request)
        out: dict[int, list[Entry]] = {}
        steps: dict[int, int] = {}
        for ps, result in self._on_every_ps(calls).items():
            header, out[ps] = wire.read_frame(result, pb.PullResponse) if isinstance(result, bytes) else result
            steps[ps] = header.global_step
        return out, steps

    def _pull_stream(self, ps: int, request: bytes) -> tuple[pb.PullResponse, list[Entry]]:
        assembler = wire.Assembler()
        first = None
        for frame in self._framed[ps].pull_stream(request, timeout=self.timeout):
            header, pieces = wire.decode_frame(frame, pb.PullResponse)
            first = header if first is None else first
            assembler.add_pieces(pieces)
        return first if first is not None else pb.PullResponse(), assembler.entries()

    # -- push -----------------------------------------------------------------------------------------
    def push(
        self,
        header: PushHeader,
        plan: Mapping[int, Sequence[Entry]],
        *,
        increment_on: int | None = 0,
    ) -> dict[int, pb.PushResponse]:
        """Push one step's gradients to every PS (each gets a push, possibly empty, so the step id is
        recorded everywhere); ps ``increment_on`` advances the global step."""
        return {ps: response for ps, (response, _) in self._push(header, plan, increment_on, {}).items()}

    def push_pull(
        self,
        header: PushHeader,
        plan: Mapping[int, Sequence[Entry]],
        pull: Mapping[int, Sequence[Entry]],
        *,
        increment_on: int | None = 0,
    ) -> tuple[dict[int, pb.PushResponse], dict[int, list[Entry]]]:
        """Push, and get back what the pull plan ``pull`` asks of each PS (whole shards; an embedding shard's
        rows, by IDS entries) as it is right after the update, in the same round trip (an asynchronous worker's
        next step's variables). Each PS's gradients must fit one unary message."""
        return _apart(self._push(header, plan, increment_on, pull))

    def start_push_pull(
        self,
        header: PushHeader,
        plan: Mapping[int, Sequence[Entry]],
        pull: Mapping[int, Sequence[Entry]],
        *,
        increment_on: int | None = 0,
    ) -> Callable[[], tuple[dict[int, pb.PushResponse], dict[int, list[Entry]]]]:
        """``push_pull``, sent now: returns what waits for its answers (a pipelined worker computes its next step
        meanwhile, in the same thread)."""
        results = self._start_every_ps(self._push_calls(header, plan, increment_on, pull))
        return lambda: _apart({ps: _push_reply(frame) for ps, frame in results().items()})

    def _push(
        self,
        header: PushHeader,
        plan: Mapping[int, Sequence[Entry]],
        increment_on: int | None,
        pull: Mapping[int, Sequence[Entry]],
    ) -> dict[int, tuple[pb.PushResponse, list[Entry]]]:
        calls = self._push_calls(header, plan, increment_on, pull)
        return {ps: _push_reply(frame) for ps, frame in self._on_every_ps(calls).items()}

    def _push_calls(
        self,
        header: PushHeader,
        plan: Mapping[int, Sequence[Entry]],
        increment_on: int | None,
        pull: Mapping[int, Sequence[Entry]],
    ) -> dict[int, Call]:
        """Each PS's push of one step: its request, and the rpc that carries it (the rows it asks back travel as
        PULL_IDS entries after the gradients)."""
        calls: dict[int, Call] = {}
        for ps in range(len(self._framed)):
            asked = pull.get(ps, ())
            rows = [Entry(e.name, wire.PULL_IDS, e.array) for e in asked if e.kind == wire.IDS]
            entries = [*plan.get(ps, []), *rows]
            request = pb.PushRequest(
                step_id=header.step_id,
                task=header.task,
                incarnation=header.incarnation,
                local_step=(header.local_steps or {}).get(ps, 0),
                increment_global_step=ps == increment_on,
                shard=header.shard,
                position=header.position,
                pull_dense=[e.name for e in asked if e.kind == wire.DENSE],
                chief_incarnation=header.chief_incarnation,
            )
            if wire.payload_bytes(entries) <= limits.UNARY_MAX_BYTES:
                calls[ps] = (self._framed[ps].push, wire.encode_frame(request, entries))
            elif asked:
                raise ValueError(f"push_pull: the gradients for ps:{ps} do not fit one message")
            else:
                frames = wire.frames(entries, request)
                calls[ps] = partial(self._framed[ps].push_stream, frames, timeout=self.timeout)
        return calls

    def assign(self, per_ps: Mapping[int, Sequence[Entry]], global_step: int, positions: Sequence[int],
               counters: Mapping[str, int] | None = None) -> None:
        """Replace every PS's variables and slots (restore), all PS in parallel, streamed; ``counters``: the
        synchronous training's counters (``sync_counters``) for every PS to count on from."""
        model_id = new_model_id()

        def one(ps: int) -> bytes:
            header = pb.AssignRequest(global_step=global_step, shard_positions=list(positions),
                                      chief_incarnation=self.chief_incarnation, model_id=model_id)
            if counters is not None:
                header.sync_counters.CopyFrom(pb.SyncCounters(**counters))
            frames = wire.frames(per_ps.get(ps, []), header)
            return self._framed[ps].assign_stream(frames, timeout=self.timeout)  # type: ignore[no-any-return]

        self._on_every_ps({ps: partial(one, ps) for ps in range(len(self._framed))})

    # -- control --------------------------------------------------------------------------------------
    def init(self, specs: Mapping[int, Sequence[pb.VariableSpec]], optimizer: pb.OptimizerConfig,
             cluster_id: str, *, reset: bool = False, replicas_to_aggregate: int = 0,
             distinct_replicas: bool = False) -> list[pb.InitResponse]:
        """Create (``reset``: re-create) every PS's shards, all of one new model id; what each PS answered."""
        model_id = new_model_id()
        calls: dict[int, Call] = {
            ps: (self.stubs[ps].Init, pb.InitRequest(
                variables=list(specs.get(ps, [])), optimizer=optimizer, cluster_id=cluster_id, reset=reset,
                replicas_to_aggregate=replicas_to_aggregate, distinct_replicas=distinct_replicas,
                chief_incarnation=self.chief_incarnation, model_id=model_id,
            ))
            for ps in range(len(self.stubs))
        }
        done = self._on_every_ps(calls)
        return [done[ps] for ps in range(len(self.stubs))]

    def state(self, ps: int = 0, *, include_step_ids: bool = False, timeout: float | None = None,
              release: bool = False, training_over: bool = False) -> pb.StateResponse:
        """A PS's state; ``release``: a leaving PS may go (the chief has checkpointed it); ``training_over``:
        the chief finished training, so the PS may go at once when stopped."""
        try:
            return self.stubs[ps].GetState(  # type: ignore[no-any-return]
                pb.StateRequest(include_step_ids=include_step_ids, chief_incarnation=self.chief_incarnation,
                                release=release, training_over=training_over),
                timeout=timeout or self.timeout,
            )
        except grpc.RpcError as exc:
            raise self._wrap(ps, exc) from None

    def sync_flush(self, step: int, min_replicas: int) -> list[pb.SyncFlushResponse]:
        """Ask every PS to apply ``step`` with the gradients that arrived (replica timeout)."""
        request = pb.SyncFlushRequest(step=step, min_replicas=min_replicas, chief_incarnation=self.chief_incarnation)
        done = self._on_every_ps({ps: (stub.SyncFlush, request) for ps, stub in enumerate(self.stubs)})
        return [done[ps] for ps in range(len(self.stubs))]

    def wait_ready(self, timeout: float) -> None:
        """Block until every PS channel is connected (roles start in any order). A PS that moves meanwhile is
        waited for at its new address."""
        deadline = time.monotonic() + timeout
        for ps in range(len(self._channels)):
            while True:
                ready = grpc.channel_ready_future(self._channels[ps])
                try:
                    ready.result(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                    break
                except grpc.FutureTimeoutError:
                    ready.cancel()  # else it stays subscribed to the channel's state for good
                    if time.monotonic() >= deadline:
                        raise PsUnavailable(ps, self.addresses[ps], f"not reachable within {timeout:.0f}s") from None

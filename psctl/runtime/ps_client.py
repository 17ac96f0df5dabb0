"""Talking to every PS at once: one pull and one push rpc per PS per step, all in flight together.

Small payloads go as one unary message (lowest latency); large ones are streamed in chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import wire
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.rpc import make_channel
from psctl.runtime.wire import Entry


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


_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class PsClient:
    def __init__(self, addresses: Sequence[str], *, tls: TlsFiles | None = None, timeout: float = 60.0) -> None:
        self.addresses = list(addresses)
        self.timeout = timeout
        self._channels = [make_channel(a, tls) for a in self.addresses]
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self._channels]
        # Streaming calls need a thread each to be issued in parallel; unary calls use grpc futures.
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.addresses)), thread_name_prefix="ps-stream")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in self._channels:
            channel.close()

    def _wrap(self, ps: int, exc: grpc.RpcError) -> Exception:
        code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
        if code in _UNAVAILABLE:
            return PsUnavailable(ps, self.addresses[ps], details or str(code))
        if code == grpc.StatusCode.FAILED_PRECONDITION and "no variables" in details:
            return PsUnavailable(ps, self.addresses[ps], "it restarted and lost its variables")
        return exc

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
        calls: dict[int, Future] = {}
        for ps in range(len(self.stubs)):
            entries = plan.get(ps, [])
            request = pb.PullRequest(include_slots=include_slots)
            wire.add_entries(request.entries, entries)
            if include_slots or (expected_bytes or {}).get(ps, 0) > wire.UNARY_MAX_BYTES:
                calls[ps] = self._pool.submit(self._pull_stream, ps, request)
            else:
                calls[ps] = self.stubs[ps].Pull.future(request, timeout=self.timeout)
        out: dict[int, list[Entry]] = {}
        steps: dict[int, int] = {}
        for ps, call in calls.items():
            try:
                result = call.result()
            except grpc.RpcError as exc:
                raise self._wrap(ps, exc) from None
            if isinstance(result, tuple):
                entries, step = result
            else:
                entries, step = wire.decode_entries(result.entries), result.global_step
            out[ps] = entries
            steps[ps] = step
        return out, steps

    def _pull_stream(self, ps: int, request: pb.PullRequest) -> tuple[list[Entry], int]:
        assembler = wire.Assembler()
        step = 0
        for i, chunk in enumerate(self.stubs[ps].PullStream(request, timeout=self.timeout)):
            if i == 0:
                step = chunk.part.global_step
            assembler.add(chunk.part.entries)
        return assembler.entries(), step

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
        calls: dict[int, Future] = {}
        for ps in range(len(self.stubs)):
            entries = plan.get(ps, [])
            fields: dict[str, Any] = dict(
                step_id=header.step_id,
                task=header.task,
                incarnation=header.incarnation,
                local_step=(header.local_steps or {}).get(ps, 0),
                increment_global_step=ps == increment_on,
                shard=header.shard,
                position=header.position,
            )
            if wire.payload_bytes(entries) > wire.UNARY_MAX_BYTES:
                calls[ps] = self._pool.submit(self._push_stream, ps, fields, entries)
            else:
                request = pb.PushRequest(**fields)
                wire.add_entries(request.entries, entries)
                calls[ps] = self.stubs[ps].Push.future(request, timeout=self.timeout)
        out: dict[int, pb.PushResponse] = {}
        for ps, call in calls.items():
            try:
                out[ps] = call.result()
            except grpc.RpcError as exc:
                raise self._wrap(ps, exc) from None
        return out

    def _push_stream(self, ps: int, fields: dict[str, Any], entries: Sequence[Entry]) -> pb.PushResponse:
        def new_chunk(i: int) -> pb.PushChunk:
            return pb.PushChunk(part=pb.PushRequest(**fields)) if i == 0 else pb.PushChunk()

        chunks = wire.fill_chunks(entries, new_chunk)
        return self.stubs[ps].PushStream(chunks, timeout=self.timeout)  # type: ignore[no-any-return]

    def assign(self, per_ps: Mapping[int, Sequence[Entry]], global_step: int, positions: Sequence[int]) -> None:
        """Replace every PS's variables and slots (restore), all PS in parallel, streamed."""

        def new_chunk(i: int) -> pb.AssignChunk:
            if i == 0:
                return pb.AssignChunk(part=pb.AssignRequest(global_step=global_step, shard_positions=list(positions)))
            return pb.AssignChunk()

        def one(ps: int) -> pb.AssignResponse:
            chunks = wire.fill_chunks(per_ps.get(ps, []), new_chunk)
            return self.stubs[ps].AssignStream(chunks, timeout=self.timeout)  # type: ignore[no-any-return]

        calls = {ps: self._pool.submit(one, ps) for ps in range(len(self.stubs))}
        for ps, call in calls.items():
            try:
                call.result()
            except grpc.RpcError as exc:
                raise self._wrap(ps, exc) from None

    # -- control --------------------------------------------------------------------------------------
    def init(self, specs: Mapping[int, Sequence[pb.VariableSpec]], optimizer: pb.OptimizerConfig,
             cluster_id: str, *, reset: bool = False, replicas_to_aggregate: int = 0,
             distinct_replicas: bool = False) -> list[pb.InitResponse]:
        calls = [
            self.stubs[ps].Init.future(
                pb.InitRequest(
                    variables=list(specs.get(ps, [])), optimizer=optimizer, cluster_id=cluster_id, reset=reset,
                    replicas_to_aggregate=replicas_to_aggregate, distinct_replicas=distinct_replicas,
                ),
                timeout=self.timeout,
            )
            for ps in range(len(self.stubs))
        ]
        out = []
        for ps, call in enumerate(calls):
            try:
                out.append(call.result())
            except grpc.RpcError as exc:
                raise self._wrap(ps, exc) from None
        return out

    def state(self, ps: int = 0, *, include_step_ids: bool = False, timeout: float | None = None) -> pb.StateResponse:
        try:
            return self.stubs[ps].GetState(  # type: ignore[no-any-return]
                pb.StateRequest(include_step_ids=include_step_ids), timeout=timeout or self.timeout
            )
        except grpc.RpcError as exc:
            raise self._wrap(ps, exc) from None

    def sync_flush(self, step: int, min_replicas: int) -> list[pb.SyncFlushResponse]:
        """Ask every PS to apply ``step`` with the gradients that arrived (replica timeout)."""
        out = []
        for ps, stub in enumerate(self.stubs):
            try:
                out.append(stub.SyncFlush(pb.SyncFlushRequest(step=step, min_replicas=min_replicas),
                                          timeout=self.timeout))
            except grpc.RpcError as exc:
                raise self._wrap(ps, exc) from None
        return out

    def wait_ready(self, timeout: float) -> None:
        """Block until every PS channel is connected (roles start in any order)."""
        for ps, channel in enumerate(self._channels):
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout)
            except grpc.FutureTimeoutError:
                raise PsUnavailable(ps, self.addresses[ps], f"not reachable within {timeout:.0f}s") from None

"""Sessions (psctl.runtime.sessions): a worker's pulls and pushes over long-lived streams to a real PS on loopback.

Each session must answer exactly as the unary rpc does (values, refusals and their status codes), be reused
across steps, never be reused after a failure, an expiry or the server's restart, and give way to unary calls
where the server refuses sessions. The PS is registered and threaded as the runtime does it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.ps import SERVER_THREADS, ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.ps_client import PsClient, PsUnavailable, PushHeader
from psctl.runtime.rpc import make_server
from psctl.runtime.sessions import SessionPool
from psctl.runtime.wire import DENSE, Entry

CLUSTER = "sessions"
W = pb.VariableSpec(name="w", dtype="float32", shape=[4, 3], full_shape=[4, 3], initializer="glorot_uniform", seed=3)
SGD = pb.OptimizerConfig(name="sgd", learning_rate=0.1)
GRAD = np.arange(12, dtype=np.float32).reshape(4, 3) / np.float32(10)
NAN_GRAD = np.where(np.eye(4, 3, dtype=bool), np.float32(np.nan), GRAD)


@dataclass
class Ps:
    server: grpc.Server
    servicer: ParameterServerServicer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class _WithoutSessions:
    """Registers a PS's rpcs on ``server`` but its sessions (a PS from before them)."""

    def __init__(self, server: grpc.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # add_registered_method_handlers below registers them all

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        kept = {name: h for name, h in handlers.items() if not name.endswith("Session")}
        assert len(kept) < len(handlers)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, kept),))


@dataclass
class Servers:
    started: list[grpc.Server]
    clients: list[PsClient]

    def start(self, port: int = 0, *, without_sessions: bool = False, generated: bool = False) -> Ps:
        """A PS as the runtime serves it, initialised with ``w`` (``without_sessions``: an older PS;
        ``generated``: registered by the generated code, protobuf messages in and out)."""
        server, port = make_server(f"127.0.0.1:{port}", max_workers=SERVER_THREADS)
        servicer = ParameterServerServicer(VariableStore(cluster_id=CLUSTER))
        if generated:
            pb_grpc.add_ParameterServerServicer_to_server(servicer, server)
        else:
            add_to_server(servicer, _WithoutSessions(server) if without_sessions else server)
        server.start()
        self.started.append(server)
        ps = Ps(server, servicer, port)
        self.client([ps]).init({0: [W]}, SGD, CLUSTER)
        return ps

    def client(self, ps: Sequence[Ps], *, sessions: bool = False, timeout: float = 30) -> PsClient:
        client = PsClient([p.address for p in ps], timeout=timeout, sessions=sessions)
        self.clients.append(client)
        return client


@pytest.fixture
def servers() -> Iterator[Servers]:
    handle = Servers([], [])
    try:
        yield handle
    finally:
        for client in handle.clients:
            client.close()
        for server in handle.started:
            server.stop(grace=None).wait()


def push(client: PsClient, step_id: int, grad: np.ndarray = GRAD, ps: int = 0) -> pb.PushResponse:
    header = PushHeader(step_id=step_id, task="worker:0", incarnation=1)
    return client.push(header, {ps: [Entry("w", DENSE, grad)]}, increment_on=ps)[ps]


def pull(client: PsClient, ps: int = 0) -> bytes:
    pulled, _ = client.pull({ps: [Entry("w", DENSE, np.zeros(0, np.float32))]})
    return bytes(pulled[ps][0].array.tobytes())


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def push_pool(client: PsClient, ps: int = 0) -> SessionPool:
    pool = client._framed[ps].push
    assert isinstance(pool, SessionPool)
    return pool


def test_steps_reuse_one_session_per_rpc_and_get_exactly_the_unary_answers(servers: Servers) -> None:
    by_session, by_unary = servers.start(), servers.start()
    worker, plain = servers.client([by_session], sessions=True), servers.client([by_unary])
    for step in range(1, 6):
        grad = GRAD * np.float32(step)
        got, want = push(worker, step, grad), push(plain, step, grad)
        assert (got.applied, got.global_step) == (want.applied, want.global_step) == (True, step)
        assert pull(worker) == pull(plain)
    again = push(worker, 3)  # a step id already applied: refused as applied, as unary
    assert (again.applied, again.global_step) == (False, 5)
    sessions = by_session.servicer.sessions
    assert (sessions.opened, sessions.open) == (2, 2)  # one push and one pull session, carrying every step
    assert by_session.servicer.requests == 11  # 6 pushes and 5 pulls, every one served
    assert by_unary.servicer.sessions.opened == 0


def test_a_refused_push_fails_as_unary_changes_nothing_and_its_session_is_not_reused(servers: Servers) -> None:
    ps, twin = servers.start(), servers.start()
    worker, plain = servers.client([ps], sessions=True), servers.client([twin])
    assert push(worker, 1).applied and push(plain, 1).applied
    before = pull(worker)
    with pytest.raises(grpc.RpcError) as by_session:
        push(worker, 2, NAN_GRAD)
    with pytest.raises(grpc.RpcError) as by_unary:
        push(plain, 2, NAN_GRAD)
    assert by_session.value.code() == by_unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert by_session.value.details() == by_unary.value.details()  # type: ignore[attr-defined]
    assert pull(worker) == before and ps.servicer.store.global_step == 1
    # the failed session ended on both sides; the next push opens another and is applied (step 2 not used up)
    wait_for(lambda: ps.servicer.sessions.open == 1, "the refused session to end on the server (the pull's stays)")
    assert push(worker, 2).applied and ps.servicer.sessions.opened == 3


def test_a_server_full_of_sessions_refuses_more_and_the_calls_go_unary_applied_once(servers: Servers) -> None:
    ps = servers.start()
    ps.servicer.sessions.limit = 0
    worker = servers.client([ps], sessions=True)
    assert push(worker, 1).applied and push(worker, 2).applied
    assert pull(worker) == pull(servers.client([ps]))
    sessions = ps.servicer.sessions
    assert (sessions.opened, sessions.open) == (0, 0)
    assert sessions.refused == 2  # one push and one pull session asked for; later calls went unary at once
    state = ps.servicer.store
    assert (state.applied_updates, state.global_step) == (2, 2)  # the refused request was sent again once


def test_a_ps_registered_by_the_generated_code_serves_sessions_alike(servers: Servers) -> None:
    generated, runtime = servers.start(generated=True), servers.start()
    by_generated, by_runtime = servers.client([generated], sessions=True), servers.client([runtime], sessions=True)
    for step in (1, 2):
        assert push(by_generated, step).global_step == push(by_runtime, step).global_step == step
    assert pull(by_generated) == pull(by_runtime)
    with pytest.raises(grpc.RpcError) as refused:
        push(by_generated, 3, NAN_GRAD)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert push(by_generated, 3).applied
    assert generated.servicer.sessions.opened == 3  # pull, push, and the push session after the refusal


def test_a_server_without_sessions_is_called_unary(servers: Servers) -> None:
    ps = servers.start(without_sessions=True)
    worker = servers.client([ps], sessions=True)
    assert [push(worker, step).global_step for step in (1, 2, 3)] == [1, 2, 3]
    assert ps.servicer.store.applied_updates == 3


def test_an_idle_session_the_server_ended_is_not_reused_after_it_restarts(servers: Servers) -> None:
    ps = servers.start()
    worker = servers.client([ps], sessions=True)
    assert push(worker, 1).applied
    ps.server.stop(grace=None).wait()
    # the client hears of the session's end (as it would of a PS that restarted) ...
    wait_for(lambda: not push_pool(worker)._idle[0].usable(time.monotonic(), 0), "the client to see the session end")
    restarted = servers.start(ps.port)
    # ... and the next push opens a new session to the new PS instead of failing on the old one
    response = push(worker, 2)
    assert (response.applied, response.global_step) == (True, 1)
    assert restarted.servicer.sessions.opened == 1


def test_a_session_is_not_reused_with_less_than_a_timeout_of_life_left(servers: Servers) -> None:
    ps = servers.start()
    # sessions live 2 timeouts: 4 s (a shorter timeout made a slow first push or poll on a loaded machine miss
    # the window in which the second session is the only one open)
    worker = servers.client([ps], sessions=True, timeout=2.0)
    assert push(worker, 1).applied
    session = push_pool(worker)._idle[0]
    wait_for(lambda: session.expires - time.monotonic() < 2.0, "the session to have less than a timeout left")
    assert push(worker, 2).applied
    assert ps.servicer.sessions.opened == 2
    wait_for(lambda: ps.servicer.sessions.open == 1, "the expired session to be closed")


def test_closing_the_client_ends_its_sessions_on_the_server(servers: Servers) -> None:
    ps = servers.start()
    worker = servers.client([ps], sessions=True)
    assert push(worker, 1).applied and pull(worker)
    assert ps.servicer.sessions.open == 2
    worker.close()
    wait_for(lambda: ps.servicer.sessions.open == 0, "the server to end the closed client's sessions")


def test_when_one_ps_fails_the_other_ps_session_whose_answer_was_not_read_is_closed(servers: Servers) -> None:
    ps0, ps1 = servers.start(), servers.start()
    worker = servers.client([ps0, ps1], sessions=True)
    header = PushHeader(step_id=1, task="worker:0", incarnation=1)
    worker.push(header, {0: [Entry("w", DENSE, GRAD)], 1: [Entry("w", DENSE, GRAD)]})
    assert ps1.servicer.sessions.opened == 1
    # ps 0 refuses step 2 at once; ps 1's answer is then never read, so its session must not carry step 3
    with pytest.raises(grpc.RpcError):
        worker.push(
            PushHeader(step_id=2, task="worker:0", incarnation=1),
            {0: [Entry("w", DENSE, NAN_GRAD)], 1: [Entry("w", DENSE, GRAD)]},
        )
    wait_for(lambda: ps1.servicer.sessions.open == 0, "ps 1's abandoned session to end")
    replies = worker.push(
        PushHeader(step_id=3, task="worker:0", incarnation=1),
        {0: [Entry("w", DENSE, GRAD)], 1: [Entry("w", DENSE, GRAD)]},
    )
    assert replies[0].applied and replies[1].applied
    assert ps1.servicer.sessions.opened == 2


def test_a_lost_ps_fails_a_session_call_as_unavailable(servers: Servers) -> None:
    ps = servers.start()
    worker = servers.client([ps], sessions=True, timeout=5)
    assert push(worker, 1).applied
    ps.server.stop(grace=None).wait()
    with pytest.raises(PsUnavailable, match="ps:0"):
        push(worker, 2)


def test_a_malformed_frame_on_a_session_is_refused_and_changes_nothing(servers: Servers) -> None:
    ps = servers.start()
    worker = servers.client([ps], sessions=True)
    assert push(worker, 1).applied
    before = pull(worker)
    session = worker._channels[0].stream_stream("/psctl.ParameterServer/PushFramedSession")
    with pytest.raises(grpc.RpcError) as refused:
        list(session(iter([b"\xff\x00 not a frame"]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert pull(worker) == before and ps.servicer.store.global_step == 1
    assert push(worker, 2).applied  # still serving

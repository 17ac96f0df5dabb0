"""Mutual TLS between roles, end to end: real gRPC servers on loopback made by ``psctl.runtime.rpc.make_server``,
real certificates from ``psctl.pki``, and real clients.

For each kind of server a cluster runs — a parameter server, a worker and the supervisor's heartbeat endpoint —
a client is refused unless it presents a certificate signed by the cluster's CA that is valid now: a plaintext
client, a TLS client without a certificate, a client of another cluster and a client with an expired (or not yet
valid) certificate all fail the handshake (UNAVAILABLE), and nothing reaches the servicer. Each refusal is
followed by a valid client on the same server, so a refusal cannot come from a server that is simply down.

Then the files: ``create_cluster_pki`` and a real ``psctl up`` keep keys, state and logs private, keep no CA
key, and the roles of a running cluster really talk TLS. And the spec: ``security.tls: false`` is refused for
a cluster on other hosts.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
from click.testing import CliRunner
from cluster_helpers import wait_until
from conftest import Hold
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from psctl.agent.core import HeartbeatEndpoint
from psctl.cli import cli
from psctl.errors import EXIT_USAGE, SpecError
from psctl.pki import VALIDITY, create_cluster_pki, issue, member_files, new_ca
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import wire
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Program, ProgramRef, load_program
from psctl.runtime.ps import ParameterServerServicer, VariableStore
from psctl.runtime.ps_client import PsClient, PsUnavailable, PushHeader
from psctl.runtime.rpc import TLS_SERVER_NAME, make_channel, make_server
from psctl.runtime.wire import DENSE, Entry
from psctl.spec import load_spec_text, make_plan

MEMBERS = [("ps-0", "127.0.0.1"), ("worker-0", "127.0.0.1"), ("worker-1", "127.0.0.1"), ("chief-0", "127.0.0.1"),
           ("supervisor", "127.0.0.1"), ("client", "127.0.0.1")]
#: The member the probes speak as: they push and beat as worker:0, which only worker-0's certificate may.
CLIENT = "worker-0"
SERVER_OF = {"ps": "ps-0", "worker": "worker-0", "supervisor": "supervisor"}
KINDS = tuple(SERVER_OF)
#: Every rpc of these tests has a deadline: a refused handshake answers at once, a hang fails the test.
RPC_TIMEOUT = 10.0
W = pb.VariableSpec(name="w", dtype="float32", shape=[4, 3], full_shape=[4, 3], initializer="glorot_uniform", seed=5)
B = pb.VariableSpec(name="b", dtype="float64", shape=[3], full_shape=[3], initializer="ones", seed=6)
ADAM = pb.OptimizerConfig(name="adam", learning_rate=0.01)
EMPTY = np.zeros(0, dtype=np.float32)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# -- certificates -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    #: Two clusters made by psctl itself (their CA keys are gone, as in production).
    c1: dict[str, TlsFiles]
    c2: dict[str, TlsFiles]
    #: A CA of our own, whose key we keep to mint certificates psctl never would: the servers' certificates,
    #: valid members (MEMBERS), an expired one ("expired") and one not valid yet ("not-yet-valid").
    minted: dict[str, TlsFiles]

    def of(self, pki: str) -> dict[str, TlsFiles]:
        return {"c1": self.c1, "c2": self.c2, "minted": self.minted}[pki]


def mint_pki(directory: Path, cluster_id: str) -> dict[str, TlsFiles]:
    directory.mkdir(mode=0o700)
    ca_key, ca_cert = new_ca(cluster_id)
    write_private(directory / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    now = dt.datetime.now(dt.timezone.utc)
    certs: dict[str, tuple[dt.datetime | None, dt.timedelta]] = {
        **{name: (None, VALIDITY) for name, _ in MEMBERS},
        "expired": (now - dt.timedelta(days=3), dt.timedelta(days=1)),
        "not-yet-valid": (now + dt.timedelta(days=1), dt.timedelta(days=1)),
        "expired-server": (now - dt.timedelta(days=3), dt.timedelta(days=1)),
    }
    out = {}
    for name, (not_before, validity) in certs.items():
        key_pem, cert_pem = issue(ca_key, ca_cert, name, "127.0.0.1", not_before=not_before, validity=validity)
        write_private(directory / f"{name}.key", key_pem)
        write_private(directory / f"{name}.pem", cert_pem)
        out[name] = member_files(directory, name)
    expired = x509.load_pem_x509_certificate(Path(out["expired"].cert).read_bytes())
    assert expired.not_valid_after_utc < now, "the 'expired' certificate must really be expired"
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    return Pki(
        c1=create_cluster_pki(root / "tls", "c1", MEMBERS),
        c2=create_cluster_pki(root / "tls-c2", "c2", MEMBERS),
        minted=mint_pki(root / "minted", "c3"),
    )


@pytest.fixture(scope="module")
def program() -> Program:
    return load_program(ProgramRef("psctl.models.mlp", {"hidden_units": 16}, {"name": "digits"}))


# -- servers ----------------------------------------------------------------------------------------------------
def record_calls(servicer: object, base: type, calls: list[str]) -> None:
    """Make every rpc method of ``servicer`` (those ``base``, the generated servicer class, declares) append its
    name to ``calls`` before running: what reached the application, as opposed to what gRPC turned away."""
    for name in vars(base):
        if not name[:1].isupper():
            continue
        method = getattr(servicer, name)

        def recorded(*args: Any, _name: str = name, _method: Callable[..., Any] = method) -> Any:
            calls.append(_name)
            return _method(*args)

        setattr(servicer, name, recorded)


class HeartbeatRecorder:
    """Stands in for the agent behind its heartbeat endpoint: records every heartbeat it is given."""

    def __init__(self) -> None:
        self.heartbeats: list[pb.HeartbeatRequest] = []

    def on_heartbeat(self, hb: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self.heartbeats.append(hb)
        return pb.HeartbeatResponse()


@dataclass
class Target:
    """A running server of one kind, what reached its servicer, and one rpc to try on it."""

    kind: str
    address: str
    calls: list[str]
    store: VariableStore | None = None
    recorder: HeartbeatRecorder | None = None
    step_ids: list[int] = field(default_factory=lambda: [0])

    @property
    def method(self) -> str:
        return {"ps": "Push", "worker": "Ping", "supervisor": "Heartbeat"}[self.kind]

    def probe(self, channel: grpc.Channel, *, wait: bool = False) -> Any:
        """The rpc under test: a push that would change the PS, a ping, a heartbeat that would be recorded.

        ``wait``: wait (within the deadline) for the connection rather than fail at the first failed attempt; for
        the clients that must get through, so that a slow handshake on a busy machine is not mistaken for a refusal.
        """
        opts: dict[str, Any] = {"timeout": RPC_TIMEOUT, "wait_for_ready": wait}
        if self.kind == "ps":
            self.step_ids[0] += 1
            request = pb.PushRequest(
                step_id=self.step_ids[0], task="worker:0", incarnation=1, increment_global_step=True
            )
            wire.add_entries(request.entries, [Entry("w", DENSE, np.full((4, 3), 0.5, dtype=np.float32))])
            return pb_grpc.ParameterServerStub(channel).Push(request, **opts)
        if self.kind == "worker":
            return pb_grpc.WorkerStub(channel).Ping(pb.PingRequest(), **opts)
        hb = pb.HeartbeatRequest(task="worker:0", incarnation=7, pid=1234, global_step=42)
        return pb_grpc.SupervisorStub(channel).Heartbeat(hb, **opts)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything the servicer could have changed, as bytes."""
        state: tuple[Any, ...] = (tuple(self.calls),)
        if self.store is not None:
            pulled = self.store.pull([Entry("w", DENSE, EMPTY), Entry("b", DENSE, EMPTY)], include_slots=True)
            state += (
                tuple((e.name, e.array.tobytes()) for e in pulled),
                self.store.state(include_step_ids=True).SerializeToString(),
            )
        if self.recorder is not None:
            state += (tuple(hb.SerializeToString() for hb in self.recorder.heartbeats),)
        return state

    def check_served(self, response: Any) -> None:
        """The probe got through: the servicer ran it, and did what it does."""
        assert self.calls == [self.method], self.calls
        if self.kind == "ps":
            assert self.store is not None
            assert response.applied and response.global_step == 1, response
            assert self.store.applied_updates == 1
        elif self.kind == "worker":
            assert (response.task, response.incarnation) == ("worker:0", 7), response
        else:
            assert self.recorder is not None
            assert response.fenced is False
            assert [(hb.task, hb.incarnation, hb.global_step) for hb in self.recorder.heartbeats] == [
                ("worker:0", 7, 42)
            ]


class Servers:
    """Starts servers of each kind with make_server; ``close`` stops every one and every client made for them."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self._servers: list[grpc.Server] = []
        self._clients: list[PsClient] = []

    def ps(self, tls: TlsFiles | None) -> Target:
        store = VariableStore(cluster_id="c1")
        store.init([W, B], ADAM)
        calls: list[str] = []
        servicer = ParameterServerServicer(store)
        record_calls(servicer, pb_grpc.ParameterServerServicer, calls)
        address = self._serve(tls, lambda server: pb_grpc.add_ParameterServerServicer_to_server(servicer, server))
        return Target("ps", address, calls, store=store)

    def worker(self, tls: TlsFiles | None, ps_tls: TlsFiles | None) -> Target:
        # The worker's own PsClient points at a real PS of the same cluster, with the worker's certificate.
        ps = self.ps(ps_tls)
        client = PsClient([ps.address], tls=tls, timeout=RPC_TIMEOUT)
        self._clients.append(client)
        calls: list[str] = []
        from psctl.runtime.worker import WorkerServicer

        servicer = WorkerServicer(
            ShardedModel(self.program, 1), client, task="worker:0", incarnation=7, batch_size=50, num_shards=1
        )
        record_calls(servicer, pb_grpc.WorkerServicer, calls)
        address = self._serve(tls, lambda server: pb_grpc.add_WorkerServicer_to_server(servicer, server))
        return Target("worker", address, calls)

    def supervisor(self, tls: TlsFiles | None) -> Target:
        recorder = HeartbeatRecorder()
        servicer = HeartbeatEndpoint(recorder)  # type: ignore[arg-type]  # the endpoint only calls on_heartbeat
        calls: list[str] = []
        record_calls(servicer, pb_grpc.SupervisorServicer, calls)
        address = self._serve(tls, lambda server: pb_grpc.add_SupervisorServicer_to_server(servicer, server))
        return Target("supervisor", address, calls, recorder=recorder)

    def start(self, kind: str, files: dict[str, TlsFiles] | None, member: str | None = None) -> Target:
        """A server of ``kind`` with the certificate of ``member`` (default: its own role) from ``files``."""
        tls = None if files is None else files[member or SERVER_OF[kind]]
        if kind == "ps":
            return self.ps(tls)
        if kind == "worker":
            return self.worker(tls, None if files is None else files["ps-0"])
        return self.supervisor(tls)

    def _serve(self, tls: TlsFiles | None, add: Callable[[grpc.Server], None]) -> str:
        server, port = make_server("127.0.0.1:0", tls, max_workers=4)
        self._servers.append(server)
        add(server)
        server.start()
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for server in reversed(self._servers):
            server.stop(grace=None).wait(timeout=10)


@pytest.fixture
def servers(program: Program) -> Iterator[Servers]:
    handle = Servers(program)
    try:
        yield handle
    finally:
        handle.close()


# -- clients ----------------------------------------------------------------------------------------------------
def tls_channel(address: str, *, ca: str, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    """A TLS channel that trusts ``ca``, presenting ``cert``/``key`` (or no certificate at all)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", TLS_SERVER_NAME)])


#: Clients that must be refused, each with the PKI of the server it tries (c1 or, for validity, minted), and
#: how it connects. Those that trust the server's CA isolate the server's own check of the client.
REFUSED: dict[str, tuple[str, Callable[[Pki, str], grpc.Channel]]] = {
    "plaintext": ("c1", lambda p, a: grpc.insecure_channel(a)),
    "tls-without-client-certificate": ("c1", lambda p, a: tls_channel(a, ca=p.c1[CLIENT].ca)),
    "certificate-of-another-cluster": (
        "c1",
        lambda p, a: tls_channel(a, ca=p.c1[CLIENT].ca, cert=p.c2[CLIENT].cert, key=p.c2[CLIENT].key),
    ),
    "credentials-of-another-cluster": ("c1", lambda p, a: make_channel(a, p.c2[CLIENT])),
    "server-certificate-as-client-of-another-cluster": (
        "c1",
        lambda p, a: tls_channel(
            a, ca=p.c1[CLIENT].ca, cert=p.c2[SERVER_OF["ps"]].cert, key=p.c2[SERVER_OF["ps"]].key
        ),
    ),
    "expired-certificate": ("minted", lambda p, a: make_channel(a, p.minted["expired"])),
    "not-yet-valid-certificate": ("minted", lambda p, a: make_channel(a, p.minted["not-yet-valid"])),
}


def expect_refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())  # type: ignore[attr-defined]
    return error  # type: ignore[return-value]


# -- the servers' side: who may call ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pki_name", ["c1", "minted"])
def test_a_member_with_a_valid_certificate_is_served(servers: Servers, pki: Pki, kind: str, pki_name: str) -> None:
    files = pki.of(pki_name)
    target = servers.start(kind, files)
    with make_channel(target.address, files[CLIENT]) as channel:
        target.check_served(target.probe(channel, wait=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("client", list(REFUSED))
def test_a_client_without_a_valid_cluster_certificate_is_refused(
    servers: Servers, pki: Pki, kind: str, client: str
) -> None:
    pki_name, connect = REFUSED[client]
    files = pki.of(pki_name)
    target = servers.start(kind, files)
    before = target.snapshot()
    assert target.calls == [] and before == target.snapshot()
    for _ in range(2):  # a second attempt on the same channel is refused too (no half-open connection to reuse)
        with connect(pki, target.address) as channel:
            expect_refused(lambda channel=channel: target.probe(channel))
    assert target.snapshot() == before, f"a refused {client} client reached the {kind} servicer: {target.calls}"
    # The server is up and serving its cluster: the refusal was the certificate check, not a dead server.
    with make_channel(target.address, files[CLIENT]) as channel:
        target.check_served(target.probe(channel, wait=True))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("server", ["plaintext", "other-cluster", "expired-certificate"])
def test_a_member_refuses_a_server_that_is_not_of_its_cluster(
    servers: Servers, pki: Pki, kind: str, server: str
) -> None:
    """The other direction: a role never sends a gradient or a heartbeat to an impostor (make_channel checks the
    server's certificate against the cluster's CA, and its validity)."""
    if server == "plaintext":
        target, client = servers.start(kind, None), pki.c1[CLIENT]
    elif server == "other-cluster":
        target, client = servers.start(kind, pki.c2), pki.c1[CLIENT]
    else:
        target, client = servers.start(kind, pki.minted, member="expired-server"), pki.minted[CLIENT]
    before = target.snapshot()
    with make_channel(target.address, client) as channel:
        expect_refused(lambda: target.probe(channel))
    assert target.snapshot() == before


def test_a_refused_push_leaves_the_ps_bit_for_bit_unchanged(servers: Servers, pki: Pki) -> None:
    target = servers.start("ps", pki.c1)
    assert target.store is not None
    good = PsClient([target.address], tls=pki.c1[CLIENT], timeout=RPC_TIMEOUT)
    intruder = PsClient([target.address], tls=pki.c2[CLIENT], timeout=RPC_TIMEOUT)
    try:
        good.wait_ready(RPC_TIMEOUT)  # a slow first handshake on a busy machine is not what is under test
        names = [Entry("w", DENSE, EMPTY), Entry("b", DENSE, EMPTY)]

        def pulled() -> list[tuple[str, int, bytes]]:
            entries, _ = good.pull({0: names}, include_slots=True)
            return [(e.name, e.kind, e.array.tobytes()) for e in entries[0]]

        def counters() -> bytes:
            return (
                good.stubs[0].GetState(pb.StateRequest(include_step_ids=True), timeout=RPC_TIMEOUT).SerializeToString()
            )

        values, state = pulled(), counters()
        assert {n for n, _, _ in values} >= {"w", "w#m", "w#v", "b", "b#m", "b#v"}  # Adam's slots included
        target.calls.clear()
        grad = {0: [Entry("w", DENSE, np.full((4, 3), 1.0, dtype=np.float32))]}
        with pytest.raises(PsUnavailable):
            intruder.push(PushHeader(step_id=77, task="worker:0", incarnation=99), grad)
        stub = intruder.stubs[0]
        attempts: list[Callable[[], Any]] = [
            lambda: stub.Init(
                pb.InitRequest(variables=[W, B], optimizer=ADAM, cluster_id="c1", reset=True), timeout=RPC_TIMEOUT
            ),
            lambda: stub.Assign(pb.AssignRequest(global_step=1000), timeout=RPC_TIMEOUT),
            lambda: stub.PushStream(iter([pb.PushChunk(part=pb.PushRequest(step_id=78))]), timeout=RPC_TIMEOUT),
            lambda: stub.GetState(pb.StateRequest(), timeout=RPC_TIMEOUT),
        ]
        for attempt in attempts:
            expect_refused(attempt)
        assert target.calls == [], f"refused calls reached the PS servicer: {target.calls}"
        assert pulled() == values, "a refused push changed the PS's variables or optimizer slots"
        assert counters() == state, "a refused push changed the PS's counters or step ids"
        # The comparison sees a real change: the same push from a member moves every figure compared above.
        good.push(PushHeader(step_id=77, task="worker:0", incarnation=99), grad)
        assert pulled() != values and counters() != state
        assert target.store.applied_updates == 1 and target.store.global_step == 1
    finally:
        good.close()
        intruder.close()


def denied(call: Callable[[], Any]) -> str:
    """The details of the PERMISSION_DENIED ``call`` gets."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (error.code(), error.details())
    return str(error.details())


def test_a_member_acts_only_as_itself_and_only_the_chief_drives_the_ps(servers: Servers, pki: Pki) -> None:
    """A certificate of the cluster proves that its holder is a member; its name says which, and that decides
    what it may do. With worker-0's (a worker's, or a bug's in one): no Init (a reset ps), Assign (a restore to
    any step), SyncFlush or training-over of a ps, no state request in the chief's name (a huge chief incarnation
    would fence every real chief), and no push as another worker, unary or over a session (its incarnation would
    fence the task it names: training stalled for good). Each refused PERMISSION_DENIED, the ps bit for bit
    unchanged; a chief incarnation its own push relays is checked, never learnt; the chief's certificate does
    what the worker's could not."""
    target = servers.start("ps", pki.c1)
    store = target.store
    assert store is not None
    grad = [Entry("w", DENSE, np.full((4, 3), 1.0, dtype=np.float32))]
    as_worker1 = pb.PushRequest(step_id=5, task="worker:1", incarnation=2**62, increment_global_step=True)
    wire.add_entries(as_worker1.entries, grad)
    worker = PsClient([target.address], tls=pki.c1["worker-0"], timeout=RPC_TIMEOUT, sessions=True)  # (a worker's)
    chief = PsClient([target.address], tls=pki.c1["chief-0"], timeout=RPC_TIMEOUT)
    try:
        worker.wait_ready(RPC_TIMEOUT)
        stub = worker.stubs[0]
        before = target.snapshot()[1:]
        init = pb.InitRequest(variables=[W, B], optimizer=pb.OptimizerConfig(name="sgd", learning_rate=1000.0),
                              cluster_id="c1", reset=True)
        refusals = {
            "Init": lambda: stub.Init(init, timeout=RPC_TIMEOUT),
            "Assign": lambda: stub.Assign(pb.AssignRequest(global_step=1000), timeout=RPC_TIMEOUT),
            "SyncFlush": lambda: stub.SyncFlush(pb.SyncFlushRequest(step=1, min_replicas=1), timeout=RPC_TIMEOUT),
            "a state request in the chief's name":
                lambda: stub.GetState(pb.StateRequest(training_over=True), timeout=RPC_TIMEOUT),
            "a state request in the chief's name (fencing)":
                lambda: stub.GetState(pb.StateRequest(chief_incarnation=2**62), timeout=RPC_TIMEOUT),
            "a push of worker:1": lambda: stub.Push(as_worker1, timeout=RPC_TIMEOUT),
            "a push of worker:1 (framed, over a session)": lambda: worker.push(
                PushHeader(step_id=6, task="worker:1", incarnation=2**62), {0: grad}),
        }
        for what, attempt in refusals.items():
            details = denied(attempt)
            assert details.startswith(f"{what.split(' (')[0]} is ") and details.endswith(", not worker-0's"), details
        assert target.calls[-1] == "PushFramedSession" and target.snapshot()[1:] == before, target.calls
        assert not store.training_over.is_set()
        as_ps = pb.PushRequest(step_id=8, task="ps:0", incarnation=1)  # its own task, but a ps pushes nothing
        wire.add_entries(as_ps.entries, grad)
        with make_channel(target.address, pki.c1["ps-0"]) as channel:
            assert denied(lambda: pb_grpc.ParameterServerStub(channel).Push(as_ps, timeout=RPC_TIMEOUT)) == (
                "a push is a worker's to send, not ps-0's")
        assert target.snapshot()[1:] == before
        # its own pushes go through, a chief incarnation in them not learnt; the chief's certificate does the rest
        relayed = pb.PushRequest(step_id=7, task="worker:0", incarnation=1, chief_incarnation=2**62)
        wire.add_entries(relayed.entries, grad)
        assert stub.Push(relayed, timeout=RPC_TIMEOUT).applied
        assert store.chief_fence.newest == 0
        chief.init({0: [W, B]}, ADAM, "c1", reset=True)
        assert store.global_step == 0 and target.snapshot()[1:] != before
    finally:
        worker.close()
        chief.close()


def test_a_streamed_push_from_a_member_that_pushes_nothing_is_refused_before_its_stream_is_read(
        servers: Servers, pki: Pki) -> None:
    """A ps checked a streamed push's sender only once it had read the whole stream (up to gigabytes per call,
    from any member's certificate: an agent's, the evaluator's). It refuses before reading it: here the stream's
    second frame comes only once the call has ended (or after 10 s, for a ps that waits to read it)."""
    target = servers.start("ps", pki.c1)
    read: list[int] = []
    ended = threading.Event()

    def frames() -> Iterator[bytes]:
        for i, frame in enumerate(wire.frames([Entry("w", DENSE, np.ones((64, 64), np.float32))],
                                              pb.PushRequest(step_id=9, task="worker:0", incarnation=1), 1024)):
            read.append(i)
            yield frame
            if i == 0:
                ended.wait(timeout=10)

    with make_channel(target.address, pki.c1["ps-0"]) as channel:
        call = channel.stream_unary(f"/{wire.PS_SERVICE}/PushFramedStream").future(frames(), timeout=RPC_TIMEOUT)
        try:
            assert denied(call.result) == "a push is a worker's to send, not ps-0's"
        finally:
            ended.set()
    assert len(read) < 16, read  # (16 frames in all: a ps that read the stream had them all before it refused)


def test_a_heartbeat_and_a_workers_steps_come_only_from_their_own_members(servers: Servers, pki: Pki) -> None:
    """worker-0's certificate cannot beat as the chief (heartbeats in a hung chief's name hid it from the
    supervisor: never declared lost, never restarted), run a step on a worker or tell it training is over."""
    beats = servers.start("supervisor", pki.c1)
    assert beats.recorder is not None
    with make_channel(beats.address, pki.c1["worker-0"]) as channel:
        stub = pb_grpc.SupervisorStub(channel)
        spoof = pb.HeartbeatRequest(task="chief:0", incarnation=7, pid=1, global_step=123456789)
        assert denied(lambda: stub.Heartbeat(spoof, timeout=RPC_TIMEOUT, wait_for_ready=True)) == (
            "a heartbeat of chief:0 is chief-0's to send, not worker-0's")
        assert beats.recorder.heartbeats == []
        stub.Heartbeat(pb.HeartbeatRequest(task="worker:0", incarnation=7), timeout=RPC_TIMEOUT)
        assert [hb.task for hb in beats.recorder.heartbeats] == ["worker:0"]
    target = servers.start("worker", pki.c1)
    with make_channel(target.address, pki.c1["worker-1"]) as channel:
        stub = pb_grpc.WorkerStub(channel)
        denied(lambda: stub.RunStep(pb.StepRequest(step_id=1, function="train"), timeout=RPC_TIMEOUT,
                                    wait_for_ready=True))
        denied(lambda: stub.Ping(pb.PingRequest(training_over=True), timeout=RPC_TIMEOUT))
        assert stub.Ping(pb.PingRequest(), timeout=RPC_TIMEOUT).task == "worker:0"  # asking is anyone's
        stub.Ping(pb.PingRequest(chief_incarnation=2**62), timeout=RPC_TIMEOUT)  # ...but it teaches nothing
    with make_channel(target.address, pki.c1["chief-0"]) as channel:  # the chief of incarnation 5: not fenced
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.WorkerStub(channel).RunStep(pb.StepRequest(step_id=1, function="none", chief_incarnation=5),
                                                timeout=RPC_TIMEOUT, wait_for_ready=True)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value  # not ABORTED: replaced
        assert "unknown step function 'none'" in info.value.details()  # type: ignore[attr-defined]
    assert target.calls == ["RunStep", "Ping", "Ping", "Ping", "RunStep"]


# -- files --------------------------------------------------------------------------------------------------------
def private_keys_in(path: Path) -> list[ec.EllipticCurvePrivateKey]:
    keys = []
    text = path.read_bytes()
    marker = b"-----BEGIN PRIVATE KEY-----"
    start = text.find(marker)
    while start != -1:
        end = text.index(b"-----END PRIVATE KEY-----", start) + len(b"-----END PRIVATE KEY-----")
        key = serialization.load_pem_private_key(text[start:end], password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        keys.append(key)
        start = text.find(marker, end)
    return keys


def public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_create_cluster_pki_keeps_every_file_private_and_no_ca_key(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    # An old folder left world-readable, with a stale world-readable key in it: `up` must tighten both.
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    (directory / "ps-0.key").write_text("stale")
    (directory / "ps-0.key").chmod(0o644)
    old_umask = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        files = create_cluster_pki(directory, "c1", MEMBERS)
    finally:
        os.umask(old_umask)
    assert mode(directory) == 0o700
    names = {p.name for p in directory.iterdir()}
    assert names == {"ca.pem"} | {f"{m}.{ext}" for m, _ in MEMBERS for ext in ("key", "pem")}
    for path in directory.iterdir():
        assert path.is_file() and mode(path) == 0o600, f"{path.name} has mode {oct(mode(path))}"
    assert set(files) == {m for m, _ in MEMBERS}
    assert files["ps-0"] == member_files(directory, "ps-0")

    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert private_keys_in(directory / "ca.pem") == []
    ca_public = public_der(ca.public_key())
    keys_seen = 0
    for path in sorted(directory.iterdir()):
        for key in private_keys_in(path):
            keys_seen += 1
            assert public_der(key.public_key()) != ca_public, f"{path.name} holds the CA's private key"
    assert keys_seen == len(MEMBERS)
    now = dt.datetime.now(dt.timezone.utc)
    for member, _address in MEMBERS:
        cert = x509.load_pem_x509_certificate(Path(files[member].cert).read_bytes())
        cert.verify_directly_issued_by(ca)
        (key,) = private_keys_in(Path(files[member].key))
        assert public_der(key.public_key()) == public_der(cert.public_key()), f"{member}: key and cert differ"
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert cert.not_valid_before_utc <= now < cert.not_valid_after_utc
        assert cert.not_valid_after_utc - cert.not_valid_before_utc <= VALIDITY
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert TLS_SERVER_NAME in san.get_values_for_type(x509.DNSName)


SPEC = """\
name: {name}
roles:
  chief: {{}}
  ps: {{replicas: 1}}
  worker: {{replicas: 1}}
training:
  program: {program}
  args: {{hidden_units: 16}}
  data: {{name: digits}}
  batch_size: 50
  optimizer: {{name: adam, learning_rate: 0.01}}
  mode: async
  steps: 100
supervision: {{heartbeat_interval: 0.5s, heartbeat_timeout: 10s}}
"""


def up(psctl_env: Any, name: str, program: str = "psctl.models.mlp") -> dict[str, Any]:
    spec = psctl_env.tmp_path / f"{name}.yaml"
    spec.write_text(SPEC.format(name=name, program=program), encoding="utf-8")
    result = psctl_env.run("up", "--detach", str(spec), timeout=90)
    assert result.returncode == 0, (result.stdout, result.stderr)
    return psctl_env.state(name)  # type: ignore[no-any-return]  # also registers the cluster id for teardown


def address(record: dict[str, Any]) -> str:
    return f"{record['address']}:{record['port']}"


def cluster_environments(psctl_env: Any, cluster_id: str) -> dict[str, dict[str, Any]]:
    """PSCTL_CLUSTER of every live role process of the cluster, by role name."""
    out = {}
    for proc in psctl_env.processes(cluster_id):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if "PSCTL_ROLE" in env and "PSCTL_CLUSTER" in env:
            out[env["PSCTL_ROLE"]] = json.loads(env["PSCTL_CLUSTER"])
    return out


@pytest.mark.slow
def test_up_runs_every_role_over_tls_and_keeps_its_files_private(psctl_env: Any, pki: Pki) -> None:
    name = "sec"
    # its 100 steps held at a second each until the roles are probed: a fast machine finished them before
    hold = Hold(psctl_env.tmp_path / "hold", pause=1.0)
    hold.start()
    state = up(psctl_env, name, str(hold.program))
    cdir = psctl_env.home / name
    tls_dir = cdir / "tls"
    member = member_files(tls_dir, "chief-0")  # the cluster's own credentials, as a role holds them

    def ps_running() -> dict[str, Any] | None:
        record = psctl_env.role(name, "ps-0")
        return record if record["state"] == "running" else None

    ps = address(wait_until(ps_running, timeout=60, what="ps-0 to be running"))
    current = psctl_env.state(name)
    supervisor = current["supervisor_address"]
    worker = address(psctl_env.role(name, "worker-0"))
    assert supervisor and current["tls"] is True

    def member_reaches_the_ps() -> pb.StateResponse:
        with make_channel(ps, member) as channel:
            try:
                return pb_grpc.ParameterServerStub(channel).GetState(  # type: ignore[no-any-return]
                    pb.StateRequest(), timeout=30, wait_for_ready=True
                )
            except grpc.RpcError as exc:
                state_now = psctl_env.state(name)["state"]
                raise AssertionError(f"a member could not reach ps-0 (cluster {state_now}): {exc}") from None

    # Connected with the cluster's own credentials, ps-0 serves (once the chief has given it its variables).
    wait_until(lambda: member_reaches_the_ps().initialized, timeout=60, interval=0.2, what="ps-0 to be initialised")
    # The processes were given TLS files: the cluster's own, under its tls/ folder.
    roles = cluster_environments(psctl_env, state["cluster_id"])
    assert {"ps-0", "worker-0"} <= set(roles), sorted(roles)
    for role, config in roles.items():
        assert config["tls"] == {
            "ca": str(tls_dir / "ca.pem"),
            "cert": str(tls_dir / f"{role}.pem"),
            "key": str(tls_dir / f"{role}.key"),
        }, role
    # ... and their servers use them: plaintext and another cluster's credentials are refused while it runs.
    with grpc.insecure_channel(ps) as channel:
        expect_refused(lambda: pb_grpc.ParameterServerStub(channel).GetState(pb.StateRequest(), timeout=RPC_TIMEOUT))
    with make_channel(ps, pki.c2[CLIENT]) as channel:
        expect_refused(lambda: pb_grpc.ParameterServerStub(channel).GetState(pb.StateRequest(), timeout=RPC_TIMEOUT))
    with grpc.insecure_channel(worker) as channel:
        expect_refused(lambda: pb_grpc.WorkerStub(channel).Ping(pb.PingRequest(), timeout=RPC_TIMEOUT))
    agent = roles["ps-0"]["supervisor"]  # the roles' heartbeats go to their host's agent
    assert agent and agent != supervisor
    with grpc.insecure_channel(agent) as channel:
        hb = pb.HeartbeatRequest(task="ps:0", incarnation=1)
        expect_refused(lambda: pb_grpc.SupervisorStub(channel).Heartbeat(hb, timeout=RPC_TIMEOUT))
    # the supervisor's agent endpoint takes only an agent's certificate, and that of the host it names
    hello = pb.AgentReport(host="localhost", agent_pid=1, hello=True)
    with grpc.insecure_channel(supervisor) as channel:
        expect_refused(lambda: next(pb_grpc.AgentLinkStub(channel).Attach(iter([hello]), timeout=RPC_TIMEOUT)))
    with make_channel(supervisor, member) as channel, pytest.raises(grpc.RpcError) as refused:
        next(pb_grpc.AgentLinkStub(channel).Attach(iter([hello]), timeout=RPC_TIMEOUT))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value  # type: ignore[attr-defined]
    member_reaches_the_ps()  # still up: the refusals above were TLS, not a cluster that had already finished
    hold.release()

    final = wait_until(
        lambda: (s := psctl_env.state(name))["state"] in ("succeeded", "failed", "stopped") and s,
        timeout=120,
        interval=0.2,
        what="the cluster to finish",
    )
    assert final["state"] == "succeeded", final["reason"]
    assert final["roles"][0]["name"] == "chief-0"

    assert mode(cdir) == 0o700
    assert mode(cdir / "state.json") == 0o600
    assert mode(tls_dir) == 0o700
    tls_files = sorted(tls_dir.iterdir())
    assert {p.name for p in tls_files} == {"ca.pem"} | {
        f"{m}.{ext}" for m in ("chief-0", "ps-0", "worker-0", "supervisor", "agent-localhost")
        for ext in ("key", "pem")
    }
    for path in tls_files:
        assert mode(path) == 0o600, f"{path} has mode {oct(mode(path))}"
        assert private_keys_in(path) == [] or path.suffix == ".key"
    assert mode(cdir / "logs") == 0o700
    logs = sorted((cdir / "logs").iterdir())
    assert {p.name for p in logs} >= {"chief-0.1.log", "ps-0.1.log", "worker-0.1.log"}
    for path in logs:
        assert mode(path) == 0o600, f"{path} has mode {oct(mode(path))}"

    result = psctl_env.run("down", name, "--purge")
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert not tls_dir.exists(), "psctl down --purge left the cluster's keys behind"
    assert not (cdir / "state.json").exists()
    assert psctl_env.processes(state["cluster_id"]) == []


@pytest.mark.slow
def test_every_log_and_state_file_of_a_cluster_is_private(psctl_env: Any) -> None:
    name = "priv"
    up(psctl_env, name)
    cdir = psctl_env.home / name
    wait_until(
        lambda: psctl_env.state(name)["state"] in ("succeeded", "failed", "stopped"),
        timeout=120,
        interval=0.2,
        what="the cluster to finish",
    )
    loose = []
    for path in sorted(cdir.rglob("*")):
        if "checkpoints" in path.relative_to(cdir).parts:
            continue  # training results, kept by --purge: not logs or state
        try:
            found, expected = mode(path), 0o700 if path.is_dir() else 0o600
        except FileNotFoundError:
            continue  # a state file's temporary, renamed over it since the walk listed it (the supervisor ends)
        if found != expected:
            loose.append(f"{path.relative_to(cdir)} {oct(found)}")
    assert {p.name for p in cdir.iterdir()} >= {"supervisor.log", "events.jsonl", "run", "logs", "tls", "state.json"}
    assert loose == [], f"files of the cluster readable by others: {loose}"


# -- the spec -----------------------------------------------------------------------------------------------------
REMOTE = textwrap.dedent(
    """\
    name: remote
    hosts:
      - {name: a, address: 10.0.0.11}
    roles:
      chief: {host: a, port: 7000}
      ps: {host: a, port: 7100}
      worker: {host: a, port: 7200}
    training:
      program: psctl.models.mlp
      data: {name: digits}
      steps: 100
    """
)
LOCAL = textwrap.dedent(
    """\
    name: local
    roles:
      chief: {}
      ps: {replicas: 1}
      worker: {replicas: 1}
    training:
      program: psctl.models.mlp
      data: {name: digits}
      steps: 100
    """
)


def test_tls_cannot_be_turned_off_for_a_cluster_on_other_hosts(tmp_path: Path) -> None:
    text = REMOTE + "security: {tls: false}\n"
    with pytest.raises(SpecError) as info:
        load_spec_text(text, filename="remote.yaml")
    message = info.value.format_message()
    assert info.value.exit_code == EXIT_USAGE == 2
    assert "\n" not in message
    line = REMOTE.count("\n") + 1
    assert message.startswith(f"remote.yaml:{line}: security.tls: "), message
    # The command line says the same, in one line, with exit code 2.
    path = tmp_path / "remote.yaml"
    path.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "security.tls" in lines[0], result.stderr
    # The same remote spec is fine with TLS, by default or written out.
    for ok in (REMOTE, REMOTE + "security: {tls: true}\n", REMOTE + "security: {}\n"):
        spec = load_spec_text(ok, filename="remote.yaml")
        assert spec.security.tls is True
        assert len(make_plan(spec, check_ports=False).instances) == 3


def test_tls_can_be_turned_off_only_for_a_local_cluster() -> None:
    assert load_spec_text(LOCAL + "security: {tls: false}\n").security.tls is False
    assert load_spec_text(LOCAL).security.tls is True
    with pytest.raises(SpecError) as info:
        load_spec_text(LOCAL + "security: {tls: 'no'}\n")
    assert "security.tls" in info.value.format_message() and info.value.exit_code == 2
    with pytest.raises(SpecError) as info:
        load_spec_text(LOCAL + "security: {tls: false, ca: x}\n")
    assert "security" in info.value.format_message() and info.value.exit_code == 2


def test_spec_errors_for_security_are_one_line(tmp_path: Path) -> None:
    # A file-based spec names the file the user gave.
    path = tmp_path / "remote.yaml"
    path.write_text(REMOTE + "security:\n  tls: false\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["up", "--dry-run", str(path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert f"{path}:{REMOTE.count(chr(10)) + 2}: security.tls:" in line, line

"""A worker and its PS served in this process over real gRPC on loopback, driven by a real coordinator.

Shared by the worker and push-and-pull tests: ``make(program, num_ps)`` builds one cluster (any number per test);
everything it started is stopped when the test ends.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.coordinator import ClusterCoordinator
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps import SERVER_THREADS, ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.ps_client import PsClient
from psctl.runtime.rpc import make_channel, make_server
from psctl.runtime.worker import WorkerServicer

CLUSTER_ID = "inproc"


class CountingServicer(ParameterServerServicer):
    """A PS servicer that counts the framed pulls and pushes it serves."""

    def __init__(self, store: VariableStore) -> None:
        super().__init__(store)
        self.calls: collections.Counter[str] = collections.Counter()

    def pull_framed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls["pull"] += 1
        return super().pull_framed(request, context)

    def push_frame(self, request: bytes, context: grpc.ServicerContext, sender: str | None) -> bytes:
        self.calls["push"] += 1
        return super().push_frame(request, context, sender)


@dataclass
class Cluster:
    model: ShardedModel
    ps: list[CountingServicer]
    #: The chief's client of the PS (init done with Adam 0.01).
    chief: PsClient
    worker: WorkerServicer
    worker_address: str
    coordinator: ClusterCoordinator
    #: Servers of ps started outside the layout (``spare_ps``): where ``psctl scale ps=N`` reshards onto.
    spare: list[CountingServicer]
    spare_addresses: list[str]

    def pulls(self) -> list[int]:
        return [s.calls["pull"] for s in self.ps]

    def pushes(self) -> list[int]:
        return [s.calls["push"] for s in self.ps]

    def values(self) -> dict[str, bytes]:
        plan = self.model.pull_plan(full=True)
        pulled, _ = self.chief.pull(plan)
        return {e.name: e.array.tobytes() for entries in pulled.values() for e in entries}

    def run_step(self, **fields: Any) -> pb.StepResponse:
        """RunStep straight to the worker, as a chief without params epochs (or a synchronous one) sends it."""
        with make_channel(self.worker_address) as channel:
            return pb_grpc.WorkerStub(channel).RunStep(pb.StepRequest(function="train", **fields), timeout=30)


MakeCluster = Callable[..., Cluster]


def cluster_factory() -> Iterator[MakeCluster]:
    """The body of a fixture: yields ``make(program, num_ps=1, batch_size=20, spare_ps=0, num_shards=1)``, then
    stops all it made."""
    servers: list[grpc.Server] = []
    closers: list[Callable[[], object]] = []

    def make(program: ProgramRef, num_ps: int = 1, batch_size: int = 20, spare_ps: int = 0,
             num_shards: int = 1) -> Cluster:
        loaded = load_program(program)
        model = ShardedModel(loaded, num_ps)
        servicers, addresses = [], []
        for _ in range(num_ps + spare_ps):
            server, port = make_server("127.0.0.1:0", max_workers=SERVER_THREADS)
            servicer = CountingServicer(VariableStore(cluster_id=CLUSTER_ID))
            add_to_server(servicer, server)
            server.start()
            servers.append(server)
            servicers.append(servicer)
            addresses.append(f"127.0.0.1:{port}")
        servicers, spare = servicers[:num_ps], servicers[num_ps:]
        addresses, spare_addresses = addresses[:num_ps], addresses[num_ps:]
        chief = PsClient(addresses, timeout=30)
        worker_ps = PsClient(addresses, timeout=30, sessions=True)  # as the runtime's workers

        def relayout(ps_addresses: Sequence[str]) -> tuple[ShardedModel, PsClient]:
            client = PsClient(ps_addresses, timeout=30, sessions=True)
            closers.append(client.close)
            return ShardedModel(loaded, len(ps_addresses)), client

        closers.extend([chief.close, worker_ps.close])
        chief.init(model.shard_specs(0), pb.OptimizerConfig(name="adam", learning_rate=0.01), CLUSTER_ID)
        worker = WorkerServicer(model, worker_ps, task="worker:0", incarnation=1, batch_size=batch_size,
                                num_shards=num_shards, relayout=relayout)  # fmt: skip
        server, port = make_server("127.0.0.1:0")
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        server.start()
        servers.append(server)
        coordinator = ClusterCoordinator([f"127.0.0.1:{port}"], probe_interval=0.05)
        closers.append(coordinator.shutdown)
        assert coordinator.wait_for_workers(10) == 1
        return Cluster(model, servicers, chief, worker, f"127.0.0.1:{port}", coordinator, spare, spare_addresses)

    try:
        yield make
    finally:
        for close in reversed(closers):
            close()
        for server in servers:
            server.stop(grace=None).wait()

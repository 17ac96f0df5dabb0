"""One round trip per PS per asynchronous step: a worker's push brings back the variables its next step uses.

A worker and its PS (registered as the runtime does, counting the framed rpcs they get) in-process over real gRPC,
driven through the coordinator or straight through RunStep.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.coordinator import ClusterCoordinator
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps import ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.rpc import make_channel, make_server
from psctl.runtime.wire import DENSE, Entry
from psctl.runtime.worker import WorkerServicer

BATCH = 20
MLP = ProgramRef("psctl.models.mlp", {"hidden_units": 8}, {"name": "digits"}, 0)
EMBEDDING = ProgramRef(
    "psctl.models.wide_embedding",
    {"dim": 4, "vocab_size": 100},
    {"name": "synthetic_embedding", "num_examples": 500, "vocab_size": 100, "ids_per_example": 3},
    0,
)


class CountingServicer(ParameterServerServicer):
    """Counts the framed pulls and pushes it serves."""

    def __init__(self, store: VariableStore) -> None:
        super().__init__(store)
        self.calls: collections.Counter[str] = collections.Counter()

    def pull_framed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls["pull"] += 1
        return super().pull_framed(request, context)

    def push_framed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.calls["push"] += 1
        return super().push_framed(request, context)


@dataclass
class Cluster:
    model: ShardedModel
    ps: list[CountingServicer]
    chief: PsClient
    worker_address: str
    coordinator: ClusterCoordinator

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


@pytest.fixture
def make_cluster() -> Iterator[Any]:
    servers: list[grpc.Server] = []
    closers: list[Any] = []

    def make(ref: ProgramRef = MLP, num_ps: int = 2) -> Cluster:
        program = load_program(ref)
        model = ShardedModel(program, num_ps)
        servicers, addresses = [], []
        for _ in range(num_ps):
            server, port = make_server("127.0.0.1:0")
            servicer = CountingServicer(VariableStore(cluster_id="pp"))
            add_to_server(servicer, server)
            server.start()
            servers.append(server)
            servicers.append(servicer)
            addresses.append(f"127.0.0.1:{port}")
        chief = PsClient(addresses, timeout=30)
        worker_ps = PsClient(addresses, timeout=30)
        closers.extend([chief.close, worker_ps.close])
        chief.init(model.shard_specs(0), pb.OptimizerConfig(name="adam", learning_rate=0.01), "pp")
        worker = WorkerServicer(model, worker_ps, task="worker:0", incarnation=1, batch_size=BATCH, num_shards=1)
        server, port = make_server("127.0.0.1:0")
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        server.start()
        servers.append(server)
        coordinator = ClusterCoordinator([f"127.0.0.1:{port}"], probe_interval=0.05)
        closers.append(coordinator.shutdown)
        assert coordinator.wait_for_workers(10) == 1
        return Cluster(model, servicers, chief, f"127.0.0.1:{port}", coordinator)

    try:
        yield make
    finally:
        for close in reversed(closers):
            close()
        for server in servers:
            server.stop(grace=None).wait()


def _train(cluster: Cluster, steps: int) -> list[pb.StepResponse]:
    return [cluster.coordinator.schedule("train").fetch(timeout=30) for _ in range(steps)]


def test_asynchronous_steps_after_the_first_cost_one_round_trip_per_ps(make_cluster: Any) -> None:
    cluster = make_cluster(num_ps=2)
    responses = _train(cluster, 6)
    assert all(r.applied for r in responses)
    assert [r.global_step for r in responses] == [1, 2, 3, 4, 5, 6]
    assert cluster.pulls() == [1, 1]  # the first step only
    assert cluster.pushes() == [6, 6]


def test_the_variables_a_push_brings_back_are_exactly_those_a_pull_would_get(make_cluster: Any) -> None:
    # One worker: nothing else changes the PS between its steps, so reusing the push's answer must give the very
    # variables, bit for bit, that pulling afresh gives (params_epoch 0: the worker pulls every step).
    reused, pulled = make_cluster(num_ps=2), make_cluster(num_ps=2)
    _train(reused, 5)
    for step in range(1, 6):
        assert pulled.run_step(step_id=step, shard=0, position=step - 1).applied
    assert pulled.pulls() == [5, 5] and reused.pulls() == [1, 1]
    assert reused.values() == pulled.values()


def test_a_new_params_epoch_makes_the_worker_pull_again(make_cluster: Any) -> None:
    cluster = make_cluster(num_ps=1)
    _train(cluster, 3)
    assert cluster.pulls() == [1]
    cluster.coordinator.recover({0: 3})  # as after a restore: the variables may all have been replaced
    _train(cluster, 2)
    assert cluster.pulls() == [2]
    # a step of another epoch (another chief) pulls too, and so does one after it of a third
    assert cluster.run_step(step_id=100, shard=0, position=10, params_epoch=7).applied
    assert cluster.pulls() == [3]
    assert cluster.run_step(step_id=101, shard=0, position=11, params_epoch=7).applied
    assert cluster.pulls() == [3]  # same epoch 7: reused
    assert cluster.pushes() == [7]


def test_synchronous_steps_and_embedding_models_pull_every_step(make_cluster: Any) -> None:
    cluster = make_cluster(num_ps=1)
    for step in range(1, 4):
        cluster.run_step(step_id=step, shard=0, position=step - 1, sync_step=step, params_epoch=5)
    assert cluster.pulls() == [3]  # a synchronous step must see its own round's variables
    embedding = make_cluster(EMBEDDING, num_ps=2)
    _train(embedding, 3)
    assert embedding.pulls() == [3, 3]  # the rows a batch needs depend on the batch


def test_an_evaluate_step_between_train_steps_keeps_the_reused_variables_valid(make_cluster: Any) -> None:
    cluster = make_cluster(num_ps=1)
    _train(cluster, 2)
    response = cluster.coordinator.schedule("evaluate", shard=0, position=0).fetch(timeout=30)
    assert response.global_step == 2
    _train(cluster, 2)
    assert cluster.pushes() == [4]
    assert cluster.pulls() == [2]  # the first train step, and the evaluate step's own pull


def test_push_pull_of_a_whole_dense_model_matches_a_pull(make_cluster: Any) -> None:
    cluster = make_cluster(num_ps=2)
    plan = cluster.model.pull_plan({})
    names = {ps: [e.name for e in entries] for ps, entries in plan.items()}
    zeros = {ps: [Entry(e.name, DENSE, np.zeros(cluster.model.layouts[e.name].variable.shape, np.float32))
                  for e in entries] for ps, entries in plan.items()}  # fmt: skip
    _, after = cluster.chief.push_pull(PushHeader(step_id=1, task="worker:9", incarnation=1), zeros, names)
    pulled, _ = cluster.chief.pull(plan)
    for ps in plan:
        assert [(e.name, e.array.tobytes()) for e in after[ps]] == [(e.name, e.array.tobytes()) for e in pulled[ps]]

"""A worker and a PS served in-process over real gRPC on loopback, driven through the coordinator."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.coordinator import ClusterCoordinator
from psctl.runtime.evaluation import evaluate_batch
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps import ParameterServerServicer, VariableStore
from psctl.runtime.ps_client import PsClient
from psctl.runtime.rpc import make_server
from psctl.runtime.worker import WorkerServicer

BATCH = 50


@pytest.fixture
def cluster() -> Iterator[tuple[ClusterCoordinator, ShardedModel, PsClient, WorkerServicer]]:
    servers: list[grpc.Server] = []
    clients: list[PsClient] = []
    coordinator = None
    try:
        ps_server, ps_port = make_server("127.0.0.1:0")
        pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(VariableStore(cluster_id="w")), ps_server)
        ps_server.start()
        servers.append(ps_server)
        program = load_program(ProgramRef("psctl.models.mlp", {"hidden_units": 16}, {"name": "digits"}, 0))
        model = ShardedModel(program, 1)
        chief_ps = PsClient([f"127.0.0.1:{ps_port}"], timeout=10)
        clients.append(chief_ps)
        chief_ps.init(model.shard_specs(0), pb.OptimizerConfig(name="adam", learning_rate=0.01), "w")
        worker_ps = PsClient([f"127.0.0.1:{ps_port}"], timeout=10)
        clients.append(worker_ps)
        servicer = WorkerServicer(model, worker_ps, task="worker:0", incarnation=1, batch_size=BATCH, num_shards=1)
        worker_server, worker_port = make_server("127.0.0.1:0")
        pb_grpc.add_WorkerServicer_to_server(servicer, worker_server)
        worker_server.start()
        servers.append(worker_server)
        coordinator = ClusterCoordinator([f"127.0.0.1:{worker_port}"], probe_interval=0.05)
        assert coordinator.wait_for_workers(10) == 1
        yield coordinator, model, chief_ps, servicer
    finally:
        if coordinator is not None:
            coordinator.shutdown()
        for client in clients:
            client.close()
        for server in servers:
            server.stop(grace=None).wait()


def test_train_steps_advance_the_global_step_and_consume_consecutive_batches(cluster) -> None:
    coordinator, _model, ps, _servicer = cluster
    values = [coordinator.schedule("train") for _ in range(5)]
    coordinator.join(timeout=30)
    responses = ClusterCoordinator.fetch(values)
    assert ps.state(0).global_step == 5
    assert all(r.examples == BATCH and r.applied for r in responses)
    assert list(ps.state(0).shard_positions) == [4]  # batches 0..4 of shard 0, each once


def test_an_evaluate_step_returns_the_programs_metrics_on_that_test_batch(cluster) -> None:
    coordinator, model, ps, servicer = cluster
    for _ in range(3):
        coordinator.schedule("train")
    coordinator.join(timeout=30)
    response = coordinator.schedule("evaluate", shard=0, position=2).fetch(timeout=30)
    want, step = evaluate_batch(model, ps, servicer.dataset("test", 0).batch(2, BATCH))
    assert step == response.global_step == 3
    assert set(response.metrics) >= {"loss", "accuracy"}
    assert response.metrics["accuracy"] == pytest.approx(want["accuracy"])
    assert response.loss == pytest.approx(want["loss"], rel=1e-6)
    assert response.examples == BATCH
    assert ps.state(0).global_step == 3  # evaluating changed nothing

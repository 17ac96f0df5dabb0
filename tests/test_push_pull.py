"""One round trip per PS per asynchronous step: a worker's push brings back the variables its next step uses.

A worker and its PS (registered as the runtime does, counting the framed rpcs they get) in-process over real gRPC,
driven through the coordinator or straight through RunStep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from inprocess_cluster import Cluster, MakeCluster, cluster_factory

from psctl.proto import psctl_pb2 as pb
from psctl.runtime import limits
from psctl.runtime import worker as worker_module
from psctl.runtime.program import ProgramRef
from psctl.runtime.ps_client import PushHeader
from psctl.runtime.wire import DENSE, Entry

MLP = ProgramRef("psctl.models.mlp", {"hidden_units": 8}, {"name": "digits"}, 0)
EMBEDDING = ProgramRef(
    "psctl.models.wide_embedding",
    {"dim": 4, "vocab_size": 100},
    {"name": "synthetic_embedding", "num_examples": 500, "vocab_size": 100, "ids_per_example": 3},
    0,
)


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    yield from cluster_factory()


def _train(cluster: Cluster, steps: int) -> list[pb.StepResponse]:
    return [cluster.coordinator.schedule("train").fetch(timeout=30) for _ in range(steps)]


def test_asynchronous_steps_after_the_first_cost_one_round_trip_per_ps(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(MLP, num_ps=2)
    responses = _train(cluster, 6)
    assert all(r.applied for r in responses)
    assert [r.global_step for r in responses] == [1, 2, 3, 4, 5, 6]
    assert cluster.pulls() == [1, 1]  # the first step only
    assert cluster.pushes() == [6, 6]


def test_a_model_of_several_mib_per_ps_still_costs_one_unary_round_trip_per_step(make_cluster: MakeCluster) -> None:
    # 3.6 MB on the one ps (a 64 x 12,288 kernel): one message each way, the push bringing the variables back
    wide = ProgramRef("psctl.models.mlp", {"hidden_units": 12_288}, {"name": "digits"}, 0)
    cluster = make_cluster(wide, num_ps=1)
    assert 2 << 20 < cluster.model.pull_bytes(cluster.model.pull_plan())[0] <= limits.UNARY_MAX_BYTES
    assert all(r.applied for r in _train(cluster, 4))
    assert cluster.pulls() == [1] and cluster.pushes() == [4]  # neither streamed nor pulled again


def test_the_variables_a_push_brings_back_are_exactly_those_a_pull_would_get(make_cluster: MakeCluster) -> None:
    # One worker: nothing else changes the PS between its steps, so reusing the push's answer must give the very
    # variables, bit for bit, that pulling afresh gives (params_epoch 0: the worker pulls every step).
    reused, pulled = make_cluster(MLP, num_ps=2), make_cluster(MLP, num_ps=2)
    _train(reused, 5)
    for step in range(1, 6):
        assert pulled.run_step(step_id=step, shard=0, position=step - 1).applied
    assert pulled.pulls() == [5, 5] and reused.pulls() == [1, 1]
    assert reused.values() == pulled.values()


def test_a_new_params_epoch_makes_the_worker_pull_again(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(MLP, num_ps=1)
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


def test_synchronous_steps_pull_every_step(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(MLP, num_ps=1)
    for step in range(1, 4):
        cluster.run_step(step_id=step, shard=0, position=step - 1, sync_step=step, params_epoch=5)
    assert cluster.pulls() == [3]  # a synchronous step must see its own round's variables
    embedding = make_cluster(EMBEDDING, num_ps=1)
    for step in range(1, 4):
        embedding.run_step(step_id=step, shard=0, position=step - 1, sync_step=step, params_epoch=5)
    assert embedding.pulls() == [3]


def test_an_embedding_model_s_steps_one_a_call_pull_for_the_first_only(make_cluster: MakeCluster) -> None:
    # through the coordinator: each call's push brings back the rows of the batch after it, which the next call
    # on this worker's data shard starts at
    embedding = make_cluster(EMBEDDING, num_ps=2)
    assert [r.global_step for r in _train(embedding, 4)] == [1, 2, 3, 4]
    assert embedding.pulls() == [1, 1] and embedding.pushes() == [4, 4]


def test_a_call_of_several_embedding_steps_pulls_for_its_first_step_only(make_cluster: MakeCluster) -> None:
    # each push asks back the rows (and dense shards) of the call's next batch: one round trip per ps per step
    cluster = make_cluster(EMBEDDING, num_ps=2)
    response = cluster.run_step(step_id=1, shard=0, position=0, steps=5)
    assert response.steps == 5 and response.applied and response.global_step == 5
    assert cluster.pulls() == [1, 1] and cluster.pushes() == [5, 5]
    assert cluster.run_step(step_id=10, shard=0, position=5, steps=3).global_step == 8
    assert cluster.pulls() == [2, 2]  # a new call pulls for its first step: its batch was not known before


def test_the_rows_a_push_brings_back_are_exactly_those_a_pull_would_get(make_cluster: MakeCluster) -> None:
    # One worker: calls of several steps (within a call, and from one call to the next of the same params epoch)
    # against calls of one step, each pulling: the same variables, bit for bit
    ahead, pulled = make_cluster(EMBEDDING, num_ps=2), make_cluster(EMBEDDING, num_ps=2)
    assert ahead.run_step(step_id=1, shard=0, position=0, steps=4, params_epoch=3).global_step == 4
    assert ahead.run_step(step_id=5, shard=0, position=4, steps=3, params_epoch=3).global_step == 7
    for step in range(1, 8):
        assert pulled.run_step(step_id=step, shard=0, position=step - 1).applied
    assert ahead.pulls() == [1, 1] and pulled.pulls() == [7, 7]
    assert ahead.values() == pulled.values()
    assert ahead.values() != make_cluster(EMBEDDING, num_ps=2).values()  # (and training did move them)


def test_a_call_s_last_push_brings_back_the_next_call_s_first_rows_only_where_it_starts_there(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(EMBEDDING, num_ps=2, num_shards=2)
    assert cluster.run_step(step_id=1, shard=0, position=0, steps=2, params_epoch=5).applied
    assert cluster.run_step(step_id=3, shard=0, position=2, steps=2, params_epoch=5).applied
    assert cluster.pulls() == [1, 1]  # the second call started where the first one's last push read ahead
    assert cluster.run_step(step_id=5, shard=0, position=9, steps=2, params_epoch=5).applied
    assert cluster.pulls() == [2, 2]  # another position: not the batch read ahead
    assert cluster.run_step(step_id=7, shard=1, position=11, steps=2, params_epoch=5).applied
    assert cluster.pulls() == [3, 3]  # the next position, of another data shard
    assert cluster.run_step(step_id=9, shard=1, position=13, steps=2, params_epoch=6).applied
    assert cluster.pulls() == [4, 4]  # a new params epoch: the variables may have been replaced meanwhile
    assert cluster.run_step(step_id=11, shard=1, position=15, steps=2).applied
    assert cluster.run_step(step_id=13, shard=1, position=17, steps=2).applied
    assert cluster.pulls() == [6, 6]  # no params epoch (a chief that sends none): nothing is kept across calls
    assert cluster.pushes() == [14, 14]


def _before_each_batch(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, before: Callable[[int], object]) -> None:
    """Make the worker's training data (shard 0) call ``before(position)`` ahead of reading each batch."""
    dataset = cluster.worker.dataset("train", 0)
    read = dataset.batch

    def batch(position: int, batch_size: int) -> Any:
        before(position)
        return read(position, batch_size)

    monkeypatch.setattr(dataset, "batch", batch)


def test_a_batch_read_ahead_counts_as_its_own_step_s_input_not_the_push_it_preceded(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what psctl top shows: each step's input+pull, compute and push time (a slow input here: 0.1 s a batch)
    cluster = make_cluster(EMBEDDING, num_ps=1)
    _before_each_batch(cluster, monkeypatch, lambda _position: time.sleep(0.1))
    phases: list[dict[str, float]] = []
    monkeypatch.setattr(cluster.worker.stats, "record", lambda **kw: phases.append(kw))
    assert cluster.run_step(step_id=1, shard=0, position=0, steps=4).steps == 4
    assert cluster.pulls() == [1]  # (the batches after the first were read ahead)
    assert len(phases) == 4 and all(p["pull"] >= 0.1 and p["push"] < 0.1 for p in phases), phases


def test_data_that_ends_after_a_call_s_last_batch_fails_no_step(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a program's dataset may end: reading ahead past its end must not fail the steps before it
    cluster = make_cluster(EMBEDDING, num_ps=1)

    def three_batches(position: int) -> None:
        if position >= 3:
            raise IndexError(f"no batch {position}: the data has 3")

    _before_each_batch(cluster, monkeypatch, three_batches)
    assert cluster.run_step(step_id=1, shard=0, position=0, steps=3, params_epoch=4).global_step == 3
    with pytest.raises(grpc.RpcError) as failed:  # the step that needs the missing batch says so
        cluster.run_step(step_id=4, shard=0, position=3, params_epoch=4)
    assert "no batch 3" in failed.value.details()  # type: ignore[attr-defined]


def test_rows_that_do_not_fit_one_message_are_pulled_by_the_step_itself(
    make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = make_cluster(EMBEDDING, num_ps=1)
    monkeypatch.setattr(worker_module, "UNARY_MAX_BYTES", 64)  # less than any batch's rows
    assert cluster.run_step(step_id=1, shard=0, position=0, steps=3).global_step == 3
    assert cluster.pulls() == [3] and cluster.pushes() == [3]


def test_an_evaluate_step_between_train_steps_keeps_the_reused_variables_valid(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(MLP, num_ps=1)
    _train(cluster, 2)
    response = cluster.coordinator.schedule("evaluate", shard=0, position=0).fetch(timeout=30)
    assert response.global_step == 2
    _train(cluster, 2)
    assert cluster.pushes() == [4]
    assert cluster.pulls() == [2]  # the first train step, and the evaluate step's own pull


def test_push_pull_of_a_whole_dense_model_matches_a_pull(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(MLP, num_ps=2)
    plan = cluster.model.pull_plan({})
    zeros = {ps: [Entry(e.name, DENSE, np.zeros(cluster.model.layouts[e.name].variable.shape, np.float32))
                  for e in entries] for ps, entries in plan.items()}  # fmt: skip
    _, after = cluster.chief.push_pull(PushHeader(step_id=1, task="worker:9", incarnation=1), zeros, plan)
    pulled, _ = cluster.chief.pull(plan)
    for ps in plan:
        assert [(e.name, e.array.tobytes()) for e in after[ps]] == [(e.name, e.array.tobytes()) for e in pulled[ps]]

"""A worker and a PS served in-process over real gRPC on loopback, driven through the coordinator."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from cluster_helpers import wait_until
from inprocess_cluster import MakeCluster, cluster_factory

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import worker as worker_module
from psctl.runtime.cluster import ClusterInfo
from psctl.runtime.coordinator import (
    AUTO,
    AUTO_DEADLINE_FACTOR,
    AUTO_DEADLINE_FLOOR,
    MAX_DEADLINE,
    Closure,
    ClusterCoordinator,
    RemoteValue,
)
from psctl.runtime.evaluation import evaluate_batch
from psctl.runtime.fencing import ChiefFence, ChiefReplaced
from psctl.runtime.heartbeat import ClusterAddresses, Heartbeater, Progress, tasks_of
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef
from psctl.runtime.ps import ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.ps_client import PsClient
from psctl.runtime.rpc import make_server
from psctl.runtime.worker import WorkerServicer

BATCH = 50
MLP = ProgramRef("psctl.models.mlp", {"hidden_units": 16}, {"name": "digits"}, 0)


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    yield from cluster_factory()


@pytest.fixture
def cluster(make_cluster: MakeCluster) -> tuple[ClusterCoordinator, ShardedModel, PsClient, WorkerServicer]:
    """One worker and one PS: (its coordinator, the model, the chief's PS client, the worker's servicer)."""
    made = make_cluster(MLP, num_ps=1, batch_size=BATCH)
    return made.coordinator, made.model, made.chief, made.worker


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


def test_the_coordinator_follows_a_worker_restarted_at_another_address(cluster) -> None:
    """A worker moved to another host of its pool: the chief is told its new address and sends steps there."""
    coordinator, model, ps, _old = cluster
    for _ in range(3):
        coordinator.schedule("train")
    coordinator.join(timeout=30)
    events: list[str] = []
    coordinator.on_worker_event = events.append
    worker_ps = PsClient(list(ps.addresses), timeout=10)
    progress = Progress()
    moved = WorkerServicer(model, worker_ps, task="worker:0", incarnation=2, batch_size=BATCH, num_shards=1,
                           progress=progress)
    server, port = make_server("127.0.0.1:0")
    pb_grpc.add_WorkerServicer_to_server(moved, server)
    server.start()
    try:
        coordinator.set_worker_address(0, f"127.0.0.1:{port}")
        for _ in range(4):
            coordinator.schedule("train")
        coordinator.join(timeout=30)
    finally:
        server.stop(grace=None).wait()
        worker_ps.close()
    assert progress.local_step == 4  # every step after the move ran on the moved worker
    assert ps.state(0).global_step == 7
    assert list(ps.state(0).shard_positions) == [6]  # its input went on where it was: batches 3..6
    assert coordinator.workers[0].address == f"127.0.0.1:{port}"
    assert any("moved from" in e for e in events) and any("back as a new process" in e for e in events)


def test_a_worker_scaled_away_before_training_starts_is_not_waited_for(cluster) -> None:
    """`psctl scale worker=1` as the chief starts: it waited out its whole ready timeout (120 s) for a worker
    that was gone, training at step 0 meanwhile."""
    coordinator, _model, _ps, _worker = cluster
    here = coordinator.workers[0].address
    coordinator.set_workers({0: here, 1: "127.0.0.1:1"})  # a worker that never answers (nothing listens there)...
    coordinator.set_workers({0: here})  # ...scaled away again
    started = time.monotonic()
    assert coordinator.wait_for_workers(30) == 1
    assert time.monotonic() - started < 10  # not the whole timeout


def test_cluster_addresses_reach_subscribers_when_they_change() -> None:
    book = ClusterAddresses()
    seen: list[dict[str, str]] = []
    unsubscribe = book.subscribe(seen.append)
    book.update({"worker:0": "a:1", "worker:1": "b:2"})
    book.update({"worker:0": "a:1", "worker:1": "b:2"})  # the same again: nothing new
    book.update({"worker:0": "a:1", "worker:1": "c:2"})
    unsubscribe()
    book.update({"worker:0": "d:1", "worker:1": "c:2"})
    assert seen == [{"worker:0": "a:1", "worker:1": "b:2"}, {"worker:0": "a:1", "worker:1": "c:2"}]
    assert book.known() == {"worker:0": "d:1", "worker:1": "c:2"}
    assert tasks_of("ps", {"ps:1": "x:1", "worker:0": "y:2", "ps:": "z:3"}) == {1: "x:1"}


def test_a_ps_client_follows_a_ps_to_its_new_address(cluster) -> None:
    """A ps restarted on another host: the client's calls go to the new address, also a wait already begun."""
    _coordinator, _model, ps, _servicer = cluster
    old_address = ps.addresses[0]
    client = PsClient([old_address], timeout=10)
    server, port = make_server("127.0.0.1:0")
    add_to_server(ParameterServerServicer(VariableStore(cluster_id="w")), server)
    server.start()
    try:
        client.set_address(0, "127.0.0.1:1")  # nothing listens there: a wait blocks...
        waiting = threading.Thread(target=client.wait_ready, args=(20,))
        started = time.monotonic()
        waiting.start()
        client.follow({"ps:0": f"127.0.0.1:{port}", "worker:0": "ignored:1"})  # ...until the ps is found moved
        waiting.join(timeout=20)
        assert not waiting.is_alive() and time.monotonic() - started < 5
        assert client.addresses == [f"127.0.0.1:{port}"]
        assert client.state(0).initialized is False  # the new, empty ps answers; the old one had variables
        assert ps.state(0).initialized is True
    finally:
        client.close()
        server.stop(grace=None).wait()


def two_steps_in_flight(address: str, *, step_id_base: int, calls: int, steps: int) -> list[object]:
    """A chief's coordinator with two calls in flight on the worker at ``address``: ``calls`` train calls of
    ``steps`` steps each, run to the end; their remote values."""
    coordinator = ClusterCoordinator([address], probe_interval=0.05, steps_in_flight=2, step_id_base=step_id_base)
    try:
        assert coordinator.wait_for_workers(10) == 1
        values = [coordinator.schedule("train", steps=steps) for _ in range(calls)]
        coordinator.join(timeout=60)
    finally:
        coordinator.shutdown()
    return values


@pytest.mark.parametrize("pipelined", [True, False])
def test_two_steps_in_flight_per_worker_apply_each_step_and_batch_once(cluster, pipelined: bool) -> None:
    """Two steps in flight per worker (asynchronous training): queued and run one at a time by default, run at
    once when pipelined; either way every step is applied once and every batch used once."""
    first, _model, ps, servicer = cluster
    first.shutdown()
    if pipelined:
        servicer._serial = None  # as the runtime builds a worker for training.pipelined
    active, most, arrived_together = [0], [0], threading.Event()
    lock = threading.Lock()
    train, train_now = servicer._train, servicer._train_now

    def arriving(request: pb.StepRequest) -> pb.StepResponse:
        with lock:
            active[0] += 1
            if active[0] == 2:
                arrived_together.set()  # the chief really had two steps on this worker at once
        try:
            return train(request)
        finally:
            with lock:
                active[0] -= 1

    running = [0]

    def computing(request: pb.StepRequest, one_thread: bool) -> pb.StepResponse:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.002)  # a step long enough for the other one to arrive meanwhile
            return train_now(request, one_thread)
        finally:
            with lock:
                running[0] -= 1

    servicer._train = arriving  # type: ignore[method-assign]
    servicer._train_now = computing  # type: ignore[method-assign]
    values = two_steps_in_flight(first.workers[0].address, step_id_base=1000, calls=40, steps=1)
    assert arrived_together.is_set()
    assert most[0] == (2 if pipelined else 1)  # pipelined steps compute at once; queued ones one after another
    assert all(r.applied for r in ClusterCoordinator.fetch(values))
    state = ps.state(0, include_step_ids=True)
    assert state.global_step == 40 and state.duplicate_updates == 0
    assert sorted(state.applied_step_ids) == list(range(1001, 1041))
    assert list(state.shard_positions) == [39]  # batches 0..39 of shard 0
    with pytest.raises(ValueError, match="asynchronous training only"):
        ClusterCoordinator(["127.0.0.1:1"], steps_in_flight=2, staleness=2)


def test_several_steps_per_call_apply_each_step_and_batch_once(cluster) -> None:
    """steps_per_execution: one RunStep runs several steps, each with its own step id and batch."""
    coordinator, _model, ps, _servicer = cluster
    values = [coordinator.schedule("train", steps=5) for _ in range(3)] + [coordinator.schedule("train")]
    coordinator.join(timeout=60)
    responses = ClusterCoordinator.fetch(values)
    assert [r.steps for r in responses] == [5, 5, 5, 1]
    assert [r.examples for r in responses] == [5 * BATCH] * 3 + [BATCH]
    assert all(r.applied for r in responses)
    assert [r.global_step for r in responses] == [5, 10, 15, 16]
    state = ps.state(0, include_step_ids=True)
    assert state.global_step == 16 and state.duplicate_updates == 0
    assert sorted(state.applied_step_ids) == list(range(1, 17))  # the ids each closure reserved, once each
    assert list(state.shard_positions) == [15]  # batches 0..15 of shard 0
    with pytest.raises(ValueError, match="asynchronous training steps only"):
        coordinator.schedule("train", steps=2, sync_step=0)


def test_a_training_step_s_automatic_deadline_follows_the_slowest_step_seen(cluster) -> None:
    """step_timeout auto (the default): no deadline before a first step ends (data loading, connecting), then
    AUTO_DEADLINE_FACTOR times the slowest step seen, at least AUTO_DEADLINE_FLOOR, for each step of a call; an
    evaluation has none. An explicit timeout counts for each step of a call, 0 for none."""
    coordinator, _model, _ps, _servicer = cluster
    assert coordinator.step_timeout == AUTO and coordinator.slowest_step is None
    train = Closure("train", 1, RemoteValue(), steps=4)
    assert coordinator._deadline(train) is None
    coordinator.schedule("train", steps=3)
    coordinator.join(timeout=60)
    slowest = coordinator.slowest_step
    assert slowest is not None and 0 < slowest < AUTO_DEADLINE_FLOOR / AUTO_DEADLINE_FACTOR
    assert coordinator._deadline(train) == 4 * AUTO_DEADLINE_FLOOR
    coordinator.slowest_step = 10.0  # (a slow model: its steps' own length decides)
    assert coordinator._deadline(train) == 4 * 10.0 * AUTO_DEADLINE_FACTOR
    assert coordinator._deadline(Closure("evaluate", 2, RemoteValue())) is None
    train.expired = 2  # (each time it ran past its deadline doubles the next)
    assert coordinator._deadline(train) == 4 * 10.0 * AUTO_DEADLINE_FACTOR * 4
    train.expired = 2000  # (up to a week: doubled without end it overflowed, and the chief failed)
    assert coordinator._deadline(train) == MAX_DEADLINE
    train.expired = 0
    coordinator.step_timeout = 2.5
    assert coordinator._deadline(train) == 10.0 and coordinator._deadline(Closure("evaluate", 2, RemoteValue())) == 2.5
    coordinator.step_timeout = 0.0
    assert coordinator._deadline(train) is None


def test_pipelined_calls_of_several_steps_compute_each_step_while_the_last_push_travels(cluster) -> None:
    """Pipelined training with several steps per call: one thread runs a call's steps, each computed while the
    previous step's push is unanswered (on the variables the push before brought back), calls one at a time;
    every step applied once, every batch used once, and each reply's steps counted once."""
    first, _model, ps, servicer = cluster
    first.shutdown()
    servicer._serial = None  # as the runtime builds a worker for training.pipelined
    outstanding, seen, calls, most_calls = [0], [], [0], [0]
    lock = threading.Lock()
    start_push_pull, train_now = servicer.ps.start_push_pull, servicer._train_now
    program = servicer.model.program
    loss_and_grads = program.loss_and_grads

    def starting(*args, **kwargs):  # type: ignore[no-untyped-def]
        answers = start_push_pull(*args, **kwargs)
        with lock:
            outstanding[0] += 1

        def answered():  # type: ignore[no-untyped-def]
            try:
                return answers()
            finally:
                with lock:
                    outstanding[0] -= 1

        return answered

    def computing(params, batch):  # type: ignore[no-untyped-def]
        with lock:
            seen.append(outstanding[0])
        return loss_and_grads(params, batch)

    def one_call(request: pb.StepRequest, one_thread: bool) -> pb.StepResponse:
        assert one_thread
        with lock:
            calls[0] += 1
            most_calls[0] = max(most_calls[0], calls[0])
        try:
            time.sleep(0.002)  # long enough for the chief's second call to arrive meanwhile
            return train_now(request, one_thread)
        finally:
            with lock:
                calls[0] -= 1

    servicer.ps.start_push_pull = starting  # type: ignore[method-assign]
    program.loss_and_grads = computing  # type: ignore[method-assign]
    servicer._train_now = one_call  # type: ignore[method-assign]
    try:
        values = two_steps_in_flight(first.workers[0].address, step_id_base=2000, calls=6, steps=5)
    finally:
        program.loss_and_grads = loss_and_grads  # type: ignore[method-assign]
    responses = ClusterCoordinator.fetch(values)
    assert [r.steps for r in responses] == [5] * 6 and all(r.applied for r in responses)
    assert most_calls[0] == 1  # calls one at a time: the overlap is within a call
    assert seen == [0, 1, 1, 1, 1] * 6  # every step but a call's first computed with the last push unanswered
    assert outstanding[0] == 0
    state = ps.state(0, include_step_ids=True)
    assert state.global_step == 30 and state.duplicate_updates == 0
    assert sorted(state.applied_step_ids) == list(range(2001, 2031))
    assert list(state.shard_positions) == [29]  # batches 0..29 of shard 0


def test_a_pipelined_call_whose_step_fails_lands_the_push_on_its_way_and_reports_the_failure(cluster) -> None:
    """A program error in a pipelined call's third step: the second step's push, already sent, is applied and
    answered before the call fails (nothing left in flight), and the failure reaches the chief as a program
    error."""
    coordinator, _model, ps, servicer = cluster
    servicer._serial = None
    program = servicer.model.program
    loss_and_grads, computed = program.loss_and_grads, [0]

    def failing_third(params, batch):  # type: ignore[no-untyped-def]
        computed[0] += 1
        if computed[0] == 3:
            raise ValueError("bad batch")
        return loss_and_grads(params, batch)

    program.loss_and_grads = failing_third  # type: ignore[method-assign]
    stub = pb_grpc.WorkerStub(coordinator._channels[0])
    try:
        with pytest.raises(grpc.RpcError) as failed:
            stub.RunStep(pb.StepRequest(step_id=700, shard=0, position=0, function="train", steps=4,
                                        params_epoch=9), timeout=30)
    finally:
        program.loss_and_grads = loss_and_grads  # type: ignore[method-assign]
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "program error: ValueError: bad batch" in failed.value.details()
    state = ps.state(0, include_step_ids=True)
    assert sorted(state.applied_step_ids) == [700, 701] and state.global_step == 2


def test_a_retried_call_of_several_steps_applies_only_the_steps_not_yet_applied(cluster) -> None:
    """A call that died after some of its steps were pushed is re-run whole elsewhere: the PS refuses the
    steps it already applied (same ids) and applies the rest, so every step is applied exactly once."""
    coordinator, _model, ps, _servicer = cluster
    stub = pb_grpc.WorkerStub(coordinator._channels[0])

    def call(steps: int) -> pb.StepResponse:
        request = pb.StepRequest(step_id=500, shard=0, position=100, function="train", steps=steps, params_epoch=7)
        return stub.RunStep(request, timeout=30)

    assert call(2).applied  # the first two steps landed, then (say) the worker died
    retried = call(4)
    assert retried.applied and retried.steps == 4 and retried.global_step == 4
    state = ps.state(0, include_step_ids=True)
    assert sorted(state.applied_step_ids) == [500, 501, 502, 503]
    assert (state.global_step, state.duplicate_updates, list(state.shard_positions)) == (4, 2, [103])
    # several steps are for asynchronous training steps only: refused, and nothing changes
    with pytest.raises(grpc.RpcError) as err:
        stub.RunStep(pb.StepRequest(step_id=900, function="train", steps=3, sync_step=5), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ps.state(0).global_step == 4


def test_a_replaced_chiefs_steps_are_refused_and_its_coordinator_stops(make_cluster: MakeCluster) -> None:
    """Fencing: a chief that moved away leaves its old process behind; once the worker has heard of the new
    chief (here from its probe), the old one's steps are refused, applied nowhere, and its join() raises."""
    made = make_cluster(MLP, num_ps=1, batch_size=BATCH)
    old = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=1)
    new = None
    try:
        for _ in range(3):
            old.schedule("train")
        old.join(timeout=30)
        assert made.chief.state(0).global_step == 3
        new = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=2,
                                 step_id_base=1 << 20, cursors={0: 3})  # fmt: skip
        assert new.wait_for_workers(10) == 1  # its probe tells the worker of incarnation 2
        assert made.worker.chief_fence.newest == 2
        refused = old.schedule("train")
        with pytest.raises(ChiefReplaced, match="chief incarnation 1 was replaced by incarnation 2"):
            old.join(timeout=30)
        with pytest.raises(ChiefReplaced):
            refused.fetch(timeout=5)
        state = made.chief.state(0)
        assert (state.global_step, list(state.shard_positions)) == (3, [2])  # the refused step took nothing
        for _ in range(2):
            new.schedule("train")
        new.join(timeout=30)
        assert made.chief.state(0).global_step == 5
    finally:
        old.shutdown()
        if new is not None:
            new.shutdown()


def test_training_over_is_heard_from_the_current_chief_only(make_cluster: MakeCluster) -> None:
    """A chief that finished tells its workers that no step comes any more (over gRPC, the coordinator's Ping):
    stopped then, a worker goes at once. A replaced chief's word is not taken: the current one may still train."""
    made = make_cluster(MLP, num_ps=1, batch_size=BATCH)
    old = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=1)
    new = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=2)
    try:
        assert new.wait_for_workers(10) == 1 and made.worker.chief_fence.newest == 2
        old.tell_training_over()
        assert made.worker.training_over is False
        new.tell_training_over()
        assert made.worker.training_over is True
        # a step after it (a chief restored after the end was said, training again): training is not over, and
        # the worker does not end by itself a minute later in the middle of it
        new.schedule("train").fetch(timeout=30)
        assert made.worker.training_over is False
    finally:
        old.shutdown()
        new.shutdown()


class ChiefIncarnationSupervisor(pb_grpc.SupervisorServicer):
    """A supervisor that answers every heartbeat with the current chief's incarnation."""

    def __init__(self, chief_incarnation: int) -> None:
        self.chief_incarnation = chief_incarnation

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(chief_incarnation=self.chief_incarnation)


def test_a_heartbeat_reply_tells_the_role_which_chief_is_current() -> None:
    server, port = make_server("127.0.0.1:0")
    pb_grpc.add_SupervisorServicer_to_server(ChiefIncarnationSupervisor(3), server)
    fence = ChiefFence()
    info = ClusterInfo({"worker": ["127.0.0.1:1"]}, "worker", 0, supervisor=f"127.0.0.1:{port}")
    heartbeater = Heartbeater(info, interval=0.05, progress=Progress(), chief_fence=fence)
    try:
        server.start()
        heartbeater.start()
        wait_until(lambda: fence.newest == 3, timeout=10, what="a heartbeat reply to reach the fence")
        with pytest.raises(ChiefReplaced):
            fence.admit(2)
        fence.admit(3)
    finally:
        heartbeater.stop()
        server.stop(grace=None).wait()


def test_a_worker_drained_after_its_chief_stopped_feeding_it_goes_at_once(
        make_cluster: MakeCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped, a worker waits until the chief has not asked for a step for a while (a step sent as it shuts down
    would be lost in flight); a chief that stops before the end (psctl down) says that none will come. A replaced
    chief's word is not taken."""
    monkeypatch.setattr(worker_module, "FED_RECENTLY", 60.0)  # without the chief's word: a minute
    made = make_cluster(MLP, num_ps=1, batch_size=BATCH)
    old = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=1)
    new = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=2)
    try:
        new.schedule("train")
        new.join(timeout=30)  # it fed the worker just now
        left: list[int] = []
        draining = threading.Thread(target=lambda: left.append(made.worker.drain(120.0)), daemon=True)
        draining.start()
        old.shutdown(tell_stopped=True)  # a replaced chief: the worker still waits for the current one
        draining.join(0.5)
        assert draining.is_alive()
        new.shutdown(tell_stopped=True)
        wait_until(lambda: not draining.is_alive(), timeout=10, what="the drain to end on the chief's word")
        assert left == [0]
    finally:
        old.shutdown()
        new.shutdown()


class RecordingSupervisor(pb_grpc.SupervisorServicer):
    """A supervisor that keeps every heartbeat and answers each (fenced, if told to)."""

    def __init__(self, fenced: bool = False) -> None:
        self.beats: list[pb.HeartbeatRequest] = []
        self.fenced = fenced

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self.beats.append(request)
        return pb.HeartbeatResponse(fenced=self.fenced)


@pytest.mark.parametrize("fenced", [False, True])
def test_a_role_stopping_sends_a_last_heartbeat_with_its_final_progress(fenced: bool) -> None:
    # an evaluator's last evaluation comes after its last periodic beat: psctl status showed the one before
    supervisor = RecordingSupervisor(fenced)
    server, port = make_server("127.0.0.1:0")
    pb_grpc.add_SupervisorServicer_to_server(supervisor, server)
    info = ClusterInfo({"worker": ["127.0.0.1:1"]}, "evaluator", 0, supervisor=f"127.0.0.1:{port}")
    progress = Progress()
    exits: list[str] = []
    heartbeater = Heartbeater(info, interval=3600.0, progress=progress, on_fenced=lambda: exits.append("fenced"))
    try:
        server.start()
        heartbeater.start()
        wait_until(lambda: supervisor.beats, timeout=10, what="the first heartbeat")
        progress.global_step, progress.metrics = 1000, {"accuracy": 0.98}
        heartbeater.stop(final_within=10.0)
        assert [b.global_step for b in supervisor.beats] == [0, 1000]
        assert supervisor.beats[-1].metrics["accuracy"] == pytest.approx(0.98)
        assert exits == (["fenced"] if fenced else [])  # a role on its way out is not made to exit by a fence
    finally:
        heartbeater.stop()
        server.stop(grace=None).wait()


def test_a_step_of_a_replaced_chief_does_not_land_once_the_ps_knows_the_new_one(make_cluster: MakeCluster) -> None:
    """The new chief's Init reaches every PS before it reads where each worker's input stands: from then on
    the old chief's steps are refused at the PS, even by a worker that has not heard of the new chief yet."""
    made = make_cluster(MLP, num_ps=1, batch_size=BATCH)
    old = ClusterCoordinator([made.worker_address], probe_interval=0.05, chief_incarnation=1)
    new = PsClient(made.chief.addresses, timeout=30, chief_incarnation=2)
    try:
        old.schedule("train")
        old.join(timeout=30)
        before = made.chief.state(0)
        new.state(0)  # the PS hears of chief incarnation 2; the worker has not
        assert made.worker.chief_fence.newest == 1
        old.schedule("train")
        with pytest.raises(ChiefReplaced, match="chief incarnation 1 was replaced by incarnation 2"):
            old.join(timeout=30)
        after = made.chief.state(0)
        assert (after.global_step, list(after.shard_positions)) == (before.global_step, list(before.shard_positions))
    finally:
        old.shutdown()
        new.close()


def test_a_program_s_row_ids_are_integers_sorted_and_unique_or_refused_naming_the_variable() -> None:
    """embedding_ids() of floats were cast (1.7 read row 1), unsorted ones matched the rows pulled to other ids
    (EmbeddingRows' lookup found the wrong rows): a ValueError naming the variable, in the program's step."""
    from psctl.runtime.model import row_ids

    assert row_ids("t", np.array([1, 4, 9], np.int32), "embedding_ids()").dtype == np.int64
    assert row_ids("t", [], "embedding_ids()").shape == (0,)
    refused = {
        "must be integer row ids, got dtype float64": np.array([1.7, 4.2]),
        "must be sorted and unique": np.array([7, 3, 1]),
        "must be a 1-d array of row ids, got shape (2, 1)": np.array([[1], [2]]),
    }
    for said, ids in refused.items():
        with pytest.raises(ValueError, match=rf"^embedding_ids\(\) for 't' {re.escape(said)}"):
            row_ids("t", ids, "embedding_ids()")
    assert row_ids("t", np.array([3, 1]), "a sparse gradient's ids", sorted_unique=False).tolist() == [3, 1]


def test_an_embedding_gradient_s_bytes_are_counted() -> None:
    """A SparseGrad counted 0 bytes: `top` showed an embedding model's worker moving 0.02 MB/s."""
    from psctl.runtime.program import SparseGrad
    from psctl.runtime.worker import _nbytes

    grad = SparseGrad(np.arange(500), np.zeros((500, 16), np.float32))
    assert _nbytes(grad) == 500 * 8 + 500 * 16 * 4

"""Synchronous training's accumulator, end to end through a real parameter server on loopback gRPC.

Each test starts an in-process PS (``make_server`` + ``VariableStore`` + ``ParameterServerServicer``) and talks
to it through ``PsClient`` and the raw stub, exactly as the chief and the workers do. Variables are tiny and the
optimizer is SGD with learning rate 1, so every applied step is exactly ``value - averaged gradient`` and the
averages of TensorFlow's ConditionalAccumulator (docs: tf-ps-semantics.md, "Synchronous training") can be
checked to the bit. A few pure unit tests of ``StepAccumulator.averaged`` close the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.accumulator import StepAccumulator
from psctl.runtime.ps import ParameterServerServicer, Shard, VariableStore
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.rpc import make_server
from psctl.runtime.wire import DENSE, IDS, ROWS, SLOT, Entry

CLUSTER = "acc-test"
SGD1 = pb.OptimizerConfig(name="sgd", learning_rate=1.0)
#: A tiny dense variable, initialised to ones.
V = pb.VariableSpec(name="v", dtype="float32", shape=[2], full_shape=[2], initializer="ones", seed=1)
#: An embedding-like table of 4 rows of 2, initialised to ones (pushed to by rows).
EMB = pb.VariableSpec(name="emb", dtype="float32", shape=[4, 2], full_shape=[4, 2], initializer="ones", seed=2)
EMPTY = np.zeros(0, dtype=np.float32)


@dataclass
class Ps:
    store: VariableStore
    client: PsClient

    @property
    def stub(self) -> pb_grpc.ParameterServerStub:
        return self.client.stubs[0]

    def init(
        self, specs: Sequence[pb.VariableSpec] = (V,), *, r: int = 2, distinct: bool = False,
        optimizer: pb.OptimizerConfig = SGD1,
    ) -> None:
        reply = self.stub.Init(
            pb.InitRequest(variables=list(specs), optimizer=optimizer, cluster_id=CLUSTER,
                           replicas_to_aggregate=r, distinct_replicas=distinct),
            timeout=30,
        )
        assert not reply.already_initialized

    def push(
        self, step_id: int, entries: Sequence[Entry], *, local_step: int, task: str = "worker:0"
    ) -> pb.PushResponse:
        header = PushHeader(step_id=step_id, task=task, incarnation=1, local_steps={0: local_step})
        return self.client.push(header, {0: list(entries)})[0]

    def value(self, name: str = "v") -> np.ndarray:
        pulled, _ = self.client.pull({0: [Entry(name, DENSE, EMPTY)]})
        return np.array(pulled[0][0].array)

    def state(self) -> pb.StateResponse:
        return self.stub.GetState(pb.StateRequest(include_step_ids=True), timeout=30)  # type: ignore[no-any-return]

    def flush(self, step: int, min_replicas: int) -> pb.SyncFlushResponse:
        return self.stub.SyncFlush(  # type: ignore[no-any-return]
            pb.SyncFlushRequest(step=step, min_replicas=min_replicas), timeout=30
        )


@pytest.fixture
def start_ps() -> Iterator[Callable[[], Ps]]:
    started: list[tuple[grpc.Server, PsClient]] = []

    def start() -> Ps:
        store = VariableStore(cluster_id=CLUSTER)
        server, port = make_server("127.0.0.1:0")
        pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(store), server)
        server.start()
        client = PsClient([f"127.0.0.1:{port}"], timeout=30)
        started.append((server, client))
        return Ps(store, client)

    try:
        yield start
    finally:
        for server, client in started:
            client.close()
            server.stop(grace=None).wait()


@pytest.fixture
def ps(start_ps: Callable[[], Ps]) -> Ps:
    return start_ps()


def dense(value: Sequence[float]) -> list[Entry]:
    return [Entry("v", DENSE, np.array(value, dtype=np.float32))]


def sparse(ids: Sequence[int], rows: Sequence[Sequence[float]]) -> list[Entry]:
    return [Entry("emb", IDS, np.array(ids, dtype=np.int64)), Entry("emb", ROWS, np.array(rows, dtype=np.float32))]


def rpc_code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[no-any-return,attr-defined]


def counters(s: pb.StateResponse) -> tuple[int, ...]:
    return (s.global_step, s.applied_updates, s.duplicate_updates, s.sync_gradients_applied, s.stale_dropped,
            s.timed_out_steps, s.pending_replicas)


# -- the reference table ----------------------------------------------------------------------------------------
def test_reference_table_average_applied_once_then_stale_dropped(ps: Ps) -> None:
    ps.init(r=2)
    one = ps.push(1, dense([1, 1]), local_step=0, task="worker:0")
    assert (one.applied, one.stale, one.global_step) == (True, False, 0)
    # one of two gradients: accumulated, nothing applied yet
    np.testing.assert_array_equal(ps.value(), [1, 1])
    assert (ps.state().global_step, ps.state().pending_replicas) == (0, 1)

    two = ps.push(2, dense([3, 3]), local_step=0, task="worker:1")
    assert (two.applied, two.stale, two.global_step) == (True, False, 1)
    # the average [2, 2] applied once with lr 1: ones - 2 (not ones - 1 - 3, not two updates)
    np.testing.assert_array_equal(ps.value(), np.float32([-1, -1]))
    s = ps.state()
    assert (s.global_step, s.applied_updates, s.sync_gradients_applied, s.pending_replicas) == (1, 1, 2, 0)
    assert list(s.applied_step_ids) == [1, 2]

    late = ps.push(3, dense([5, 5]), local_step=0, task="worker:2")
    assert (late.applied, late.stale, late.global_step) == (False, True, 1)
    np.testing.assert_array_equal(ps.value(), np.float32([-1, -1]))
    s = ps.state()
    assert (s.global_step, s.stale_dropped, s.pending_replicas, s.sync_gradients_applied) == (1, 1, 0, 2)
    assert 3 not in s.applied_step_ids  # a dropped gradient is not recorded as applied

    # the next step starts from the new value and averages afresh
    ps.push(4, dense([2, 4]), local_step=1, task="worker:0")
    assert ps.push(5, dense([4, 0]), local_step=1, task="worker:1").global_step == 2
    np.testing.assert_array_equal(ps.value(), np.float32([-4, -3]))


def test_retried_push_of_an_accumulated_step_is_not_counted_twice(ps: Ps) -> None:
    ps.init(r=2)
    assert ps.push(7, dense([1, 1]), local_step=0).applied
    again = ps.push(7, dense([1, 1]), local_step=0)  # the same step id: a retry after a lost reply
    assert not again.applied
    s = ps.state()
    assert (s.pending_replicas, s.duplicate_updates, s.global_step) == (1, 1, 0)
    np.testing.assert_array_equal(ps.value(), [1, 1])


# -- sparse rows --------------------------------------------------------------------------------------------------
def test_sparse_rows_are_averaged_over_each_rows_contributors(ps: Ps) -> None:
    ps.init([EMB], r=2)
    a = [[2.0, 4.0], [6.0, 8.0]]  # rows 0, 1
    b = [[10.0, 20.0], [1.0, 3.0]]  # rows 1, 2
    ps.push(1, sparse([0, 1], a), local_step=0, task="worker:0")
    assert ps.state().global_step == 0
    assert ps.push(2, sparse([1, 2], b), local_step=0, task="worker:1").global_step == 1
    got = ps.value("emb")
    want = np.ones((4, 2), dtype=np.float32)
    want[0] -= np.float32([2, 4])  # A alone
    want[1] -= np.float32([(6 + 10) / 2, (8 + 20) / 2])  # both: the mean
    want[2] -= np.float32([1, 3])  # B alone
    np.testing.assert_array_equal(got, want)  # row 3: nobody touched it
    np.testing.assert_array_equal(got[3], [1, 1])


def test_sparse_and_dense_together_average_separately(ps: Ps) -> None:
    ps.init([V, EMB], r=2)
    ps.push(1, dense([2, 2]) + sparse([3], [[4, 4]]), local_step=0, task="worker:0")
    ps.push(2, dense([4, 6]), local_step=0, task="worker:1")  # no sparse rows from this replica
    np.testing.assert_array_equal(ps.value(), np.float32([1 - 3, 1 - 4]))
    emb = ps.value("emb")
    np.testing.assert_array_equal(emb[3], np.float32([1 - 4, 1 - 4]))  # one contributor: not halved
    np.testing.assert_array_equal(emb[:3], np.ones((3, 2), np.float32))


def test_a_repeated_id_in_one_replicas_push_is_one_contributor(ps: Ps) -> None:
    """A replica's repeated id means the sum of its rows (asynchronous training applies it so, see test_ps):
    that replica is one contributor to the row, not two."""
    ps.init([EMB], r=2)
    ps.push(1, sparse([1, 1], [[2, 2], [4, 4]]), local_step=0, task="worker:0")  # row 1's gradient: [6, 6]
    ps.push(2, sparse([1], [[2, 2]]), local_step=0, task="worker:1")
    assert ps.state().global_step == 1
    np.testing.assert_array_equal(ps.value("emb")[1], np.float32([1 - (6 + 2) / 2] * 2))


# -- counting replicas or gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("distinct", [True, False], ids=["distinct-replicas", "gradients"])
def test_one_task_pushing_twice_counts_once_only_with_distinct_replicas(ps: Ps, distinct: bool) -> None:
    ps.init(r=2, distinct=distinct)
    assert ps.push(1, dense([1, 1]), local_step=0, task="worker:0").applied
    second = ps.push(2, dense([3, 3]), local_step=0, task="worker:0")
    assert second.applied and not second.stale  # accepted either way
    s = ps.state()
    if distinct:
        assert (s.global_step, s.pending_replicas) == (0, 1)
        np.testing.assert_array_equal(ps.value(), [1, 1])
        # another replica completes the step; all three gradients are averaged
        assert ps.push(3, dense([5, 5]), local_step=0, task="worker:1").global_step == 1
        np.testing.assert_array_equal(ps.value(), np.float32([1 - 3, 1 - 3]))
        s = ps.state()
        assert (s.global_step, s.pending_replicas, s.sync_gradients_applied) == (1, 0, 3)
    else:
        assert (s.global_step, s.pending_replicas, s.sync_gradients_applied) == (1, 0, 2)
        np.testing.assert_array_equal(ps.value(), np.float32([-1, -1]))


# -- refusals -----------------------------------------------------------------------------------------------------
def test_push_for_a_future_step_is_refused_and_changes_nothing(ps: Ps) -> None:
    ps.init(r=2)
    ps.push(1, dense([1, 1]), local_step=0)
    before, value = ps.state(), ps.value()
    code = rpc_code(lambda: ps.push(2, dense([3, 3]), local_step=1, task="worker:1"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    after = ps.state()
    assert counters(after) == counters(before)
    assert list(after.applied_step_ids) == list(before.applied_step_ids) == [1]
    np.testing.assert_array_equal(ps.value(), value)
    # the refused step id was not recorded: the same id, now for the right step, is accepted and completes it
    assert ps.push(2, dense([3, 3]), local_step=0, task="worker:1").global_step == 1
    np.testing.assert_array_equal(ps.value(), np.float32([-1, -1]))


# -- the replica timeout ------------------------------------------------------------------------------------------
def test_sync_flush_needs_min_replicas(ps: Ps) -> None:
    ps.init(r=3)
    ps.push(1, dense([2, 4]), local_step=0, task="worker:0")
    before, value = ps.state(), ps.value()

    short = ps.flush(0, 2)
    assert (short.applied, short.replicas, short.global_step) == (False, 1, 0)
    assert counters(ps.state()) == counters(before)
    np.testing.assert_array_equal(ps.value(), value)

    ps.push(2, dense([4, 8]), local_step=0, task="worker:1")
    enough = ps.flush(0, 2)
    assert (enough.applied, enough.replicas, enough.global_step) == (True, 2, 1)
    np.testing.assert_array_equal(ps.value(), np.float32([1 - 3, 1 - 6]))  # averaged over the 2 that came
    s = ps.state()
    assert (s.global_step, s.timed_out_steps, s.sync_gradients_applied, s.pending_replicas) == (1, 1, 2, 0)

    # a step already applied: nothing to do, reported applied; the straggler is now stale
    assert ps.flush(0, 2).applied
    assert ps.push(3, dense([9, 9]), local_step=0, task="worker:2").stale
    assert ps.state().timed_out_steps == 1
    # a step that has not started is refused
    assert rpc_code(lambda: ps.flush(5, 1)) == grpc.StatusCode.INVALID_ARGUMENT
    # nothing arrived: even min_replicas 0 does not apply an empty step
    nothing = ps.flush(1, 0)
    assert (nothing.applied, nothing.replicas) == (False, 0)
    s = ps.state()
    assert (s.global_step, s.stale_dropped, s.timed_out_steps, s.pending_replicas) == (1, 1, 1, 0)


def test_sync_flush_on_an_asynchronous_ps_is_refused(ps: Ps) -> None:
    ps.init(r=0)
    assert rpc_code(lambda: ps.flush(0, 1)) == grpc.StatusCode.INVALID_ARGUMENT


# -- Assign ---------------------------------------------------------------------------------------------------------
#: Momentum 0 updates exactly as SGD does, but keeps an optimizer slot (restores carry slots).
MOMENTUM0 = pb.OptimizerConfig(name="momentum", learning_rate=1.0, params={"momentum": 0.0})


@pytest.mark.parametrize("optimizer", [SGD1, MOMENTUM0], ids=["sgd", "momentum0"])
def test_assign_resets_the_accumulator_to_the_assigned_step(ps: Ps, optimizer: pb.OptimizerConfig) -> None:
    """Restoring a checkpoint (Assign) drops the half-accumulated step and restarts counting at the restored
    step. With plain SGD (no optimizer slots) this is also the restore path of every SGD checkpoint."""
    ps.init(r=2, optimizer=optimizer)
    ps.push(1, dense([100, 100]), local_step=0, task="worker:0")
    assert ps.state().pending_replicas == 1
    entries = [Entry("v", DENSE, np.float32([10, 20]))]
    entries += [Entry(f"v#{slot}", SLOT, np.zeros(2, np.float32)) for slot in ps.store._shards["v"].slots]
    ps.client.assign({0: entries}, 5, [])
    s = ps.state()
    assert (s.global_step, s.pending_replicas) == (5, 0)
    np.testing.assert_array_equal(ps.value(), [10, 20])
    # a gradient of the old step is stale now, one of the assigned step counts
    assert ps.push(2, dense([1, 1]), local_step=0, task="worker:1").stale
    ps.push(3, dense([2, 2]), local_step=5, task="worker:0")
    assert ps.push(4, dense([4, 4]), local_step=5, task="worker:1").global_step == 6
    # the gradient pushed before the assign was discarded: only (2 + 4) / 2 was applied
    np.testing.assert_array_equal(ps.value(), np.float32([10 - 3, 20 - 3]))


# -- StepAccumulator.averaged, pure ---------------------------------------------------------------------------------
def _shard(name: str, value: np.ndarray) -> Shard:
    spec = pb.VariableSpec(name=name, dtype=str(value.dtype), shape=list(value.shape))
    return Shard(spec, value, {})


def test_averaged_dense_mean_in_float64_cast_to_the_variable_dtype() -> None:
    w = _shard("w", np.zeros(3, np.float16))
    acc = StepAccumulator(2)
    acc.add("worker:0", [(w, None, np.float16([1, 2, 60000]))])
    acc.add("worker:1", [(w, None, np.float16([2, 4, 60000]))])  # 60000 + 60000 overflows float16
    assert acc.ready() and acc.count() == 2
    ((shard, rows, grad),) = acc.averaged()
    assert shard is w and rows is None
    assert grad.dtype == np.float16
    np.testing.assert_array_equal(grad, np.float16([1.5, 3, 60000]))


def test_averaged_sparse_rows_sorted_and_counted_per_row() -> None:
    e = _shard("e", np.zeros((5, 2), np.float32))
    acc = StepAccumulator(3)
    acc.add("a", [(e, np.array([4, 0]), np.float32([[4, 4], [1, 1]]))])
    acc.add("b", [(e, np.array([0]), np.float32([[3, 5]]))])
    acc.add("c", [(e, np.array([2, 4]), np.float32([[7, 7], [0, 2]]))])
    ((shard, rows, grad),) = acc.averaged()
    assert shard is e and grad.dtype == np.float32
    np.testing.assert_array_equal(rows, [0, 2, 4])
    np.testing.assert_array_equal(grad, np.float32([[2, 3], [7, 7], [2, 3]]))


def test_averaged_dense_count_is_per_variable() -> None:
    a = _shard("a", np.zeros(2, np.float64))
    b = _shard("b", np.zeros(2, np.float64))
    acc = StepAccumulator(2)
    acc.add("worker:0", [(a, None, np.float64([2, 2])), (b, None, np.float64([8, 8]))])
    acc.add("worker:1", [(a, None, np.float64([4, 4]))])
    out = {shard.spec.name: grad for shard, _, grad in acc.averaged()}
    np.testing.assert_array_equal(out["a"], [3, 3])
    np.testing.assert_array_equal(out["b"], [8, 8])  # only one gradient touched b


def test_averaged_does_not_alias_the_pushed_gradient() -> None:
    w = _shard("w", np.zeros(2, np.float64))
    pushed = np.float64([1, 1])
    acc = StepAccumulator(2)
    acc.add("worker:0", [(w, None, pushed)])
    acc.add("worker:1", [(w, None, np.float64([3, 3]))])
    np.testing.assert_array_equal(pushed, [1, 1])  # accumulating must not modify the caller's array
    ((_, _, grad),) = acc.averaged()
    np.testing.assert_array_equal(grad, [2, 2])


def test_count_ready_and_reset() -> None:
    w = _shard("w", np.zeros(1, np.float32))
    acc = StepAccumulator(2, distinct_replicas=True)
    acc.add("worker:0", [(w, None, np.float32([1]))])
    acc.add("worker:0", [(w, None, np.float32([1]))])
    assert (acc.gradients, acc.count(), acc.ready()) == (2, 1, False)
    acc.add("worker:1", [(w, None, np.float32([1]))])
    assert (acc.count(), acc.ready()) == (2, True)
    acc.reset(7)
    assert (acc.step, acc.gradients, acc.count(), acc.ready(), acc.averaged()) == (7, 0, 0, False, [])

"""The parameter server behind a real gRPC server on loopback, driven through PsClient and raw stubs.

Every refusal is checked end to end: the status code a client sees, and that the PS is bit-for-bit what it
was before (variables, optimizer slots, counters, applied step ids) and still serves afterwards. The PS is
registered as the runtime registers it (ps.add_to_server: framed rpcs on raw bytes); PsClient speaks frames, the
raw stubs the plain protobuf rpcs, and malformed frames go in as raw bytes.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import limits, wire
from psctl.runtime import ps as ps_module
from psctl.runtime.fencing import ChiefReplaced
from psctl.runtime.initializers import initialize
from psctl.runtime.optimizers import make_optimizer
from psctl.runtime.ps import ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.ps_client import PsClient, PsUnavailable, PushHeader
from psctl.runtime.rpc import make_server
from psctl.runtime.wire import DENSE, IDS, LEFT_FACTOR, PULL_IDS, RIGHT_FACTOR, ROWS, Entry, WireError, whole_shard

CLUSTER = "test-cluster"
W = pb.VariableSpec(name="w", dtype="float32", shape=[4, 3], full_shape=[4, 3], initializer="glorot_uniform", seed=11)
# the second shard of a 10-row embedding: rows 5..9 of the whole variable's initial values
EMB = pb.VariableSpec(
    name="emb/part_1",
    dtype="float32",
    shape=[5, 2],
    full_shape=[10, 2],
    row_offset=5,
    initializer="normal",
    init_scale=0.5,
    seed=22,
)
B = pb.VariableSpec(name="b", dtype="float64", shape=[3], full_shape=[3], initializer="ones", seed=33)
SPECS = [W, EMB, B]
LR = 0.1
SGD = pb.OptimizerConfig(name="sgd", learning_rate=LR)
ADAM = pb.OptimizerConfig(name="adam", learning_rate=0.01)
EMPTY = np.zeros(0, dtype=np.float32)


@dataclass
class Ps:
    address: str
    store: VariableStore
    client: PsClient

    @property
    def stub(self) -> pb_grpc.ParameterServerStub:
        return self.client.stubs[0]


@dataclass
class Servers:
    """Running PS servers; started and stopped by the ``servers`` fixture."""

    started: list[tuple[grpc.Server, PsClient]]

    def start(self, *, generated: bool = False) -> Ps:
        """A PS registered as the runtime does, or (``generated``) with the generated registration."""
        store = VariableStore(cluster_id=CLUSTER)
        server, port = make_server("127.0.0.1:0")
        register = pb_grpc.add_ParameterServerServicer_to_server if generated else add_to_server
        register(ParameterServerServicer(store), server)
        server.start()
        address = f"127.0.0.1:{port}"
        client = PsClient([address], timeout=60)
        self.started.append((server, client))
        return Ps(address, store, client)


@pytest.fixture
def servers() -> Iterator[Servers]:
    handle = Servers([])
    try:
        yield handle
    finally:
        for server, client in handle.started:
            client.close()
            server.stop(grace=None).wait()


@pytest.fixture
def ps(servers: Servers) -> Ps:
    return servers.start()


# -- helpers ------------------------------------------------------------------------------------------------
def initial_value(spec: pb.VariableSpec) -> np.ndarray:
    return initialize(
        spec.initializer,
        tuple(spec.shape),
        spec.dtype,
        full_shape=tuple(spec.full_shape) or tuple(spec.shape),
        row_offset=spec.row_offset,
        seed=spec.seed,
        scale=spec.init_scale,
    )


def init(
    ps: Ps, specs: Sequence[pb.VariableSpec] = SPECS, optimizer: pb.OptimizerConfig = SGD, cluster_id: str = CLUSTER
) -> pb.InitResponse:
    return ps.stub.Init(pb.InitRequest(variables=list(specs), optimizer=optimizer, cluster_id=cluster_id), timeout=30)


def pull_dense(ps: Ps, names: Sequence[str] = ("w", "emb/part_1", "b")) -> dict[str, np.ndarray]:
    pulled, _ = ps.client.pull({0: [Entry(n, DENSE, EMPTY) for n in names]})
    return {e.name: np.array(e.array) for e in pulled[0]}


def push(
    ps: Ps,
    step_id: int,
    entries: Sequence[Entry],
    *,
    increment: bool = True,
    task: str = "worker:0",
    incarnation: int = 1,
    shard: int = -1,
    position: int = -1,
) -> pb.PushResponse:
    header = PushHeader(step_id=step_id, task=task, incarnation=incarnation, shard=shard, position=position)
    return ps.client.push(header, {0: list(entries)}, increment_on=0 if increment else None)[0]


def state(ps: Ps) -> pb.StateResponse:
    return ps.stub.GetState(pb.StateRequest(include_step_ids=True), timeout=30)


@dataclass(frozen=True)
class Snapshot:
    values: dict[str, bytes]
    slots: dict[str, dict[str, bytes]]
    state: pb.StateResponse


def snapshot(ps: Ps) -> Snapshot:
    """Everything a refused request must leave alone: variable bytes (read over gRPC), optimizer slots
    (read in-process: they never travel), and the counters and step ids GetState reports."""
    values = {name: array.tobytes() for name, array in pull_dense(ps).items()}
    slots = {
        name: {key: np.array(slot).tobytes() for key, slot in shard.slots.items()}
        for name, shard in ps.store._shards.items()
    }
    return Snapshot(values, slots, state(ps))


def rpc_code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()  # type: ignore[no-any-return,attr-defined]


def w_grad(value: float = 0.5) -> np.ndarray:
    return np.arange(12, dtype=np.float32).reshape(4, 3) * np.float32(value) - np.float32(1)


# -- Init ---------------------------------------------------------------------------------------------------
def test_init_creates_initializer_values_and_reinit_is_idempotent(ps: Ps) -> None:
    assert not state(ps).initialized
    first = init(ps)
    assert not first.already_initialized
    assert state(ps).initialized
    values = pull_dense(ps)
    for spec in SPECS:
        want = initial_value(spec)
        assert values[spec.name].dtype == want.dtype
        assert values[spec.name].tobytes() == want.tobytes(), spec.name
    # the shard really is rows 5..9 of the whole variable, not rows 0..4
    whole = initialize("normal", (10, 2), "float32", full_shape=(10, 2), row_offset=0, seed=22, scale=0.5)
    np.testing.assert_array_equal(values["emb/part_1"], whole[5:])
    assert not np.array_equal(values["emb/part_1"], whole[:5])

    assert push(ps, 1, [Entry("w", DENSE, w_grad())]).applied
    trained = pull_dense(ps)
    # same specs again, in another order (a restarted chief): nothing is re-created, training is kept
    again = init(ps, list(reversed(SPECS)))
    assert again.already_initialized
    assert again.global_step == 1
    after = pull_dense(ps)
    assert {k: v.tobytes() for k, v in after.items()} == {k: v.tobytes() for k, v in trained.items()}
    assert after["w"].tobytes() != values["w"].tobytes()


@pytest.mark.parametrize(
    "specs",
    [
        [pb.VariableSpec(name="w", dtype="float32", shape=[3, 4], initializer="zeros"), EMB, B],
        [W, EMB],
        [W, EMB, B, pb.VariableSpec(name="extra", dtype="float32", shape=[1], initializer="zeros")],
        [
            pb.VariableSpec(
                name="w", dtype="float64", shape=[4, 3], full_shape=[4, 3], initializer="glorot_uniform", seed=11
            ),
            EMB,
            B,
        ],
    ],
    ids=["other-shape", "fewer", "more", "other-dtype"],
)
def test_different_reinit_is_refused_and_changes_nothing(ps: Ps, specs: list[pb.VariableSpec]) -> None:
    init(ps, optimizer=ADAM)
    assert push(ps, 1, [Entry("w", DENSE, w_grad())]).applied
    before = snapshot(ps)
    assert rpc_code(lambda: init(ps, specs, optimizer=ADAM)) == grpc.StatusCode.FAILED_PRECONDITION
    assert snapshot(ps) == before


def test_init_from_another_cluster_is_refused(ps: Ps) -> None:
    assert rpc_code(lambda: init(ps, cluster_id="someone-else")) == grpc.StatusCode.PERMISSION_DENIED
    assert not state(ps).initialized
    assert not init(ps).already_initialized
    before = snapshot(ps)
    assert rpc_code(lambda: init(ps, cluster_id="someone-else")) == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(ps) == before


@pytest.mark.parametrize(
    ("specs", "optimizer"),
    [
        ([pb.VariableSpec(name="i", dtype="int32", shape=[2], initializer="zeros")], SGD),
        ([W, W], SGD),
        ([pb.VariableSpec(name="x", dtype="float32", shape=[2], initializer="no-such-initializer")], SGD),
        (SPECS, pb.OptimizerConfig(name="no-such-optimizer", learning_rate=0.1)),
        (SPECS, pb.OptimizerConfig(name="sgd", learning_rate=-1.0)),
        (SPECS, pb.OptimizerConfig(name="sgd", learning_rate=0.1, params={"bogus": 1.0})),
        # 4 TiB: refused by its size before numpy is asked for it (an UNKNOWN "Unable to allocate" before)
        ([pb.VariableSpec(name="x", dtype="float32", shape=[2**20, 2**20], initializer="zeros")], SGD),
        ([pb.VariableSpec(name="x", dtype="float32", shape=[1] * 9, initializer="zeros")], SGD),
    ],
    ids=["int-variable", "duplicate-name", "bad-initializer", "bad-optimizer", "negative-lr", "bad-param",
         "beyond-the-size-limit", "rank-9"],
)
def test_invalid_init_is_refused_and_leaves_the_ps_uninitialized(
    ps: Ps, specs: list[pb.VariableSpec], optimizer: pb.OptimizerConfig
) -> None:
    assert rpc_code(lambda: init(ps, specs, optimizer)) == grpc.StatusCode.INVALID_ARGUMENT
    assert not state(ps).initialized
    assert not init(ps).already_initialized  # a good Init still works afterwards


# -- pulls and pushes ---------------------------------------------------------------------------------------
def test_dense_pull_equals_the_initializer_values_through_both_rpcs(ps: Ps) -> None:
    init(ps)
    unary = pull_dense(ps)
    pulled, step = ps.client.pull({0: [Entry(s.name, DENSE, EMPTY) for s in SPECS]}, {0: limits.UNARY_MAX_BYTES + 1})
    assert step == 0
    streamed = {e.name: e.array for e in pulled[0]}
    for spec in SPECS:
        want = initial_value(spec)
        assert unary[spec.name].tobytes() == want.tobytes()
        assert streamed[spec.name].tobytes() == want.tobytes()
        assert streamed[spec.name].shape == tuple(spec.shape)


def test_push_applies_sgd_exactly(ps: Ps) -> None:
    init(ps)
    g_w = w_grad(0.37)
    g_b = np.array([0.5, -0.25, 1e-3], dtype=np.float64)
    response = push(ps, 5, [Entry("w", DENSE, g_w), Entry("b", DENSE, g_b)])
    assert response.applied
    assert response.global_step == 1
    values = pull_dense(ps)
    assert values["w"].tobytes() == (initial_value(W) - np.float32(LR) * g_w).tobytes()
    assert values["b"].tobytes() == (initial_value(B) - np.float64(LR) * g_b).tobytes()
    assert values["emb/part_1"].tobytes() == initial_value(EMB).tobytes()  # not pushed: untouched


def test_training_over_holds_until_a_push_or_a_restore_says_training_goes_on(ps: Ps) -> None:
    """A ps told that training is over ends by itself a minute later if nothing stops it; a chief restored
    after that word (a ps lost in the final checkpoint) trains again, and the ps must not end in the middle."""
    init(ps)
    ps.client.state(0, training_over=True)
    assert ps.store.training_over.is_set()
    push(ps, 7, [Entry("w", DENSE, w_grad())])
    assert not ps.store.training_over.is_set()
    ps.client.state(0, training_over=True)
    ps.client.assign({0: [Entry(n, DENSE, v) for n, v in pull_dense(ps).items()]}, 1, [])
    assert not ps.store.training_over.is_set()


def test_a_huge_finite_gradient_whose_squares_overflow_is_applied(ps: Ps) -> None:
    """The finiteness check sums squares first; an overflow there is no NaN: the exact check decides."""
    init(ps)
    g_w = np.full((4, 3), 1e30, dtype=np.float32)  # (1e30)^2 overflows float32; every element is finite
    assert push(ps, 5, [Entry("w", DENSE, g_w)]).applied
    assert pull_dense(ps)["w"].tobytes() == (initial_value(W) - np.float32(LR) * g_w).tobytes()
    g_w[1, 2] = np.nan
    before = snapshot(ps)
    assert rpc_code(lambda: push(ps, 6, [Entry("w", DENSE, g_w)])) == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(ps).values == before.values


def low_rank(left: np.ndarray, right: np.ndarray, name: str = "w") -> list[Entry]:
    return [Entry(name, LEFT_FACTOR, left), Entry(name, RIGHT_FACTOR, right)]


# a batch of two examples' factors of w's (4 x 3) gradient: LEFT.T @ RIGHT
LEFT = np.array([[1.0, -2.0, 0.5, 3.0], [0.25, 1.0, -1.0, 2.0]], np.float32)
RIGHT = np.array([[0.5, -1.0, 2.0], [1.5, 0.0, -0.75]], np.float32)


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
def test_a_low_rank_gradient_is_the_same_update_as_its_product(servers: Servers, optimizer: pb.OptimizerConfig) -> None:
    """The factors of a gradient and the gradient itself leave two PS with the same values and slots, bit for bit,
    through the framed push that brings the variable back (a worker's step) and through the plain Push rpc."""
    by_factors, by_product = servers.start(), servers.start()
    for ps in (by_factors, by_product):
        init(ps, optimizer=optimizer)
    product = LEFT.T @ RIGHT
    assert product.shape == (4, 3) and np.abs(product).min() > 0  # every element moves
    header = PushHeader(step_id=5, task="worker:0", incarnation=1)
    _, after = by_factors.client.push_pull(header, {0: low_rank(LEFT, RIGHT)}, {0: [whole_shard("w")]})
    by_product.client.push(header, {0: [Entry("w", DENSE, product)]})
    plain = pb.PushRequest(step_id=6, task="worker:0", incarnation=1, increment_global_step=True)
    wire.add_entries(plain.entries, low_rank(2 * LEFT, RIGHT))
    assert by_factors.stub.Push(plain, timeout=30).applied
    push(by_product, 6, [Entry("w", DENSE, (2 * LEFT).T @ RIGHT)])
    first, second = snapshot(by_factors), snapshot(by_product)
    assert first.values == second.values and first.slots == second.slots
    assert first.values["w"] != initial_value(W).tobytes()
    assert after[0][0].array.tobytes() != first.values["w"]  # the first push's answer: w after that push only
    assert (first.state.global_step, first.state.applied_updates) == (2, 2)


def test_same_step_id_is_applied_at_most_once(ps: Ps) -> None:
    init(ps)
    first = push(ps, 7, [Entry("w", DENSE, w_grad(1.0))])
    assert first.applied
    after_first = pull_dense(ps)
    # a retry of step 7 (even with other gradients) is not applied again
    second = push(ps, 7, [Entry("w", DENSE, w_grad(3.0))])
    assert not second.applied
    assert second.global_step == 1
    assert {k: v.tobytes() for k, v in pull_dense(ps).items()} == {k: v.tobytes() for k, v in after_first.items()}
    s = state(ps)
    assert (s.applied_updates, s.duplicate_updates, s.global_step) == (1, 1, 1)
    assert list(s.applied_step_ids) == [7]


def test_global_step_counts_only_incrementing_pushes_once_per_step_id(ps: Ps) -> None:
    init(ps)
    g = [Entry("w", DENSE, w_grad())]
    assert push(ps, 1, g, increment=False).global_step == 0
    assert state(ps).global_step == 0
    assert push(ps, 2, g).global_step == 1
    again = push(ps, 2, g)
    assert (again.applied, again.global_step) == (False, 1)
    late = push(ps, 1, g)  # step 1 was applied without incrementing; a retry cannot increment now
    assert (late.applied, late.global_step) == (False, 1)
    assert push(ps, 3, [], increment=True).global_step == 2  # an empty push still counts its step
    s = state(ps)
    assert s.global_step == 2
    assert list(s.applied_step_ids) == [1, 2, 3]
    assert (s.applied_updates, s.duplicate_updates) == (3, 2)


def test_every_ps_records_the_step_and_only_the_first_counts_it(servers: Servers) -> None:
    ps0, ps1 = servers.start(), servers.start()
    init(ps0, [W])
    init(ps1, [EMB, B])
    client = PsClient([ps0.address, ps1.address], timeout=60)
    try:
        header = PushHeader(step_id=9, task="worker:1", incarnation=1)
        responses = client.push(header, {0: [Entry("w", DENSE, w_grad())]})  # nothing for ps 1: empty push
        assert responses[0].applied and responses[1].applied
        again = client.push(header, {0: [Entry("w", DENSE, w_grad())]})
        assert not again[0].applied and not again[1].applied
    finally:
        client.close()
    s0, s1 = state(ps0), state(ps1)
    assert (s0.global_step, list(s0.applied_step_ids)) == (1, [9])
    assert (s1.global_step, list(s1.applied_step_ids)) == (0, [9])
    assert s1.duplicate_updates == 1


def test_adam_counts_its_steps_per_ps_whichever_shards_of_a_table_a_push_touched(servers: Servers) -> None:
    """TF's Adam counts its steps once for all variables (``iterations``): a table cut in shards trains as the
    whole one. Five pushes touch only the first shard of a two-shard table, the sixth only the second: its row
    moves by the bias-corrected step of t = 6, as the uncut table's same row does (counted per shard, it moved
    by t = 1's, almost twice as far). A checkpoint's pull and a restore carry the count."""

    def part(name: str, rows: int, offset: int) -> pb.VariableSpec:
        return pb.VariableSpec(name=name, dtype="float32", shape=[rows, 2], full_shape=[10, 2], row_offset=offset,
                               initializer="ones")

    def touch(name: str, row: int) -> list[Entry]:
        return [Entry(name, IDS, np.array([row], dtype=np.int64)), Entry(name, ROWS, np.ones((1, 2), np.float32))]

    cut, whole = servers.start(), servers.start()
    init(cut, [part("emb/part_0", 5, 0), part("emb/part_1", 5, 5)], ADAM)
    init(whole, [part("emb", 10, 0)], ADAM)
    for step in range(1, 6):
        push(cut, step, touch("emb/part_0", 1))
        push(whole, step, touch("emb", 1))
    push(cut, 6, touch("emb/part_1", 1))
    push(whole, 6, touch("emb", 6))
    parts = pull_dense(cut, ["emb/part_0", "emb/part_1"])
    np.testing.assert_array_equal(np.concatenate([parts["emb/part_0"], parts["emb/part_1"]]),
                                  pull_dense(whole, ["emb"])["emb"])
    # lazy Adam at t = 6 on a row first touched then: m = 0.1, v = 0.001 (TF's ApplyAdam, in float64 here)
    lr_t = 0.01 * np.sqrt(1 - 0.999**6) / (1 - 0.9**6)
    np.testing.assert_allclose(parts["emb/part_1"][1], 1 - lr_t * 0.1 / (np.sqrt(0.001) + 1e-7), rtol=1e-6)

    shards = [Entry(name, DENSE, EMPTY) for name in ("emb/part_0", "emb/part_1")]
    counts = {e.name: int(e.array) for e in cut.store.pull(shards, include_slots=True) if e.name.endswith("#t")}
    assert counts == {"emb/part_0#t": 6, "emb/part_1#t": 6}
    # restored (a checkpoint of an older psctl, with a count per shard: the most advanced one's), it counts on
    restore = [e for e in cut.store.pull(shards, include_slots=True)]
    restore = [Entry(e.name, e.kind, np.asarray(9 if e.name == "emb/part_0#t" else 4, np.int64))
               if e.name.endswith("#t") else e for e in restore]
    cut.client.assign({0: restore}, 6, [])
    push(cut, 7, touch("emb/part_1", 2))
    counts = {e.name: int(e.array) for e in cut.store.pull(shards, include_slots=True) if e.name.endswith("#t")}
    assert counts == {"emb/part_0#t": 10, "emb/part_1#t": 10}


def test_sparse_push_changes_only_the_given_rows(ps: Ps) -> None:
    init(ps)
    start = initial_value(EMB)
    ids = np.array([4, 1], dtype=np.int64)
    rows = np.array([[1.0, -2.0], [0.5, 0.25]], dtype=np.float32)
    assert push(ps, 1, [Entry("emb/part_1", IDS, ids), Entry("emb/part_1", ROWS, rows)]).applied
    value = pull_dense(ps)["emb/part_1"]
    for r in range(5):
        if r in (1, 4):
            want = start[r] - np.float32(LR) * rows[list(ids).index(r)]
            assert value[r].tobytes() == want.tobytes(), r
        else:
            assert value[r].tobytes() == start[r].tobytes(), r
    # a repeated id gets the sum of its rows, applied once
    dup = np.array([[1.0, 1.0], [2.0, -4.0]], dtype=np.float32)
    assert push(ps, 2, [Entry("emb/part_1", IDS, np.array([3, 3])), Entry("emb/part_1", ROWS, dup)]).applied
    after = pull_dense(ps)["emb/part_1"]
    assert after[3].tobytes() == (start[3] - np.float32(LR) * (dup[0] + dup[1])).tobytes()
    np.testing.assert_array_equal(np.delete(after, 3, axis=0), np.delete(value, 3, axis=0))
    # row pulls answer the rows asked for, in the order asked, duplicates included
    pulled, _ = ps.client.pull({0: [Entry("emb/part_1", IDS, np.array([4, 0, 4], dtype=np.int64))]})
    (entry,) = pulled[0]
    assert (entry.name, entry.kind) == ("emb/part_1", ROWS)
    assert entry.array.tobytes() == after[[4, 0, 4]].tobytes()


def test_shard_positions_keep_the_highest_applied_position(ps: Ps) -> None:
    init(ps)
    push(ps, 1, [], shard=1, position=5)
    push(ps, 2, [], shard=1, position=3)
    push(ps, 3, [], shard=0, position=0)
    push(ps, 3, [], shard=0, position=9)  # a duplicate: its position is not recorded
    assert list(state(ps).shard_positions) == [0, 5]


# -- refusals -----------------------------------------------------------------------------------------------
BAD_STEP = 100


def _push_entries(entries: list[Entry], step_id: int = BAD_STEP) -> Callable[[Ps], object]:
    return lambda ps: push(ps, step_id, entries)


def _stub_push(entries: list[Entry], step_id: int = BAD_STEP) -> Callable[[Ps], object]:
    """A push straight through the stub (PsClient reads some codes as "PS unavailable")."""
    request = pb.PushRequest(step_id=step_id, task="worker:0", incarnation=1, increment_global_step=True)
    wire.add_entries(request.entries, entries)
    return lambda ps: ps.stub.Push(request, timeout=30)


def _raw_push(*pieces: pb.NamedTensor, step_id: int = BAD_STEP) -> Callable[[Ps], object]:
    request = pb.PushRequest(step_id=step_id, task="worker:0", incarnation=1, increment_global_step=True)
    request.entries.extend(pieces)
    return lambda ps: ps.stub.Push(request, timeout=30)


def _stream_push(chunks: list[list[pb.NamedTensor]]) -> Callable[[Ps], object]:
    def call(ps: Ps) -> object:
        parts = [
            pb.PushChunk(
                part=pb.PushRequest(
                    step_id=BAD_STEP, task="worker:0", incarnation=1, increment_global_step=True, entries=group
                )
                if i == 0
                else pb.PushRequest(entries=group)
            )
            for i, group in enumerate(chunks)
        ]
        return ps.stub.PushStream(iter(parts), timeout=30)

    return call


def _pull(entries: list[Entry], stream: bool = False) -> Callable[[Ps], object]:
    def call(ps: Ps) -> object:
        request = pb.PullRequest()
        wire.add_entries(request.entries, entries)
        if stream:
            return list(ps.stub.PullStream(request, timeout=30))
        return ps.stub.Pull(request, timeout=30)

    return call


def _piece(
    name: str, dtype: str, shape: list[int], data: bytes, *, kind: int = DENSE, offset: int = 0
) -> pb.NamedTensor:
    return pb.NamedTensor(name=name, kind=kind, tensor=pb.Tensor(dtype=dtype, shape=shape, data=data, offset=offset))


def _pieces(entry: Entry, chunk_bytes: int) -> list[pb.NamedTensor]:
    return [p for group in wire.iter_chunks([entry], chunk_bytes=chunk_bytes) for p in group]


def _framed(method: str, *frames: bytes, stream: bool = False) -> Callable[[Ps], object]:
    """Raw bytes to a framed rpc: one frame to a unary one, or a stream of frames."""

    def call(ps: Ps) -> object:
        channel = ps.client._channels[0]
        path = f"/{wire.PS_SERVICE}/{method}"
        if stream:
            return channel.stream_unary(path)(iter(frames), timeout=30)
        if method == "PullFramedStream":
            return list(channel.unary_stream(path)(frames[0], timeout=30))
        return channel.unary_unary(path)(frames[0], timeout=30)

    return call


def _push_header(**fields: object) -> pb.PushRequest:
    return pb.PushRequest(**{"step_id": BAD_STEP, "task": "worker:0", "incarnation": 1,
                             "increment_global_step": True, **fields})  # fmt: skip


def _push_frame(entries: list[Entry], **fields: object) -> bytes:
    return wire.encode_frame(_push_header(**fields), entries)


def _push_frames(entries: list[Entry], **fields: object) -> list[bytes]:
    """A streamed push in frames of 16 bytes of payload."""
    return list(wire.frames(entries, _push_header(**fields), 16))


GOOD_W = Entry("w", DENSE, w_grad())
NAN_W = Entry("w", DENSE, np.where(np.eye(4, 3, dtype=bool), np.float32(np.nan), w_grad()))
INF_LAST_W = Entry("w", DENSE, np.where(np.arange(12).reshape(4, 3) == 11, np.float32(np.inf), w_grad()))
EMB_IDS = "emb/part_1"
W_PIECES = _pieces(GOOD_W, 16)  # 48 bytes -> offsets 0, 16, 32

#: name -> (the refused call, the status code it must get)
REFUSALS: dict[str, tuple[Callable[[Ps], object], grpc.StatusCode]] = {
    "unknown-variable": (_push_entries([Entry("nope", DENSE, w_grad())]), grpc.StatusCode.INVALID_ARGUMENT),
    "wrong-dtype": (_push_entries([Entry("w", DENSE, w_grad().astype(np.float64))]), grpc.StatusCode.INVALID_ARGUMENT),
    "wrong-shape": (_push_entries([Entry("w", DENSE, w_grad().reshape(3, 4))]), grpc.StatusCode.INVALID_ARGUMENT),
    "wrong-rank": (_push_entries([Entry("w", DENSE, w_grad().reshape(12))]), grpc.StatusCode.INVALID_ARGUMENT),
    "ids-out-of-range": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([0, 5])), Entry(EMB_IDS, ROWS, np.ones((2, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "negative-ids": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([-1])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "huge-uint64-ids": (
        _push_entries(
            [
                Entry(EMB_IDS, IDS, np.array([2**64 - 1], dtype=np.uint64)),
                Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32)),
            ]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "float-ids": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([1.0])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "2d-ids": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([[1]])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "ids-without-rows": (_push_entries([Entry(EMB_IDS, IDS, np.array([1]))]), grpc.StatusCode.INVALID_ARGUMENT),
    "rows-without-ids": (
        _push_entries([Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "rows-count-mismatch": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([1, 2])), Entry(EMB_IDS, ROWS, np.ones((3, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "rows-wrong-dtype": (
        _push_entries([Entry(EMB_IDS, IDS, np.array([1])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float64))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "nan-gradient": (_push_entries([NAN_W]), grpc.StatusCode.INVALID_ARGUMENT),
    "inf-float64-gradient": (
        _push_entries([Entry("b", DENSE, np.array([0.0, np.inf, 1.0]))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "nan-sparse-rows": (
        _push_entries(
            [Entry(EMB_IDS, IDS, np.array([1])), Entry(EMB_IDS, ROWS, np.array([[np.nan, 0.0]], np.float32))]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # atomicity: a good gradient beside a bad one is not applied either
    "good-and-bad-together": (
        _push_entries([GOOD_W, Entry(EMB_IDS, IDS, np.array([9])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "good-and-nan-together": (
        _push_entries([GOOD_W, Entry("b", DENSE, np.array([np.nan, 0.0, 0.0]))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "low-rank-left-only": (_push_entries(low_rank(LEFT, RIGHT)[:1]), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-right-only": (_push_entries(low_rank(LEFT, RIGHT)[1:]), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-k-differs": (_push_entries(low_rank(LEFT, RIGHT[:1])), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-wrong-rows": (_push_entries(low_rank(LEFT[:, :3], RIGHT)), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-wrong-columns": (_push_entries(low_rank(LEFT, RIGHT[:, :2])), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-1d-factor": (_push_entries(low_rank(LEFT[0], RIGHT[0])), grpc.StatusCode.INVALID_ARGUMENT),
    "low-rank-wrong-dtype": (
        _push_entries(low_rank(LEFT.astype(np.float64), RIGHT)), grpc.StatusCode.INVALID_ARGUMENT
    ),
    "low-rank-of-a-1d-variable": (
        _push_entries(low_rank(np.ones((1, 3)), np.ones((1, 1)), "b")), grpc.StatusCode.INVALID_ARGUMENT
    ),
    "low-rank-nan-factor": (
        _push_entries(low_rank(np.where(LEFT == 3.0, np.float32(np.nan), LEFT), RIGHT)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # finite factors whose product overflows float32: refused by the check of the product
    "low-rank-product-overflows": (
        _push_entries(low_rank(np.full((2, 4), 1e30, np.float32), np.full((2, 3), 1e30, np.float32))),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "low-rank-and-dense-together": (
        _push_entries([GOOD_W, *low_rank(LEFT, RIGHT)]), grpc.StatusCode.INVALID_ARGUMENT
    ),
    "low-rank-beside-a-bad-gradient": (
        _push_entries([*low_rank(LEFT, RIGHT), Entry("b", DENSE, np.array([np.nan, 0.0, 0.0]))]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "step-id-zero": (_push_entries([GOOD_W], step_id=0), grpc.StatusCode.INVALID_ARGUMENT),
    "step-id-zero-empty": (_push_entries([], step_id=0), grpc.StatusCode.INVALID_ARGUMENT),
    "gradient-twice": (
        _raw_push(
            _piece("w", "float32", [4, 3], GOOD_W.array.tobytes()),
            _piece("w", "float32", [4, 3], GOOD_W.array.tobytes()),
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "short-data": (_raw_push(_piece("w", "float32", [4, 3], b"\0" * 44)), grpc.StatusCode.INVALID_ARGUMENT),
    "unknown-wire-dtype": (_raw_push(_piece("w", "complex64", [4, 3], b"\0" * 96)), grpc.StatusCode.INVALID_ARGUMENT),
    "unknown-kind": (
        _raw_push(_piece("w", "float32", [4, 3], GOOD_W.array.tobytes(), kind=9)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "negative-dim": (_raw_push(_piece("w", "float32", [-4, -3], b"")), grpc.StatusCode.INVALID_ARGUMENT),
    "oversize-shape": (_raw_push(_piece("w", "float32", [1 << 40, 1 << 40], b"")), grpc.StatusCode.INVALID_ARGUMENT),
    "oversize-zero-size-shape": (
        _raw_push(_piece("w", "float32", [0, 1 << 62], b"")),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "rank-9": (_raw_push(_piece("w", "float32", [1] * 9, b"\0" * 4)), grpc.StatusCode.INVALID_ARGUMENT),
    "stream-out-of-order": (
        _stream_push([[W_PIECES[0]], [W_PIECES[2]], [W_PIECES[1]]]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "stream-missing-piece": (_stream_push([[W_PIECES[0]], [W_PIECES[1]]]), grpc.StatusCode.INVALID_ARGUMENT),
    "stream-shape-disagrees": (
        _stream_push([[W_PIECES[0]], [_piece("w", "float32", [3, 4], b"\0" * 16, offset=16)], [W_PIECES[2]]]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "stream-empty": (_stream_push([]), grpc.StatusCode.INVALID_ARGUMENT),
    "stream-nan": (_stream_push([[p] for p in _pieces(NAN_W, 16)]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-unknown-variable": (_pull([Entry("nope", DENSE, EMPTY)]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-stream-unknown-variable": (
        _pull([Entry("nope", DENSE, EMPTY)], stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "pull-ids-out-of-range": (_pull([Entry(EMB_IDS, IDS, np.array([5]))]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-negative-ids": (_pull([Entry(EMB_IDS, IDS, np.array([-1]))]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-float-ids": (_pull([Entry(EMB_IDS, IDS, np.array([0.0]))]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-rows-kind": (_pull([Entry("w", ROWS, EMPTY)]), grpc.StatusCode.INVALID_ARGUMENT),
    "pull-ids-out-of-range-1d": (_pull([Entry("b", IDS, np.array([3]))]), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-truncated": (_framed("PushFramed", _push_frame([GOOD_W])[:-5]), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-header-overruns": (
        _framed("PushFramed", b"\x0a\xff\xff\x03" + _push_frame([GOOD_W])[4:]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-garbage": (_framed("PushFramed", b"\x07garbage\x00\xff"), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-garbage-header": (_framed("PushFramed", b"\x0a\x03\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-trailing-bytes": (
        _framed("PushFramed", _push_frame([GOOD_W]) + b"\x22\x00"), grpc.StatusCode.INVALID_ARGUMENT
    ),
    "framed-data-in-header": (  # the plain form's inline bytes in a frame's header
        _framed("PushFramed", pb.PushRequestFrame(header=_push_header(entries=[
            _piece("w", "float32", [4, 3], GOOD_W.array.tobytes())])).SerializeToString()),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-nan": (_framed("PushFramed", _push_frame([NAN_W])), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-step-id-zero": (_framed("PushFramed", _push_frame([GOOD_W], step_id=0)), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-pull-dense-unknown": (
        _framed("PushFramed", _push_frame([GOOD_W], pull_dense=["w", "nope"])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-pull-dense": (
        _framed("PushFramedStream", *_push_frames([GOOD_W], pull_dense=["w"]), stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-rows-out-of-range": (
        _framed("PushFramed", _push_frame([GOOD_W, Entry(EMB_IDS, PULL_IDS, np.array([0, 5]))])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-rows-unknown": (
        _framed("PushFramed", _push_frame([GOOD_W, Entry("nope", PULL_IDS, np.array([0]))])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-rows-negative-id": (
        _framed("PushFramed", _push_frame([GOOD_W, Entry(EMB_IDS, PULL_IDS, np.array([-1]))])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-rows-float-ids": (
        _framed("PushFramed", _push_frame([GOOD_W, Entry(EMB_IDS, PULL_IDS, np.array([0.0]))])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-pull-rows": (
        _framed("PushFramedStream", *_push_frames([GOOD_W, Entry(EMB_IDS, PULL_IDS, np.array([0]))]), stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-inf-in-last-piece": (
        _framed("PushFramedStream", *_push_frames([INF_LAST_W]), stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-truncated-frame": (
        _framed("PushFramedStream", *(lambda f: [f[0], f[1][:-3], *f[2:]])(_push_frames([GOOD_W])), stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-missing-frame": (
        _framed("PushFramedStream", *_push_frames([GOOD_W])[:-1], stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-stream-empty": (_framed("PushFramedStream", stream=True), grpc.StatusCode.INVALID_ARGUMENT),
    "framed-pull-truncated": (
        _framed("PullFramed", wire.encode_frame(pb.PullRequest(), [Entry(EMB_IDS, IDS, np.array([1, 2]))])[:-4]),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # a shard index of 2**31-1 made every later GetState build billions of positions under the store's lock
    "framed-shard-beyond-any-run": (
        _framed("PushFramed", _push_frame([GOOD_W], shard=limits.MAX_DATA_SHARDS, position=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-ids-out-of-range": (
        _framed("PullFramed", wire.encode_frame(pb.PullRequest(), [Entry(EMB_IDS, IDS, np.array([1, 5]))])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-pull-stream-unknown-variable": (
        _framed("PullFramedStream", wire.encode_frame(pb.PullRequest(), [Entry("nope", DENSE, EMPTY)])),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "framed-assign-incomplete": (
        _framed("AssignFramedStream", *wire.frames([Entry("w", DENSE, w_grad())], pb.AssignRequest(global_step=5)),
                stream=True),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "init-other-cluster": (lambda ps: init(ps, optimizer=ADAM, cluster_id="other"), grpc.StatusCode.PERMISSION_DENIED),
    "init-different-specs": (lambda ps: init(ps, [W], optimizer=ADAM), grpc.StatusCode.FAILED_PRECONDITION),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_request_is_refused_and_changes_nothing(ps: Ps, case: str) -> None:
    call, code = REFUSALS[case]
    init(ps, optimizer=ADAM)  # Adam: slots (m, v) and a step counter (t) that a leaked update would move
    # some history first, so that counters, step ids and slots are not all zero
    assert push(
        ps,
        1,
        [GOOD_W, Entry(EMB_IDS, IDS, np.array([2])), Entry(EMB_IDS, ROWS, np.ones((1, 2), np.float32))],
        shard=0,
        position=0,
    ).applied
    assert push(ps, 1, [GOOD_W]).applied is False
    before = snapshot(ps)

    assert rpc_code(lambda: call(ps)) == code

    after = snapshot(ps)
    assert after.state == before.state
    assert after.values == before.values
    assert after.slots == before.slots
    # still serving, and the refused request did not use up its step id
    response = push(ps, BAD_STEP, [GOOD_W])
    assert response.applied
    assert response.global_step == before.state.global_step + 1
    assert pull_dense(ps)["w"].tobytes() != before.values["w"]


def test_a_pull_of_more_rows_than_the_shard_has_is_refused_before_they_are_gathered(ps: Ps) -> None:
    """Ids of one byte each asked a PS to gather 256 times the request's size (any member may pull): a pull may
    ask for as many rows as the shard has (an evaluation asks for every row a test split touches), no more."""
    init(ps, optimizer=ADAM)  # (emb/part_1: 5 rows)
    pull = _framed("PullFramed", wire.encode_frame(pb.PullRequest(), [Entry(EMB_IDS, IDS, np.zeros(6, np.uint8))]))
    assert rpc_code(lambda: pull(ps)) == grpc.StatusCode.INVALID_ARGUMENT
    fits = _framed("PullFramed", wire.encode_frame(pb.PullRequest(), [Entry(EMB_IDS, IDS, np.zeros(5, np.uint8))]))
    assert len(wire.read_frame(fits(ps), pb.PullResponse)[1][0].array) == 5


def test_a_streamed_push_is_refused_at_its_first_non_finite_piece_before_the_rest_is_sent(ps: Ps) -> None:
    """Each piece of a streamed gradient is checked as it arrives: the PS refuses at the bad piece instead of
    waiting for the end of the stream (the check overlaps the transfer). The client's stream blocks after its
    first frames, so a PS that waited for the whole stream would leave the call to its deadline."""
    init(ps)
    before = snapshot(ps)
    frames = _push_frames([NAN_W])  # the NaN sits in the first frame's piece
    rest_may_go = threading.Event()

    def request_frames() -> Iterator[bytes]:
        yield frames[0]
        rest_may_go.wait(timeout=30)
        yield from frames[1:]

    path = f"/{wire.PS_SERVICE}/PushFramedStream"
    try:
        call = lambda: ps.client._channels[0].stream_unary(path)(request_frames(), timeout=20)  # noqa: E731
        started = time.monotonic()
        assert rpc_code(call) == grpc.StatusCode.INVALID_ARGUMENT
        assert time.monotonic() - started < 15  # refused while the rest was held back, not at the deadline
    finally:
        rest_may_go.set()
    after = snapshot(ps)
    assert (after.state, after.values, after.slots) == (before.state, before.values, before.slots)


def test_push_from_a_fenced_incarnation_is_refused_and_changes_nothing_else(ps: Ps) -> None:
    init(ps, optimizer=ADAM)
    assert push(ps, 1, [GOOD_W], task="worker:1", incarnation=2).applied
    before = snapshot(ps)
    assert rpc_code(lambda: push(ps, 2, [GOOD_W], task="worker:1", incarnation=1)) == grpc.StatusCode.PERMISSION_DENIED
    after = snapshot(ps)
    assert after.values == before.values
    assert after.slots == before.slots
    expected = pb.StateResponse()
    expected.CopyFrom(before.state)
    expected.fenced_updates += 1  # the only thing a fenced push changes is the count of fenced pushes
    assert after.state == expected
    # the old incarnation stays fenced; the current one and other tasks are served
    assert rpc_code(lambda: push(ps, 3, [], task="worker:1", incarnation=1)) == grpc.StatusCode.PERMISSION_DENIED
    assert push(ps, 2, [GOOD_W], task="worker:1", incarnation=2).applied
    assert push(ps, 4, [GOOD_W], task="worker:0", incarnation=1).applied
    assert push(ps, 5, [], task="worker:1", incarnation=3).applied  # a newer incarnation takes over
    assert rpc_code(lambda: push(ps, 6, [], task="worker:1", incarnation=2)) == grpc.StatusCode.PERMISSION_DENIED
    assert state(ps).fenced_updates == 3


def test_requests_before_init_are_refused_with_failed_precondition(ps: Ps) -> None:
    before = state(ps)
    assert not before.initialized
    calls = {
        "pull": _pull([Entry("w", DENSE, EMPTY)]),
        "pull-stream": _pull([Entry("w", DENSE, EMPTY)], stream=True),
        "pull-ids": _pull([Entry(EMB_IDS, IDS, np.array([0]))]),
        "push": _stub_push([GOOD_W], step_id=1),
        "push-stream": _stream_push([[p] for p in W_PIECES]),
    }
    for name, call in calls.items():
        assert rpc_code(lambda call=call: call(ps)) == grpc.StatusCode.FAILED_PRECONDITION, name
        assert state(ps) == before, name
    # PsClient reads "no variables" as a PS that restarted and lost them
    with pytest.raises(PsUnavailable, match="lost its variables"):
        push(ps, 1, [GOOD_W])
    assert state(ps) == before
    init(ps)
    assert push(ps, 1, [GOOD_W]).applied  # step 1 was not used up by the refused pushes


def test_empty_push_before_init_is_refused_and_records_nothing(ps: Ps) -> None:
    # A PS that restarted empty still receives workers' empty pushes (every PS gets one per step). They
    # must be refused like any other request before Init, without recording the step id as applied.
    before = state(ps)
    assert rpc_code(lambda: _stub_push([], step_id=1)(ps)) == grpc.StatusCode.FAILED_PRECONDITION
    assert state(ps) == before
    init(ps)
    assert push(ps, 1, []).applied


# -- large variables ----------------------------------------------------------------------------------------
def test_large_variable_round_trips_through_the_streaming_rpcs(ps: Ps) -> None:
    big = pb.VariableSpec(name="big", dtype="float32", shape=[3072, 4096], initializer="normal", seed=5)  # 48 MiB
    nbytes = 3072 * 4096 * 4
    assert nbytes > 2 * limits.UNARY_MAX_BYTES
    init(ps, [big])
    want = initial_value(big)

    # one unary message cannot carry it: the streamed pull below is the only way it can arrive
    request = pb.PullRequest()
    wire.add_entries(request.entries, [Entry("big", DENSE, EMPTY)])
    assert rpc_code(lambda: ps.stub.Pull(request, timeout=60)) == grpc.StatusCode.RESOURCE_EXHAUSTED

    pulled, step = ps.client.pull({0: [Entry("big", DENSE, EMPTY)]}, {0: nbytes})
    (entry,) = pulled[0]
    assert step == 0
    assert entry.array.shape == (3072, 4096)
    assert entry.array.tobytes() == want.tobytes()

    grad = np.random.default_rng(0).standard_normal((3072, 4096), dtype=np.float32)
    assert wire.payload_bytes([Entry("big", DENSE, grad)]) > limits.UNARY_MAX_BYTES  # PsClient streams it
    response = push(ps, 1, [Entry("big", DENSE, grad)])
    assert response.applied and response.global_step == 1

    pulled, step = ps.client.pull({0: [Entry("big", DENSE, EMPTY)]}, {0: nbytes})
    assert step == 1
    assert pulled[0][0].array.tobytes() == (want - np.float32(LR) * grad).tobytes()
    s = state(ps)
    assert (s.applied_updates, list(s.applied_step_ids)) == (1, [1])

    # a retry of the streamed step is recognised as a duplicate, exactly like a unary one
    assert not push(ps, 1, [Entry("big", DENSE, grad)]).applied
    assert state(ps).duplicate_updates == 1


# -- push and pull in one round trip ------------------------------------------------------------------------
def test_push_pull_answers_the_variables_right_after_the_update(ps: Ps) -> None:
    init(ps)
    g = w_grad(0.37)
    header = PushHeader(step_id=1, task="worker:0", incarnation=1)
    both = {0: [whole_shard("w"), whole_shard("b")]}
    responses, pulled = ps.client.push_pull(header, {0: [Entry("w", DENSE, g)]}, both)
    assert responses[0].applied and responses[0].global_step == 1
    got = {e.name: e.array for e in pulled[0]}
    assert got["w"].tobytes() == (initial_value(W) - np.float32(LR) * g).tobytes()
    assert got["b"].tobytes() == initial_value(B).tobytes()
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in pull_dense(ps, ["w", "b"]).items()}
    # a retry: not applied again, and still answered with the variables as they are
    responses, again = ps.client.push_pull(header, {0: [Entry("w", DENSE, g)]}, {0: [whole_shard("w")]})
    assert not responses[0].applied
    assert again[0][0].array.tobytes() == got["w"].tobytes()
    assert state(ps).applied_updates == 1


def test_a_push_brings_back_the_rows_it_asks_for_as_they_are_right_after_the_update(ps: Ps) -> None:
    init(ps)
    grads = {0: [Entry(EMB_IDS, IDS, np.array([1, 4])), Entry(EMB_IDS, ROWS, np.full((2, 2), 0.5, np.float32))]}
    asked = np.array([4, 0, 4], dtype=np.int64)  # in the order asked, duplicates included
    header = PushHeader(step_id=1, task="worker:0", incarnation=1)
    responses, pulled = ps.client.push_pull(header, grads, {0: [Entry(EMB_IDS, IDS, asked), whole_shard("b")]})
    assert responses[0].applied
    after = pull_dense(ps)
    assert after[EMB_IDS][4].tobytes() != initial_value(EMB)[4].tobytes()  # row 4 was updated, then read
    assert [(e.name, e.kind) for e in pulled[0]] == [("b", DENSE), (EMB_IDS, ROWS)]  # whole shards first
    assert pulled[0][1].array.tobytes() == after[EMB_IDS][asked].tobytes()
    assert pulled[0][0].array.tobytes() == after["b"].tobytes()


def test_a_push_asking_back_more_than_one_message_holds_is_refused_and_changes_nothing(ps: Ps) -> None:
    big = pb.VariableSpec(name="big", dtype="float32", shape=[limits.UNARY_MAX_BYTES // 4 + 1], initializer="ones")
    init(ps, [*SPECS, big])
    before = snapshot(ps)
    code = rpc_code(lambda: _framed("PushFramed", _push_frame([GOOD_W], pull_dense=["w", "big"]))(ps))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(ps) == before
    assert push(ps, BAD_STEP, [GOOD_W]).applied  # the step id was not used up


def test_a_push_asking_back_more_rows_than_one_message_holds_is_refused_and_changes_nothing(
    ps: Ps, monkeypatch: pytest.MonkeyPatch
) -> None:
    init(ps)
    before = snapshot(ps)
    monkeypatch.setattr(limits, "UNARY_MAX_BYTES", 4 * 2 * 4)  # room for 4 of EMB's rows (2 float32 each)
    asked = Entry(EMB_IDS, PULL_IDS, np.array([0, 1, 2, 3, 4]))
    code = rpc_code(lambda: _framed("PushFramed", _push_frame([GOOD_W, asked]))(ps))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    monkeypatch.undo()
    assert snapshot(ps) == before
    assert push(ps, BAD_STEP, [GOOD_W]).applied  # the step id was not used up


def test_push_pull_needs_gradients_that_fit_one_message(ps: Ps) -> None:
    big = Entry("w", DENSE, np.zeros(limits.UNARY_MAX_BYTES // 4 + 1, np.float32))
    with pytest.raises(ValueError, match="do not fit one message"):
        ps.client.push_pull(PushHeader(step_id=1, task="worker:0", incarnation=1), {0: [big]}, {0: [whole_shard("w")]})


def test_a_plain_grpc_server_serves_the_framed_rpcs_too(servers: Servers) -> None:
    # Frames are ordinary protobuf messages: the generated registration parses and re-encodes them (slower).
    big = pb.VariableSpec(name="big", dtype="float32", shape=[limits.UNARY_MAX_BYTES // 4 + 7], initializer="ones")
    ps = servers.start(generated=True)
    init(ps, [*SPECS, big])
    g = w_grad(2.0)
    large = np.full(tuple(big.shape), 0.5, np.float32)
    assert push(ps, 1, [Entry("w", DENSE, g), Entry("big", DENSE, large)]).applied  # streamed
    _, pulled = ps.client.push_pull(PushHeader(step_id=2, task="worker:0", incarnation=1),
                                    {0: [Entry("w", DENSE, g)]}, {0: [whole_shard("w")]})  # fmt: skip
    want = initial_value(W) - np.float32(LR) * g - np.float32(LR) * g
    assert pulled[0][0].array.tobytes() == want.tobytes()
    values, _ = ps.client.pull({0: [Entry("big", DENSE, EMPTY)]}, {0: large.nbytes})  # streamed
    assert values[0][0].array.tobytes() == (np.float32(1) - np.float32(LR) * large).tobytes()
    before = snapshot(ps)
    assert rpc_code(lambda: _framed("PushFramed", _push_frame([NAN_W]))(ps)) == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot(ps) == before


# -- dense updates in blocks --------------------------------------------------------------------------------
def _split(g: np.ndarray, cuts: list[int]) -> wire.SplitArray:
    """``g`` as it would arrive in pieces ending at element ``cuts`` (read-only views, no copy)."""
    flat = g.reshape(-1)
    flat.flags.writeable = False
    bounds = [0, *[c for c in cuts if 0 < c < flat.size], flat.size]
    return wire.SplitArray(g.dtype, g.shape, tuple(flat[a:b] for a, b in itertools.pairwise(bounds)))


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam"])
@pytest.mark.parametrize("size", [ps_module.UPDATE_BLOCK - 1, 3 * ps_module.UPDATE_BLOCK + 17,
                                  ps_module.PARALLEL_MIN + ps_module.UPDATE_BLOCK // 2])  # fmt: skip
@pytest.mark.parametrize("arrival", ["whole", "in pieces"])
def test_large_dense_updates_in_blocks_equal_one_whole_update_bit_for_bit(
    optimizer: str, size: int, arrival: str
) -> None:
    """Blocks (and threads), and a streamed gradient applied piece by piece where it arrived, change nothing:
    the result is bit for bit the rule's own update of the whole array, Adam's step count included."""
    spec = pb.VariableSpec(name="v", dtype="float32", shape=[size], initializer="normal", seed=3)
    store = VariableStore(cluster_id=CLUSTER)
    store.init([spec], pb.OptimizerConfig(name=optimizer, learning_rate=0.01))
    reference = make_optimizer(optimizer, 0.01)
    value = initial_value(spec)
    slots = reference.create_slots(value)
    rng = np.random.default_rng(size)
    for step in range(1, 4):
        g = rng.standard_normal(size, dtype=np.float32)
        reference.apply_dense(value, g, slots)
        header = pb.PushRequest(step_id=step, task="worker:0", incarnation=1, increment_global_step=True)
        if arrival == "whole":
            assert store.push(header, [Entry("v", DENSE, g)]).applied
        else:  # pieces of uneven sizes, cut inside blocks and across them
            cuts = [7, ps_module.UPDATE_BLOCK + 3, ps_module.UPDATE_BLOCK + 4, 2 * ps_module.UPDATE_BLOCK - 1]
            assert store.push(header, [], {"v": _split(g, cuts)}).applied
    shard = store._shards["v"]
    assert shard.value.tobytes() == value.tobytes()
    assert {k: v.tobytes() for k, v in shard.slots.items()} == {k: v.tobytes() for k, v in slots.items()}


def test_a_gradient_in_pieces_with_a_nan_in_its_last_piece_changes_nothing() -> None:
    spec = pb.VariableSpec(name="v", dtype="float32", shape=[4 * ps_module.UPDATE_BLOCK], initializer="normal")
    store = VariableStore(cluster_id=CLUSTER)
    store.init([spec], pb.OptimizerConfig(name="adam", learning_rate=0.01))
    shard = store._shards["v"]
    before = shard.value.tobytes(), {k: v.tobytes() for k, v in shard.slots.items()}
    g = np.ones(spec.shape, np.float32)
    g[-1] = np.nan
    header = pb.PushRequest(step_id=1, task="worker:0", incarnation=1, increment_global_step=True)
    with pytest.raises(WireError, match="NaN or infinity"):
        store.push(header, [], {"v": _split(g, [ps_module.UPDATE_BLOCK, 3 * ps_module.UPDATE_BLOCK])})
    assert (shard.value.tobytes(), {k: v.tobytes() for k, v in shard.slots.items()}) == before
    assert (store.global_step, store.applied_updates, list(store._applied_log)) == (0, 0, [])


def test_a_gradient_given_whole_and_in_pieces_is_refused() -> None:
    store = VariableStore(cluster_id=CLUSTER)
    store.init([pb.VariableSpec(name="v", dtype="float32", shape=[8])], pb.OptimizerConfig(name="sgd", learning_rate=1))
    g = np.ones(8, np.float32)
    header = pb.PushRequest(step_id=1, task="worker:0", incarnation=1)
    with pytest.raises(WireError, match="given twice"):
        store.push(header, [Entry("v", DENSE, g)], {"v": _split(g, [4])})
    assert store.applied_updates == 0


def test_a_replaced_chief_cannot_init_restore_flush_or_checkpoint_and_changes_nothing(ps: Ps) -> None:
    """Fencing: once a ps has heard of chief incarnation 2, the old chief's Init, Assign (a restore from its
    checkpoints), SyncFlush and GetState are refused with ABORTED, which its client raises as ChiefReplaced."""
    new = PsClient([ps.address], timeout=30, chief_incarnation=2)
    old = PsClient([ps.address], timeout=30, chief_incarnation=1)
    try:
        new.init({0: list(SPECS)}, SGD, CLUSTER)
        assert push(ps, 1, [GOOD_W]).applied
        before = snapshot(ps)
        restore = {0: [Entry(spec.name, DENSE, initial_value(spec)) for spec in SPECS]}
        for refused in (lambda: old.init({0: list(SPECS)}, SGD, CLUSTER, reset=True),
                        lambda: old.assign(restore, 0, []),
                        lambda: old.sync_flush(1, 1),
                        lambda: old.state(0)):  # (a checkpoint's snapshot reads the state)  # fmt: skip
            with pytest.raises(ChiefReplaced, match="chief incarnation 1 was replaced by incarnation 2"):
                refused()
        after = snapshot(ps)  # (GetState without a chief incarnation: anyone may ask)
        assert (after.state, after.values, after.slots) == (before.state, before.values, before.slots)
        new.assign(restore, 7, [])  # the current chief still can
        assert state(ps).global_step == 7
    finally:
        new.close()
        old.close()


def test_a_restore_to_a_negative_global_step_is_refused_and_changes_nothing(ps: Ps) -> None:
    """A global step below 0 would have the chief train again steps done (and report a step behind the ps's)."""
    client = PsClient([ps.address], timeout=30)
    try:
        init(ps)
        assert push(ps, 1, [GOOD_W]).applied
        before = snapshot(ps)
        restore = {0: [Entry(spec.name, DENSE, initial_value(spec)) for spec in SPECS]}
        with pytest.raises(grpc.RpcError) as info:
            client.assign(restore, -7, [])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "global step must be >= 0, got -7" in info.value.details()  # type: ignore[attr-defined]
        after = snapshot(ps)
        assert (after.state, after.values, after.slots) == (before.state, before.values, before.slots)
        client.assign(restore, 0, [])  # step 0 is a step
        assert state(ps).global_step == 0
    finally:
        client.close()


def test_a_replaced_chief_learns_it_even_when_another_ps_is_down(ps: Ps) -> None:
    """The replaced chief must stop, not retry its restore while ps 0 (listed first) is unreachable."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening: connections are refused
        new = PsClient([ps.address], timeout=10, chief_incarnation=2)
        old = PsClient([down, ps.address], timeout=10, chief_incarnation=1)
        try:
            new.state(0)  # ps learns of chief incarnation 2
            with pytest.raises(ChiefReplaced):
                old.init({0: [], 1: list(SPECS)}, SGD, CLUSTER)
        finally:
            new.close()
            old.close()


def test_a_push_of_a_replaced_chiefs_step_is_refused_and_changes_nothing(ps: Ps) -> None:
    init(ps)
    new = PsClient([ps.address], timeout=30, chief_incarnation=2)
    try:
        new.state(0)  # the ps hears of chief incarnation 2
    finally:
        new.close()
    before = snapshot(ps)
    header = PushHeader(step_id=5, task="worker:0", incarnation=1, chief_incarnation=1)
    with pytest.raises(ChiefReplaced):
        ps.client.push(header, {0: [GOOD_W]})
    after = snapshot(ps)
    assert (after.state, after.values, after.slots) == (before.state, before.values, before.slots)
    for chief in (2, 0):  # the current chief's step, and one whose chief is not known, land
        assert ps.client.push(PushHeader(step_id=6 + chief, task="worker:0", incarnation=1, chief_incarnation=chief),
                              {0: [GOOD_W]})[0].applied  # fmt: skip


def test_variables_beyond_the_host_s_memory_are_refused_before_any_is_made(ps: Ps) -> None:
    """Shards each within a PS's limit, together (with Adam's two slots of each) beyond what this host has: the
    ps allocated them, and the kernel's OOM killer took it (other roles of the host with it) at every restart.
    Refused INVALID_ARGUMENT (a configuration error), nothing made; the PS serves on, and takes variables it can
    hold."""
    available = ps_module._host_memory()
    assert available is not None and available > 0
    rows = min(wire.MAX_ARRAY_BYTES, available) // (4 * 1024)  # each shard within the limit on one array
    shards = max(1, -(-available // (rows * 1024 * 4 * 3)) + 1)  # together (x3: value, m, v) beyond the host
    huge = [pb.VariableSpec(name=f"t/part_{i}", dtype="float32", shape=[rows, 1024], full_shape=[rows * shards, 1024],
                            row_offset=i * rows, initializer="zeros") for i in range(shards)]
    with pytest.raises(grpc.RpcError) as refused:
        ps.client.init({0: huge}, ADAM, CLUSTER)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "GiB with the optimizer's slots, more than this host's" in refused.value.details()  # type: ignore[attr-defined]
    assert not ps.store.initialized
    init(ps, optimizer=ADAM)
    assert ps.store.initialized

"""psctl.runtime.strategy against the TensorFlow reference table (docs: tf-ps-semantics.md)."""

from __future__ import annotations

import numpy as np
import pytest

from psctl.runtime.partitioners import FixedShards, MaxSize, MinSize, partitioner_from_config
from psctl.runtime.program import VariableDef
from psctl.runtime.strategy import (
    ShardInfo,
    VariableLayout,
    plan_layout,
    route_ids,
    shard_slices_for_global,
    stitch_rows,
)

MIB = 1 << 20


def _layout(shape: tuple[int, ...], shards: int, num_ps: int = 1) -> VariableLayout:
    return plan_layout([VariableDef("v", shape)], num_ps, FixedShards(shards))["v"]


# ---------------------------------------------------------------- partitioners: the reference table


@pytest.mark.parametrize(
    ("partitioner", "shape", "dtype", "expected"),
    [
        (FixedShards(5), (13, 4), "float32", [5, 1]),
        (FixedShards(5), (3,), "float32", [3]),
        (MinSize(256 << 10, 2), (1024, 1024), "float32", [2, 1]),
        (MinSize(8, 10), (5, 1), "float32", [3, 1]),
        (MaxSize(MIB), (1024, 1024), "float32", [4, 1]),
        (MaxSize(MIB - 1), (1024, 1024), "float32", [5, 1]),
        (MaxSize(MIB - 1, max_shards=3), (1024, 1024), "float32", [3, 1]),
        (MaxSize(1), (4, 1000), "float32", [4, 1]),  # a row larger than the cap still gets one shard
        (MinSize(), (1024, 1024), "float32", [1, 1]),  # default max_shards=1
        (MinSize(16, 100), (10,), "<U3", [10]),  # strings count bytes_per_string=16 each
        (MinSize(16, 100), (10,), object, [10]),
        (MinSize(16, 100, bytes_per_string=8), (10,), "S3", [5]),
        (MinSize(16, 100), (10,), "float64", [5]),
    ],
)
def test_partitioner_table(partitioner, shape, dtype, expected) -> None:
    assert partitioner(shape, dtype) == expected


def test_reference_fixed_shards_rows_and_offsets() -> None:
    layout = _layout((13, 4), 5)
    assert [s.shape for s in layout.shards] == [(3, 4), (3, 4), (3, 4), (2, 4), (2, 4)]
    assert [s.row_offset for s in layout.shards] == [0, 3, 6, 9, 11]
    assert [s.name for s in layout.shards] == [f"v/part_{i}" for i in range(5)]


def test_reference_min_size_layouts() -> None:
    big = plan_layout([VariableDef("w", (1024, 1024))], 2, MinSize(256 << 10, 2))["w"]
    assert [s.shape for s in big.shards] == [(512, 1024), (512, 1024)]
    small = plan_layout([VariableDef("w", (5, 1))], 2, MinSize(8, 10))["w"]
    assert [s.shape[0] for s in small.shards] == [2, 2, 1]


def test_reference_placement_three_ps() -> None:
    variables = [VariableDef("a", ()), VariableDef("b", (13, 4)), VariableDef("c", (3,)), VariableDef("d", ())]
    layouts = plan_layout(variables, 3, FixedShards(5))
    assert list(layouts) == ["a", "b", "c", "d"]
    assert [s.ps for s in layouts["a"].shards] == [0]
    assert [s.ps for s in layouts["b"].shards] == [1, 2, 0, 1, 2]
    assert [s.ps for s in layouts["c"].shards] == [0, 1, 2]
    assert [s.shape for s in layouts["c"].shards] == [(1,), (1,), (1,)]
    assert [s.ps for s in layouts["d"].shards] == [0]
    assert layouts["a"].shards == (ShardInfo("a", "a", 0, 0, 0, ()),)
    assert not layouts["a"].partitioned and layouts["b"].partitioned


def test_reference_ids_to_shard_and_row() -> None:
    shard, row = _layout((13, 4), 5).locate(np.array([0, 2, 3, 8, 9, 10, 11, 12]))
    assert list(zip(shard.tolist(), row.tolist(), strict=True)) == [
        (0, 0), (0, 2), (1, 0), (2, 2), (3, 0), (3, 1), (4, 0), (4, 1)
    ]  # fmt: skip


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedShards(0),
        lambda: MinSize(0),
        lambda: MinSize(1, 0),
        lambda: MinSize(1, 1, 0),
        lambda: MaxSize(0),
        lambda: MaxSize(1, 0),
        lambda: MaxSize(1, None, 0),
    ],
)
def test_partitioner_argument_errors(make) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        make()


def test_partitioner_from_config() -> None:
    assert partitioner_from_config(None) is None
    assert partitioner_from_config({"kind": "fixed", "num_shards": 2}) == FixedShards(2)
    assert partitioner_from_config({"kind": "min_size", "min_shard_bytes": 262144, "max_shards": 2}) == MinSize(
        262144, 2
    )
    assert partitioner_from_config({"kind": "max_size", "max_shard_bytes": MIB, "max_shards": 4}) == MaxSize(MIB, 4)
    with pytest.raises(ValueError, match=r"'bogus'.*fixed, max_size, min_size"):
        partitioner_from_config({"kind": "bogus"})
    with pytest.raises(ValueError, match=r"'shards'.*num_shards"):
        partitioner_from_config({"kind": "fixed", "shards": 2})
    with pytest.raises(ValueError, match="num_shards"):
        partitioner_from_config({"kind": "fixed"})
    with pytest.raises(ValueError, match=">= 1"):
        partitioner_from_config({"kind": "fixed", "num_shards": 0})


def test_plan_layout_errors() -> None:
    with pytest.raises(ValueError, match="num_ps"):
        plan_layout([VariableDef("v", (4,))], 0, None)
    with pytest.raises(ValueError, match="twice"):
        plan_layout([VariableDef("v", (4,)), VariableDef("v", (4,))], 1, None)
    with pytest.raises(ValueError, match=r"\[n, 1, \.\.\.\]"):
        plan_layout([VariableDef("v", (4, 4))], 1, lambda shape, dtype: [2, 2])
    with pytest.raises(ValueError, match=r"\[n, 1, \.\.\.\]"):
        plan_layout([VariableDef("v", (4, 4))], 1, lambda shape, dtype: [2])


def test_plan_layout_partitioner_only_for_rank_ge_1_and_n_capped() -> None:
    calls = []

    def spy(shape, dtype):
        calls.append(shape)
        return [7] + [1] * (len(shape) - 1)

    layouts = plan_layout([VariableDef("s", ()), VariableDef("v", (4, 2))], 2, spy)
    assert calls == [(4, 2)]
    assert len(layouts["v"].shards) == 4  # min(7, 4)
    assert plan_layout([VariableDef("v", (4, 2))], 2, None)["v"].shards == (ShardInfo("v", "v", 0, 0, 0, (4, 2)),)


def test_layout_rejects_a_non_div_split() -> None:
    var = VariableDef("v", (5,))
    with pytest.raises(ValueError, match="div split"):
        VariableLayout(var, (ShardInfo("v/part_0", "v", 0, 0, 0, (2,)), ShardInfo("v/part_1", "v", 1, 0, 2, (3,))))


# ---------------------------------------------------------------- locate, split, join, routing


def _brute_force(offsets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shard = np.array([max(i for i, off in enumerate(offsets) if off <= x) for x in ids.tolist()], np.int64)
    return shard, ids - offsets[shard]


def test_locate_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        d0 = int(rng.integers(1, 200))
        n = int(rng.integers(1, 40))
        layout = _layout((d0, 2), n)
        offsets = np.array([s.row_offset for s in layout.shards])
        ids = np.arange(d0)
        shard, row = layout.locate(ids)
        assert np.array_equal((shard, row), _brute_force(offsets, ids))
        sizes = np.array([s.shape[0] for s in layout.shards])
        assert (row < sizes[shard]).all()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32, np.uint64, np.int16])
def test_locate_integer_dtypes(dtype) -> None:
    shard, row = _layout((13, 4), 5).locate(np.array([12, 0], dtype=dtype))
    assert shard.tolist() == [4, 0] and row.tolist() == [1, 0]


@pytest.mark.parametrize("bad", [[1, -1, 20], [13], [0, 99, -3]])
def test_locate_out_of_range(bad) -> None:
    first = next(x for x in bad if x < 0 or x >= 13)
    with pytest.raises(ValueError, match=rf"id {first} .*\[0, 13\)"):
        _layout((13, 4), 5).locate(np.array(bad))


def test_locate_rejects_non_integer_ids_and_scalars() -> None:
    with pytest.raises(ValueError, match="integers"):
        _layout((13, 4), 5).locate(np.array([1.0]))
    with pytest.raises(ValueError, match="scalar"):
        plan_layout([VariableDef("s", ())], 1, None)["s"].locate(np.array([0]))


@pytest.mark.parametrize(("shape", "n"), [((13, 4), 5), ((7,), 7), ((10, 2, 3), 3), ((6, 2), 1), ((), 1)])
def test_split_join_round_trip(shape, n) -> None:
    layout = plan_layout([VariableDef("v", shape)], 2, FixedShards(n))["v"]
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    parts = layout.split(full)
    assert [p.shape for p in parts] == [s.shape for s in layout.shards]
    if shape:
        assert all(np.shares_memory(p, full) for p in parts)
    assert np.array_equal(layout.join(parts), full)
    with pytest.raises(ValueError):
        layout.join(parts[:-1] if len(parts) > 1 else [])


def test_route_and_stitch_equal_plain_gather() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        d0, n = int(rng.integers(1, 100)), int(rng.integers(1, 12))
        layout = _layout((d0, 3), n)
        full = rng.standard_normal((d0, 3))
        parts = layout.split(full)
        ids = rng.integers(0, d0, size=(int(rng.integers(0, 8)), 5))  # duplicates likely
        routed = route_ids(layout, ids)
        assert sorted(np.concatenate([p for _, p, _ in routed] or [np.array([], int)]).tolist()) == list(
            range(ids.size)
        )
        answers = [parts[info.index][rows] for info, _, rows in routed]
        got = stitch_rows(layout, ids, routed, answers)
        assert got.shape == (*ids.shape, 3)
        assert np.array_equal(got, full[ids])


def test_route_skips_untouched_shards() -> None:
    routed = route_ids(_layout((13, 4), 5), np.array([[12, 0], [12, 1]]))
    assert [info.index for info, _, _ in routed] == [0, 4]
    assert routed[1][1].tolist() == [0, 2] and routed[1][2].tolist() == [1, 1]


def test_stitch_rejects_wrong_answers() -> None:
    layout = _layout((13, 4), 5)
    ids = np.array([0, 12])
    routed = route_ids(layout, ids)
    with pytest.raises(ValueError, match="answered"):
        stitch_rows(layout, ids, routed, [np.zeros((1, 4))])
    with pytest.raises(ValueError, match="shape"):
        stitch_rows(layout, ids, routed, [np.zeros((1, 4)), np.zeros((2, 4))])


def test_shard_slices_for_global() -> None:
    layout = _layout((13, 4), 5)
    ids = np.array([12, 0, 5, 3])
    values = np.arange(16.0).reshape(4, 4)
    full = np.zeros((13, 4))
    parts = layout.split(full)
    slices = shard_slices_for_global(layout, ids, values)
    assert [info.index for info, _, _ in slices] == [0, 1, 4]
    for info, rows, vals in slices:
        parts[info.index][rows] += vals
    expected = np.zeros((13, 4))
    expected[ids] = values
    assert np.array_equal(full, expected)
    with pytest.raises(ValueError, match="unique"):
        shard_slices_for_global(layout, np.array([1, 1]), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="do not match"):
        shard_slices_for_global(layout, np.array([1, 2]), np.zeros((2, 3)))


def held_bytes(layouts: dict[str, VariableLayout], num_ps: int) -> list[int]:
    held = [0] * num_ps
    for layout in layouts.values():
        for shard in layout.shards:
            held[shard.ps] += int(np.prod(shard.shape)) * np.dtype(layout.variable.dtype).itemsize
    return held


def test_balanced_placement_spreads_the_bytes_where_round_robin_piles_them_on_one_ps() -> None:
    """A 1024-1024-1024-10 MLP (W3) on 2 ps: TensorFlow's round-robin puts every kernel on ps 0."""
    variables = []
    for i, (rows, cols) in enumerate([(1024, 1024), (1024, 1024), (1024, 1024), (1024, 10)]):
        variables += [VariableDef(f"l{i}/kernel", (rows, cols)), VariableDef(f"l{i}/bias", (cols,))]
    tf_order = plan_layout(variables, 2, None, placement="round_robin")
    assert {name: layout.shards[0].ps for name, layout in tf_order.items() if name.endswith("kernel")} == {
        "l0/kernel": 0, "l1/kernel": 0, "l2/kernel": 0, "l3/kernel": 0}
    assert held_bytes(tf_order, 2)[0] > 300 * held_bytes(tf_order, 2)[1]

    balanced = plan_layout(variables, 2, None, placement="balanced")
    held = held_bytes(balanced, 2)
    assert sum(held) == sum(held_bytes(tf_order, 2))
    assert max(held) - min(held) <= 1024 * 1024 * 4  # within one kernel: 2 kernels on one ps, 1 on the other
    assert balanced == plan_layout(variables, 2, None, placement="balanced")  # every role computes the same
    # the partitioning itself is TensorFlow's whatever the placement
    assert [s.shape for lay in balanced.values() for s in lay.shards] == [
        s.shape for lay in tf_order.values() for s in lay.shards]


def test_balanced_placement_deals_an_embeddings_equal_shards_one_per_ps() -> None:
    layouts = plan_layout([VariableDef("bias", (1,)), VariableDef("table", (1000, 64))], 4, FixedShards(4),
                          placement="balanced")
    assert sorted(s.ps for s in layouts["table"].shards) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="placement must be one of balanced, round_robin"):
        plan_layout([VariableDef("v", (4,))], 2, None, placement="random")

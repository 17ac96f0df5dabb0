"""psctl.runtime.initializers: values independent of sharding, deterministic per seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from psctl.runtime.initializers import INITIALIZERS, glorot_limit, initialize, variable_seed
from psctl.runtime.partitioners import FixedShards
from psctl.runtime.program import VariableDef
from psctl.runtime.strategy import plan_layout

RANDOM = ("normal", "uniform", "glorot_uniform")


def _sharded(init: str, shape: tuple[int, ...], n: int, seed: int = 7, dtype: str = "float32") -> np.ndarray:
    layout = plan_layout([VariableDef("v", shape, dtype)], 3, FixedShards(n))["v"]
    parts = [
        initialize(init, s.shape, dtype, full_shape=shape, row_offset=s.row_offset, seed=seed) for s in layout.shards
    ]
    return layout.join(parts)


@pytest.mark.parametrize("init", INITIALIZERS)
@pytest.mark.parametrize(
    "shape", [(13, 4), (100_000, 3), (70_000,), (3, 40_000), (5, 4, 3, 2), (1, 5)], ids=lambda s: "x".join(map(str, s))
)
def test_shards_joined_equal_unsharded(init, shape) -> None:
    whole = initialize(init, shape, "float32", full_shape=shape, row_offset=0, seed=7)
    assert whole.shape == shape
    for n in (2, 3, 7, min(shape[0], 40)):
        assert np.array_equal(_sharded(init, shape, n), whole), n


def test_arbitrary_row_ranges_match() -> None:
    shape = (50_000, 8)
    whole = initialize("normal", shape, "float64", full_shape=shape, row_offset=0, seed=3)
    for lo, hi in [(0, 1), (8191, 8193), (12345, 40000), (49_999, 50_000)]:
        part = initialize("normal", (hi - lo, 8), "float64", full_shape=shape, row_offset=lo, seed=3)
        assert np.array_equal(part, whole[lo:hi])


@pytest.mark.parametrize("init", RANDOM)
def test_deterministic_per_seed_and_different_across_seeds(init) -> None:
    def make(seed: int) -> np.ndarray:
        return initialize(init, (64, 16), "float32", full_shape=(64, 16), row_offset=0, seed=seed)

    assert np.array_equal(make(1), make(1))
    assert not np.array_equal(make(1), make(2))
    assert len(np.unique(make(1))) > 1000  # not a repeated pattern


@pytest.mark.parametrize("shape", [(), (10,), (30, 20), (3, 3, 16, 32)])
def test_glorot_limit_respected(shape) -> None:
    values = initialize("glorot_uniform", shape, "float64", full_shape=shape, row_offset=0, seed=0)
    limit = glorot_limit(shape)
    assert np.all(np.abs(values) <= limit)
    if math.prod(shape) > 100:
        assert np.abs(values).max() > 0.9 * limit


def test_glorot_fans() -> None:
    assert glorot_limit(()) == math.sqrt(6 / 2)
    assert glorot_limit((10,)) == math.sqrt(6 / 20)
    assert glorot_limit((30, 20)) == math.sqrt(6 / 50)
    assert glorot_limit((3, 3, 16, 32)) == math.sqrt(6 / (9 * 16 + 9 * 32))


def test_scale_and_constants() -> None:
    shape = (400, 50)
    kw = {"full_shape": shape, "row_offset": 0, "seed": 5}
    assert np.all(initialize("zeros", shape, "float32", **kw) == 0)
    assert np.all(initialize("ones", shape, "int32", **kw) == 1)
    assert abs(initialize("normal", shape, "float64", **kw).std() - 0.05) < 0.002
    assert abs(initialize("normal", shape, "float64", scale=2.0, **kw).std() - 2.0) < 0.05
    uniform = initialize("uniform", shape, "float64", scale=0.5, **kw)
    assert uniform.min() >= -0.5 and uniform.max() < 0.5 and uniform.max() > 0.49


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("init", INITIALIZERS)
def test_dtype_honoured(init, dtype) -> None:
    out = initialize(init, (6, 5), dtype, full_shape=(10, 5), row_offset=4, seed=1)
    assert out.dtype == np.dtype(dtype) and out.shape == (6, 5)


def test_errors() -> None:
    with pytest.raises(ValueError, match="glorot_uniform"):
        initialize("he_normal", (2,), "float32", full_shape=(2,), row_offset=0, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        initialize("zeros", (3, 2), "float32", full_shape=(4, 2), row_offset=2, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        initialize("zeros", (3, 3), "float32", full_shape=(4, 2), row_offset=0, seed=0)
    with pytest.raises(ValueError, match="floating"):
        initialize("normal", (3,), "int32", full_shape=(3,), row_offset=0, seed=0)
    with pytest.raises(ValueError, match="seed"):
        initialize("normal", (3,), "float32", full_shape=(3,), row_offset=0, seed=-1)


def test_variable_seed_is_stable_and_distinct() -> None:
    assert variable_seed(0, "w") == variable_seed(0, "w")
    assert len({variable_seed(0, "w"), variable_seed(0, "b"), variable_seed(1, "w")}) == 3


def test_large_table_works() -> None:
    """A 1,000,000 x 64 float32 embedding table (vectorised blocks; no timing assertion)."""
    shape = (1_000_000, 64)
    table = initialize("glorot_uniform", shape, "float32", full_shape=shape, row_offset=0, seed=11)
    assert table.shape == shape and table.dtype == np.float32
    assert np.abs(table).max() <= glorot_limit(shape)
    tail = initialize("glorot_uniform", (10, 64), "float32", full_shape=shape, row_offset=999_990, seed=11)
    assert np.array_equal(tail, table[-10:])

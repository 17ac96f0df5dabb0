"""Initial values of variables, made on the parameter server that holds each shard.

Values depend only on (seed, the variable's full shape, global row), never on how the variable is sharded:
rows are generated in fixed blocks of global rows, each block from its own counter-based Philox stream.
So the shards of a variable, joined, equal the unsharded variable bit for bit, and a checkpoint-less restart
with a different shard count starts from the same model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np

INITIALIZERS: tuple[str, ...] = ("zeros", "ones", "normal", "uniform", "glorot_uniform")

#: Elements per random block. Part of the value format: changing it changes every random initial value.
_BLOCK_ELEMENTS = 1 << 16
_DEFAULT_SCALE = 0.05


def variable_seed(seed: int, name: str) -> int:
    """A per-variable seed, so that variables of the same shape under one program seed differ."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def glorot_limit(full_shape: tuple[int, ...]) -> float:
    """``sqrt(6 / (fan_in + fan_out))`` with Keras's fans (receptive field for rank > 2)."""
    if len(full_shape) == 0:
        fan_in = fan_out = 1
    elif len(full_shape) == 1:
        fan_in = fan_out = full_shape[0]
    elif len(full_shape) == 2:
        fan_in, fan_out = full_shape
    else:
        receptive = math.prod(full_shape[:-2])
        fan_in, fan_out = full_shape[-2] * receptive, full_shape[-1] * receptive
    return math.sqrt(6.0 / max(1, fan_in + fan_out))


def initialize(
    initializer: str,
    shape: tuple[int, ...],
    dtype: str,
    *,
    full_shape: tuple[int, ...],
    row_offset: int,
    seed: int,
    scale: float = 0.0,
) -> np.ndarray:
    """Values of one shard: rows ``row_offset .. row_offset + shape[0]`` of a variable of ``full_shape``.

    ``scale`` (0 = default) is the stddev of "normal", the bound of "uniform" (both default 0.05) and a
    factor on the glorot limit.
    """
    if initializer not in INITIALIZERS:
        raise ValueError(f"unknown initializer {initializer!r}; valid initializers: {', '.join(INITIALIZERS)}")
    shape, full_shape = tuple(shape), tuple(full_shape)
    _check_shard(shape, full_shape, row_offset)
    dt = np.dtype(dtype)
    if initializer == "zeros":
        return np.zeros(shape, dtype=dt)
    if initializer == "ones":
        return np.ones(shape, dtype=dt)
    if dt.kind != "f":
        raise ValueError(f"initializer {initializer!r} needs a floating dtype, got {dt}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    gen_dt = dt if dt in (np.float32, np.float64) else np.dtype(np.float32)
    factor = scale or (_DEFAULT_SCALE if initializer != "glorot_uniform" else 1.0)
    if initializer == "normal":
        out = _blocks(lambda g, o: g.standard_normal(dtype=gen_dt, out=o), gen_dt, shape, full_shape, row_offset, seed)
        out *= gen_dt.type(factor)
    else:
        bound = _bound(factor * glorot_limit(full_shape) if initializer == "glorot_uniform" else factor, dt, gen_dt)
        out = _blocks(lambda g, o: g.random(dtype=gen_dt, out=o), gen_dt, shape, full_shape, row_offset, seed)
        out *= 2 * bound  # [0, 1) -> [-bound, bound]; 2 * bound - bound is exact, so |value| <= bound
        out -= bound
    return out.astype(dt, copy=False)


def _bound(bound: float, dt: np.dtype, gen_dt: np.dtype) -> np.floating:
    """The largest number <= ``bound`` representable in both dtypes, so rounding never exceeds the limit."""
    narrow = dt if dt.itemsize <= gen_dt.itemsize else gen_dt
    b = narrow.type(bound)
    if b > bound:
        b = np.nextafter(b, narrow.type(0))
    return gen_dt.type(b)  # type: ignore[no-any-return]


def _check_shard(shape: tuple[int, ...], full_shape: tuple[int, ...], row_offset: int) -> None:
    if not full_shape:
        if shape or row_offset != 0:
            raise ValueError(f"a scalar variable has one shard of shape () at offset 0, got {shape} at {row_offset}")
        return
    if (
        len(shape) != len(full_shape)
        or shape[1:] != full_shape[1:]
        or row_offset < 0
        or row_offset + shape[0] > full_shape[0]
    ):
        raise ValueError(f"shard {shape} at row {row_offset} does not fit in a variable of shape {full_shape}")


def _blocks(
    draw: Callable[[np.random.Generator, np.ndarray], object],
    dtype: np.dtype,
    shape: tuple[int, ...],
    full_shape: tuple[int, ...],
    row_offset: int,
    seed: int,
) -> np.ndarray:
    """Fill the shard from per-block streams keyed on (seed, block of global rows)."""
    total_rows = full_shape[0] if full_shape else 1
    rows = shape[0] if shape else 1
    row_size = math.prod(full_shape[1:])
    out = np.empty(rows * row_size, dtype=dtype)
    if out.size == 0:
        return out.reshape(shape)
    key = np.random.SeedSequence(int(seed)).generate_state(2, np.uint64)
    block_rows = max(1, _BLOCK_ELEMENTS // row_size)
    start, stop = row_offset, row_offset + rows
    for block in range(start // block_rows, (stop - 1) // block_rows + 1):
        b0, b1 = block * block_rows, min((block + 1) * block_rows, total_rows)
        lo, hi = max(start, b0), min(stop, b1)
        gen = np.random.Generator(np.random.Philox(key=key, counter=np.array([0, block, 0, 0], np.uint64)))
        dest = out[(lo - start) * row_size : (hi - start) * row_size]
        if (lo, hi) == (b0, b1):
            draw(gen, dest)
        else:  # a shard edge cuts this block: draw it whole, keep our rows
            whole = np.empty((b1 - b0) * row_size, dtype=dtype)
            draw(gen, whole)
            dest[...] = whole[(lo - b0) * row_size : (hi - b0) * row_size]
    return out.reshape(shape)

"""Placement and partitioning of variables over parameter servers, as TensorFlow's ParameterServerStrategy.

The arithmetic matches TensorFlow exactly (partitioner shard counts, the "div" row split, id -> (shard, row)).
Placement is TensorFlow's round-robin in creation order with ``placement="round_robin"``; psctl's default,
``"balanced"``, gives each shard, largest first, to the ps holding the fewest bytes so far: round-robin can put
every large kernel of a model on one ps (a 1024-1024-1024-10 MLP on 2 ps: 12 MiB on ps 0, 40 KiB on ps 1),
which then carries most of the bytes and of the update work of every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from psctl.runtime.partitioners import PLACEMENTS, Partitioner
from psctl.runtime.program import VariableDef


@dataclass(frozen=True)
class ShardInfo:
    """One shard: rows ``row_offset .. row_offset + shape[0]`` of ``variable``, held by ps ``ps``."""

    name: str
    variable: str
    index: int
    ps: int
    row_offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class VariableLayout:
    """How one variable is cut into contiguous row ranges (TensorFlow's div split) and placed."""

    variable: VariableDef
    shards: tuple[ShardInfo, ...]

    def __post_init__(self) -> None:
        # The id arithmetic in locate() is only right for the div split: refuse anything else up front.
        shape = tuple(self.variable.shape)
        n = len(self.shards)
        if n < 1 or (n > 1 and (not shape or shape[0] < n)):
            raise ValueError(f"variable {self.variable.name!r} of shape {shape} cannot have {n} shards")
        offset = 0
        for i, s in enumerate(self.shards):
            rows = (shape[0] // n + (i < shape[0] % n)) if shape else 0
            expect = (rows, *shape[1:]) if shape else ()
            if s.index != i or s.row_offset != offset or tuple(s.shape) != expect:
                raise ValueError(f"shard {s.name!r} does not follow the div split of {self.variable.name!r}")
            offset += rows

    @property
    def num_rows(self) -> int:
        """Rows along axis 0 (0 for a scalar, which has no rows to look up)."""
        return self.variable.shape[0] if self.variable.shape else 0

    @property
    def partitioned(self) -> bool:
        return len(self.shards) > 1

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and local row of every id (same shape as ``ids``), by TensorFlow's div arithmetic."""
        ids = np.asarray(ids)
        if not self.variable.shape:
            raise ValueError(f"variable {self.variable.name!r} is a scalar; it has no rows to look up")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids for {self.variable.name!r} must be integers, got dtype {ids.dtype}")
        d0 = self.num_rows
        bad = (ids < 0) | (ids >= d0)
        if bad.any():
            first = ids.reshape(-1)[int(np.argmax(bad.reshape(-1)))]
            raise ValueError(f"id {int(first)} is out of range for {self.variable.name!r}: valid ids are [0, {d0})")
        ids = ids.astype(np.int64, copy=False)
        n = len(self.shards)
        base, extra = d0 // n, d0 % n
        shard = np.maximum(ids // (base + 1), (ids - extra) // base)
        row = np.where(shard < extra, ids % (base + 1), (ids - extra) % base)
        return shard, row

    def split(self, full: np.ndarray) -> list[np.ndarray]:
        """The shards' parts of a whole-variable array, as views along axis 0."""
        full = np.asarray(full)
        if full.shape != tuple(self.variable.shape):
            raise ValueError(f"{self.variable.name!r} has shape {self.variable.shape}, got {full.shape}")
        if not full.shape:
            return [full]
        return [full[s.row_offset : s.row_offset + s.shape[0]] for s in self.shards]

    def join(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """The whole variable from its shards' parts (a new array)."""
        if len(parts) != len(self.shards):
            raise ValueError(f"{self.variable.name!r} has {len(self.shards)} shards, got {len(parts)} parts")
        for s, p in zip(self.shards, parts, strict=True):
            if np.shape(p) != tuple(s.shape):
                raise ValueError(f"shard {s.name!r} has shape {s.shape}, got {np.shape(p)}")
        if not self.variable.shape:
            return np.array(parts[0])
        return np.concatenate([np.asarray(p) for p in parts], axis=0)




def plan_layout(
    variables: Sequence[VariableDef], num_ps: int, partitioner: Partitioner | None, *,
    placement: str = "round_robin",
) -> dict[str, VariableLayout]:
    """Partition every variable as ParameterServerStrategy does, and place the shards: round-robin in creation
    order (TensorFlow's), or ``balanced`` (see the module's text)."""
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
        raise ValueError(f"num_ps must be an integer >= 1, got {num_ps!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    layouts: dict[str, VariableLayout] = {}
    counter = 0  # one counter over plain variables and shards alike
    for var in variables:
        if var.name in layouts:
            raise ValueError(f"variable {var.name!r} is defined twice")
        shape = tuple(var.shape)
        n = _num_shards(var, partitioner) if shape and partitioner is not None else 1
        if n == 1:
            shards: tuple[ShardInfo, ...] = (ShardInfo(var.name, var.name, 0, counter % num_ps, 0, shape),)
            counter += 1
        else:
            base, extra = shape[0] // n, shape[0] % n
            parts, offset = [], 0
            for i in range(n):
                rows = base + (i < extra)
                parts.append(
                    ShardInfo(f"{var.name}/part_{i}", var.name, i, counter % num_ps, offset, (rows, *shape[1:]))
                )
                counter += 1
                offset += rows
            shards = tuple(parts)
        layouts[var.name] = VariableLayout(var, shards)
    return layouts if placement == "round_robin" else _balance(layouts, num_ps)


def _balance(layouts: dict[str, VariableLayout], num_ps: int) -> dict[str, VariableLayout]:
    """Each shard, largest first (creation order among equals), to the ps with the fewest bytes so far
    (the lowest index among equals): deterministic, so every role computes the same placement."""
    shards = [(layout.variable, shard) for layout in layouts.values() for shard in layout.shards]
    order = sorted(range(len(shards)), key=lambda i: -_shard_bytes(*shards[i]))
    held = [0] * num_ps
    where: dict[str, int] = {}
    for i in order:
        var, shard = shards[i]
        ps = min(range(num_ps), key=lambda p: (held[p], p))
        held[ps] += _shard_bytes(var, shard)
        where[shard.name] = ps
    return {name: VariableLayout(layout.variable, tuple(replace(s, ps=where[s.name]) for s in layout.shards))
            for name, layout in layouts.items()}


def _shard_bytes(var: VariableDef, shard: ShardInfo) -> int:
    return int(np.prod(shard.shape, dtype=np.int64)) * np.dtype(var.dtype).itemsize

def _num_shards(var: VariableDef, partitioner: Partitioner) -> int:
    shape = tuple(var.shape)
    result = list(partitioner(shape, var.dtype))
    if (
        len(result) != len(shape)
        or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in result)
        or result[0] < 1
        or any(x != 1 for x in result[1:])
    ):
        raise ValueError(
            f"partitioner gave {result} for {var.name!r} of shape {shape}: expected [n, 1, ...] with n >= 1"
        )
    n = int(result[0])
    return 1 if n == 1 else max(1, min(n, shape[0]))


#: (shard, positions in the flat ids: an index array, or a slice when they are a contiguous run, local rows).
Routed = list[tuple[ShardInfo, np.ndarray | slice, np.ndarray]]


def route_ids(layout: VariableLayout, ids: np.ndarray) -> Routed:
    """For each shard holding some of ``ids``: (shard, flat positions in ``ids``, local rows), so a worker
    can send one gather per shard in parallel. Duplicates are kept: rows align with positions.

    Sorted ids (what a step's unique ids and sparse gradients are) fall on the shards in runs, since shards are
    row ranges: each shard's positions are then a slice, so its ids and values are views, not gathered copies."""
    flat = np.asarray(ids).reshape(-1)
    if flat.size and np.issubdtype(flat.dtype, np.integer) and bool(np.all(flat[1:] >= flat[:-1])):
        return _route_sorted(layout, flat)
    shard, row = layout.locate(ids)
    shard, row = shard.reshape(-1), row.reshape(-1)
    order = np.argsort(shard, kind="stable")
    counts = np.bincount(shard, minlength=len(layout.shards))
    routed: Routed = []
    start = 0
    for info, count in zip(layout.shards, counts.tolist(), strict=True):
        if count:
            positions = order[start : start + count]
            routed.append((info, positions, row[positions]))
        start += count
    return routed


def _route_sorted(layout: VariableLayout, ids: np.ndarray) -> Routed:
    layout.locate(ids[[0, -1]])  # the range check (the smallest and the largest id), with its error
    offsets = [s.row_offset for s in layout.shards]
    cuts = np.searchsorted(ids, offsets[1:], side="left").tolist()
    routed: Routed = []
    for info, start, end in zip(layout.shards, [0, *cuts], [*cuts, len(ids)], strict=True):
        if end > start:
            routed.append((info, slice(start, end), ids[start:end].astype(np.int64) - info.row_offset))
    return routed


def stitch_rows(
    layout: VariableLayout, ids: np.ndarray, routed: Routed, rows_per_shard: Sequence[np.ndarray]
) -> np.ndarray:
    """The gathered rows back in ``ids`` order: shape ``ids.shape + variable.shape[1:]``."""
    ids = np.asarray(ids)
    if len(routed) != len(rows_per_shard):
        raise ValueError(f"{len(routed)} shards were asked but {len(rows_per_shard)} answered")
    tail = tuple(layout.variable.shape[1:])
    dtype = np.result_type(*rows_per_shard) if rows_per_shard else np.dtype(layout.variable.dtype)
    out = np.empty((ids.size, *tail), dtype=dtype)
    for (info, positions, local), rows in zip(routed, rows_per_shard, strict=True):
        if np.shape(rows) != (len(local), *tail):
            raise ValueError(f"shard {info.name!r} answered shape {np.shape(rows)}, expected {(len(local), *tail)}")
        out[positions] = rows
    return out.reshape(ids.shape + tail)


def shard_slices_for_global(
    layout: VariableLayout, ids: np.ndarray, values: np.ndarray
) -> list[tuple[ShardInfo, np.ndarray, np.ndarray]]:
    """Split a row-sparse gradient (unique 1-d ``ids``, ``values[i]`` for row ``ids[i]``) among shards:
    (shard, local rows, their values) for every shard it touches."""
    ids, values = np.asarray(ids), np.asarray(values)
    if ids.ndim != 1:
        raise ValueError(f"sparse gradient ids must be 1-d, got shape {ids.shape}")
    if values.shape != (len(ids), *layout.variable.shape[1:]):
        raise ValueError(f"values of shape {values.shape} for {layout.variable.name!r} do not match {len(ids)} rows "
                         f"of {layout.variable.shape}")
    if not bool(np.all(ids[1:] > ids[:-1])) and np.unique(ids).size != ids.size:  # sorted unique: no sort
        raise ValueError(f"sparse gradient ids for {layout.variable.name!r} must be unique")
    return [(info, rows, values[positions]) for info, positions, rows in route_ids(layout, ids)]

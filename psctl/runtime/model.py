"""A program's variables laid out over the parameter servers: what to pull, and where each gradient goes.

Chief, workers and the evaluator compute the same layout from the same program and configuration (it is a
pure function of them), so no layout ever travels over the network.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from psctl.proto import psctl_pb2 as pb
from psctl.runtime.partitioners import partitioner_from_config
from psctl.runtime.program import EmbeddingRows, Grads, LowRankGrad, Params, Program, SparseGrad
from psctl.runtime.strategy import (
    ShardInfo,
    VariableLayout,
    plan_layout,
    route_ids,
    shard_slices_for_global,
    stitch_rows,
)
from psctl.runtime.wire import DENSE, IDS, LEFT_FACTOR, RIGHT_FACTOR, ROWS, Entry, whole_shard

PerPs = dict[int, list[Entry]]


class ShardedModel:
    def __init__(self, program: Program, num_ps: int, partitioner: Mapping[str, Any] | None = None,
                 placement: str = "balanced") -> None:
        self.program = program
        self.num_ps = num_ps
        self.layouts: dict[str, VariableLayout] = plan_layout(
            program.variables(), num_ps, partitioner_from_config(partitioner), placement=placement
        )
        # Bytes of each shard, whole and per row: computed once, read on every step.
        whole: dict[str, int] = {}
        row: dict[str, int] = {}
        for layout in self.layouts.values():
            itemsize = np.dtype(layout.variable.dtype).itemsize
            for shard in layout.shards:
                row[shard.name] = itemsize * int(np.prod(shard.shape[1:], dtype=np.int64))
                whole[shard.name] = itemsize * int(np.prod(shard.shape, dtype=np.int64))
        self._shard_bytes = (whole, row)

    # -- creation -------------------------------------------------------------------------------------
    def shard_specs(self, seed: int) -> dict[int, list[pb.VariableSpec]]:
        """The VariableSpecs each PS creates; initial values depend on the seed, not on the sharding."""
        out: dict[int, list[pb.VariableSpec]] = {i: [] for i in range(self.num_ps)}
        for layout in self.layouts.values():
            var = layout.variable
            var_seed = (seed * 1_000_003 + zlib.crc32(var.name.encode())) % (1 << 63)
            for shard in layout.shards:
                out[shard.ps].append(
                    pb.VariableSpec(
                        name=shard.name,
                        dtype=var.dtype,
                        shape=list(shard.shape),
                        full_shape=list(var.shape),
                        row_offset=shard.row_offset,
                        initializer=var.initializer,
                        init_scale=var.init_scale,
                        seed=var_seed,
                    )
                )
        return out

    # -- pulls ----------------------------------------------------------------------------------------
    def pull_plan(self, embedding_ids: Mapping[str, np.ndarray] | None = None, *, full: bool = False) -> PerPs:
        """What to ask each PS for: whole shards of dense variables, and the rows of embeddings a batch needs.

        ``full=True`` pulls embeddings whole too (evaluation, export, checkpoints).
        """
        plan: PerPs = {i: [] for i in range(self.num_ps)}
        for name, layout in self.layouts.items():
            if layout.variable.embedding and not full:
                ids = (embedding_ids or {}).get(name)
                if ids is None:
                    continue
                for shard, _positions, local in route_ids(layout, row_ids(name, ids, "embedding_ids()")):
                    plan[shard.ps].append(Entry(shard.name, IDS, local.astype(np.int64, copy=False)))
            else:
                for shard in layout.shards:
                    plan[shard.ps].append(whole_shard(shard.name))
        return plan

    def pull_bytes(self, plan: PerPs) -> dict[int, int]:
        """Expected response size per PS, to choose between the unary and the streaming rpc."""
        whole, row = self._shard_bytes
        return {
            ps: sum(whole[e.name] if e.kind == DENSE else row[e.name] * len(e.array) for e in entries)
            for ps, entries in plan.items()
        }

    def assemble(
        self, embedding_ids: Mapping[str, np.ndarray] | None, pulled: Mapping[int, Sequence[Entry]]
    ) -> Params:
        """Join pulled shards into whole variables, and embedding rows into EmbeddingRows."""
        by_name: dict[tuple[str, int], np.ndarray] = {}
        for entries in pulled.values():
            for entry in entries:
                by_name[(entry.name, entry.kind)] = entry.array
        params: dict[str, np.ndarray | EmbeddingRows] = {}
        for name, layout in self.layouts.items():
            if layout.variable.embedding and (embedding_ids or {}).get(name) is not None:
                ids = np.asarray(embedding_ids[name], dtype=np.int64)  # type: ignore[index]
                routed = route_ids(layout, ids)
                rows = [by_name[(shard.name, ROWS)] for shard, _p, _l in routed]
                params[name] = EmbeddingRows(ids=ids, rows=stitch_rows(layout, ids, routed, rows))
            elif all((s.name, DENSE) in by_name for s in layout.shards):
                parts = [by_name[(s.name, DENSE)] for s in layout.shards]
                params[name] = parts[0] if len(parts) == 1 else layout.join(parts)
        return params

    # -- pushes ---------------------------------------------------------------------------------------
    def push_plan(self, grads: Grads) -> PerPs:
        plan: PerPs = {i: [] for i in range(self.num_ps)}
        for name, grad in grads.items():
            layout = self.layouts.get(name)
            if layout is None:
                raise ValueError(f"the program returned a gradient for unknown variable {name!r}")
            dtype = np.dtype(layout.variable.dtype)
            if isinstance(grad, SparseGrad):
                ids = row_ids(name, grad.ids, "a sparse gradient's ids", sorted_unique=False)
                values = real_numbers(name, grad.values, dtype)
                for shard, local, rows in shard_slices_for_global(layout, ids, values):
                    plan[shard.ps].append(Entry(shard.name, IDS, np.asarray(local, dtype=np.int64)))
                    plan[shard.ps].append(Entry(shard.name, ROWS, np.ascontiguousarray(rows, dtype=dtype)))
            elif isinstance(grad, LowRankGrad):
                for shard, entries in _low_rank_parts(layout, grad, dtype):
                    plan[shard.ps].extend(entries)
            else:
                grad = real_numbers(name, grad, dtype)
                if grad.shape != layout.variable.shape:
                    raise ValueError(
                        f"gradient for {name!r} has shape {grad.shape}, the variable is {layout.variable.shape}"
                    )
                parts = [grad] if len(layout.shards) == 1 else layout.split(grad)
                for shard, part in zip(layout.shards, parts, strict=True):
                    plan[shard.ps].append(Entry(shard.name, DENSE, np.ascontiguousarray(part)))
        return plan


def row_ids(name: str, ids: object, what: str, *, sorted_unique: bool = True) -> np.ndarray:
    """A program's row ids of embedding ``name`` as int64: a 1-d array of integers (``sorted_unique``: sorted and
    unique, as ``embedding_ids`` gives them); a ValueError naming ``what`` otherwise. Float ids were cast, 1.7 to
    row 1; unsorted ones matched the rows pulled to other ids."""
    array = np.asarray(ids)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{what} for {name!r} must be integer row ids, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{what} for {name!r} must be a 1-d array of row ids, got shape {array.shape}")
    array = array.astype(np.int64, copy=False)
    if sorted_unique and len(array) > 1 and not bool(np.all(array[1:] > array[:-1])):
        raise ValueError(f"{what} for {name!r} must be sorted and unique (np.unique gives them so)")
    return array


def real_numbers(name: str, gradient: object, dtype: np.dtype) -> np.ndarray:
    """A program's gradient (or a part of one) for variable ``name`` as ``dtype``; a ValueError if it does not
    hold real numbers (a complex one lost its imaginary parts in the cast, with only numpy's warning to say so)."""
    array = np.asarray(gradient)
    if array.dtype.kind not in "fiu":
        raise ValueError(f"gradient for {name!r} is of dtype {array.dtype}; a gradient holds real numbers (the "
                         f"variable is {dtype})")
    return array.astype(dtype, copy=False)


def _low_rank_parts(
    layout: VariableLayout, grad: LowRankGrad, dtype: np.dtype
) -> list[tuple[ShardInfo, list[Entry]]]:
    """Each shard's part of a ``left.T @ right`` gradient (its rows are columns of ``left``): the two factors
    where they are smaller than the part, else the part multiplied out here."""
    name = layout.variable.name
    left = real_numbers(name, grad.left, dtype)
    right = np.ascontiguousarray(real_numbers(name, grad.right, dtype))
    if left.ndim != 2 or right.ndim != 2 or len(left) != len(right):
        raise ValueError(f"the low-rank gradient for {name!r} needs factors k x rows and k x columns, "
                         f"got {left.shape} and {right.shape}")
    if grad.shape != tuple(layout.variable.shape):
        raise ValueError(f"gradient for {name!r} has shape {grad.shape}, the variable is {layout.variable.shape}")
    out = []
    for shard in layout.shards:
        rows = slice(shard.row_offset, shard.row_offset + shard.shape[0])
        part = LowRankGrad(np.ascontiguousarray(left[:, rows]), right)  # every shard's part shares ``right``
        if part.nbytes < math.prod(part.shape) * dtype.itemsize:
            entries = [Entry(shard.name, LEFT_FACTOR, part.left), Entry(shard.name, RIGHT_FACTOR, part.right)]
        else:
            entries = [Entry(shard.name, DENSE, part.dense())]
        out.append((shard, entries))
    return out

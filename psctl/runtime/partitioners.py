"""Partitioners and placements in their spec form, as ParameterServerStrategy's (see psctl.runtime.strategy,
which cuts and places the variables with them).

Kept free of numpy at import: validating a cluster spec (``psctl up``, ``psctl validate``, the supervisor's
start) builds these from the spec's ``training`` section, and importing numpy for that cost ~50 ms per process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

#: ``training.placement``: psctl's size-balanced placement, or TensorFlow's round-robin in creation order.
PLACEMENTS = ("balanced", "round_robin")


class Partitioner(Protocol):
    """Returns the shard count along axis 0 as ``[n, 1, 1, ...]`` (one entry per dimension)."""

    def __call__(self, shape: tuple[int, ...], dtype: str | np.dtype) -> list[int]: ...


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _element_bytes(dtype: str | np.dtype, bytes_per_string: int) -> int:
    """Strings have no fixed size, so (like TensorFlow) they are counted as ``bytes_per_string``."""
    if isinstance(dtype, str) and dtype in ("string", "str", "bytes"):
        return bytes_per_string
    import numpy as np  # here, not at the top: see the module's text

    dt = np.dtype(dtype)
    return bytes_per_string if dt.kind in "USO" else dt.itemsize


def _result(shape: tuple[int, ...], n: int) -> list[int]:
    if len(shape) < 1:
        raise ValueError("a partitioner splits axis 0; a scalar has none")
    return [n] + [1] * (len(shape) - 1)


@dataclass(frozen=True)
class FixedShards:
    """``min(num_shards, shape[0])`` shards whatever the size (TensorFlow's FixedShardsPartitioner)."""

    num_shards: int

    def __post_init__(self) -> None:
        _positive("num_shards", self.num_shards)

    def __call__(self, shape: tuple[int, ...], dtype: str | np.dtype) -> list[int]:
        return _result(shape, min(self.num_shards, shape[0]) if shape else 1)


@dataclass(frozen=True)
class MinSize:
    """As many shards of at least ~``min_shard_bytes`` as fit, capped at ``max_shards``.

    Because TensorFlow rounds the count up, a shard can end up smaller than ``min_shard_bytes``.
    """

    min_shard_bytes: int = 256 << 10
    max_shards: int = 1
    bytes_per_string: int = 16

    def __post_init__(self) -> None:
        _positive("min_shard_bytes", self.min_shard_bytes)
        _positive("max_shards", self.max_shards)
        _positive("bytes_per_string", self.bytes_per_string)

    def __call__(self, shape: tuple[int, ...], dtype: str | np.dtype) -> list[int]:
        if not shape:
            return _result(shape, 1)
        total = math.prod(shape) * _element_bytes(dtype, self.bytes_per_string)
        partitions = total / self.min_shard_bytes
        return _result(shape, max(1, min(shape[0], self.max_shards, math.ceil(partitions))))


@dataclass(frozen=True)
class MaxSize:
    """The fewest shards of at most ``max_shard_bytes``; a row larger than the cap still gets one shard."""

    max_shard_bytes: int
    max_shards: int | None = None
    bytes_per_string: int = 16

    def __post_init__(self) -> None:
        _positive("max_shard_bytes", self.max_shard_bytes)
        if self.max_shards is not None:
            _positive("max_shards", self.max_shards)
        _positive("bytes_per_string", self.bytes_per_string)

    def __call__(self, shape: tuple[int, ...], dtype: str | np.dtype) -> list[int]:
        if not shape:
            return _result(shape, 1)
        d0 = shape[0]
        bytes_per_slice = 1.0 * (math.prod(shape) / d0) * _element_bytes(dtype, self.bytes_per_string) if d0 else 0.0
        if bytes_per_slice == 0:  # no bytes at all: TensorFlow divides by zero; one shard is the sane answer
            return _result(shape, 1)
        slices_per_shard = max(1, math.floor(self.max_shard_bytes / bytes_per_slice))
        n = math.ceil(1.0 * d0 / slices_per_shard)
        if self.max_shards:
            n = min(self.max_shards, n)
        return _result(shape, n)


#: Each partitioner kind (``training.partitioner.kind``) and its class, whose fields are the kind's keys.
PARTITIONER_KINDS: dict[str, type[FixedShards] | type[MinSize] | type[MaxSize]] = {
    "fixed": FixedShards,
    "min_size": MinSize,
    "max_size": MaxSize,
}


def partitioner_keys(kind: str) -> tuple[str, ...]:
    """The keys of partitioner ``kind`` besides ``kind`` itself, the required one (if any) first."""
    return tuple(f.name for f in dataclasses.fields(PARTITIONER_KINDS[kind]))


def required_partitioner_key(kind: str) -> str | None:
    """The key partitioner ``kind`` cannot do without (it has no default), if any."""
    fields = dataclasses.fields(PARTITIONER_KINDS[kind])
    return next((f.name for f in fields if f.default is dataclasses.MISSING), None)


def partitioner_from_config(cfg: Mapping[str, Any] | None) -> Partitioner | None:
    """Build a partitioner from its spec form, e.g. ``{"kind": "fixed", "num_shards": 2}``; None -> None."""
    if cfg is None:
        return None
    kinds = ", ".join(sorted(PARTITIONER_KINDS))
    kind = cfg.get("kind")
    if kind not in PARTITIONER_KINDS:
        raise ValueError(f"unknown partitioner kind {kind!r}; valid kinds: {kinds}")
    cls, keys = PARTITIONER_KINDS[kind], partitioner_keys(kind)
    kwargs = {k: v for k, v in cfg.items() if k != "kind"}
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} for partitioner {kind!r}; valid keys: kind, {', '.join(keys)}")
    try:
        return cls(**kwargs)  # type: ignore[no-any-return]
    except TypeError as e:  # a required argument is missing
        raise ValueError(f"partitioner {kind!r} needs {keys[0]!r}: {e}") from None

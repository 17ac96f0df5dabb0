"""The interface between psctl's runtime and a training program (README.md, "Your own program": an example).

No code travels over the network: every role imports the same program module by name and calls its
``build(args, data, seed)``. A program describes its variables, the embedding ids each batch needs, and
computes its loss and gradients with numpy (or anything that returns numpy arrays).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from psctl.runtime.rows import unique_ids

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class VariableDef:
    """A model variable as the program declares it (the whole variable, before partitioning)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    #: Initializer name understood by psctl.runtime.initializers.
    initializer: str = "glorot_uniform"
    #: Scale for the initializer (e.g. stddev of "normal"); 0 selects the initializer's default.
    init_scale: float = 0.0
    #: An embedding is read and updated by rows: only the rows a batch needs travel.
    embedding: bool = False


@dataclass
class EmbeddingRows:
    """The rows of an embedding that one batch needs: ``rows[i]`` is row ``ids[i]`` of the table."""

    ids: np.ndarray  # int64, unique, sorted
    rows: np.ndarray  # (len(ids), *shape[1:])

    def positions(self, batch_ids: np.ndarray) -> np.ndarray:
        """Index into ``rows`` for each id in ``batch_ids`` (which must all be in ``ids``)."""
        batch_ids = np.asarray(batch_ids)
        unique, inverse = unique_ids(batch_ids, return_inverse=True)
        if np.array_equal(unique, self.ids):  # the usual case: the rows are exactly the batch's ids
            return inverse.reshape(batch_ids.shape)
        return np.searchsorted(self.ids, batch_ids)


@dataclass
class SparseGrad:
    """A row-sparse gradient: ``values[i]`` is the gradient of row ``ids[i]`` (ids unique)."""

    ids: np.ndarray  # int64
    values: np.ndarray  # (len(ids), *shape[1:])


@dataclass
class LowRankGrad:
    """A 2-d gradient given as the product ``left.T @ right`` (``left``: k x rows, ``right``: k x columns).

    A dense layer ``y = x @ w`` has exactly this gradient over a batch of k examples: ``x.T @ dy``. The runtime
    sends the two factors instead of the product when they are smaller (k * (rows + columns) < rows * columns:
    W3's 1024 x 1024 kernel at batch 64 is 8x smaller), and the parameter server multiplies them out; the
    update is the same one. Otherwise the worker multiplies them out and sends the product.
    """

    left: np.ndarray  # (k, rows)
    right: np.ndarray  # (k, columns)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[1], self.right.shape[1])

    @property
    def nbytes(self) -> int:
        return int(self.left.nbytes + self.right.nbytes)

    def dense(self) -> np.ndarray:
        """The product, ``left.T @ right``."""
        return self.left.T @ self.right


Params = Mapping[str, np.ndarray | EmbeddingRows]
Grads = dict[str, np.ndarray | SparseGrad | LowRankGrad]


class Dataset(Protocol):
    """A deterministic sequence of batches: the same position always gives the same batch.

    Determinism is what lets a restarted worker resume its input exactly where its last step left off.
    """

    num_examples: int

    def batch(self, position: int, batch_size: int) -> Batch: ...


class Program(Protocol):
    def variables(self) -> list[VariableDef]: ...

    def embedding_ids(self, batch: Batch) -> dict[str, np.ndarray]:
        """Unique sorted int64 ids each embedding variable needs for this batch ({} if none)."""
        ...

    def loss_and_grads(self, params: Params, batch: Batch) -> tuple[float, Grads]: ...

    def evaluate(self, params: Params, batch: Batch) -> dict[str, float]:
        """Mean metrics over the batch; must include "loss" (and e.g. "accuracy")."""
        ...

    def dataset(self, split: str, shard: int, num_shards: int) -> Dataset:
        """The examples of ``split`` ("train" or "test") that belong to ``shard`` of ``num_shards``."""
        ...


@dataclass
class ProgramRef:
    """Where to find a program: a module name (``psctl.models.mlp``) or a path to a .py file."""

    program: str
    args: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


def load_program(ref: ProgramRef) -> Program:
    """Import the program module and call its ``build(args, data, seed)``."""
    module = _import(ref.program)
    build = getattr(module, "build", None)
    if build is None:
        raise ValueError(f"program {ref.program!r} has no build(args, data, seed) function")
    return build(dict(ref.args), dict(ref.data), ref.seed)  # type: ignore[no-any-return]


def _import(program: str) -> Any:
    if program.endswith(".py") or "/" in program:
        path = Path(program).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"program file {program!r} does not exist")
        name = f"psctl_user_program_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import program file {program!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise _import_failed(program, exc) from exc
        return module
    try:
        return importlib.import_module(program)
    except ImportError:
        raise
    except Exception as exc:
        raise _import_failed(program, exc) from exc


def _import_failed(program: str, exc: Exception) -> ImportError:
    """Any error while importing the user's program is a configuration error (exit code 2: permanent),
    not a crash worth restarting."""
    return ImportError(f"program {program!r} failed to import: {type(exc).__name__}: {exc}")

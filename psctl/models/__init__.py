"""Built-in training programs, importable by name from a cluster spec.

Each module (``psctl.models.softmax``, ``psctl.models.mlp``, ``psctl.models.wide_embedding``) exposes
``build(args, data, seed)`` returning a :class:`psctl.runtime.program.Program`, with hand-written numpy
backward passes so the runtime needs nothing beyond numpy. Data sources live in :mod:`psctl.models.data`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psctl.runtime.builtin_programs import BUILTIN_PROGRAMS, arg_expected, data_mismatch
from psctl.runtime.program import EmbeddingRows, Params


def resolve_args(program: str, args: Mapping[str, Any], defaults: Mapping[str, int | None]) -> dict[str, int]:
    """Positive-integer args with defaults filled in; keys the program does not take (a built-in's entry in
    ``BUILTIN_PROGRAMS``, else the keys of ``defaults``) are refused so typos do not pass silently.

    A default of ``None`` means "could not be inferred from the data config": the user must give it.
    """
    valid = BUILTIN_PROGRAMS.get(program, tuple(defaults))
    unknown = sorted(str(key) for key in args if key not in valid)
    if unknown:
        raise ValueError(
            f"unknown arg(s) {', '.join(map(repr, unknown))} for {program}; valid args: {', '.join(sorted(valid))}"
        )
    resolved = {}
    for key, default in defaults.items():
        value = args.get(key, default)
        if value is None:
            if key == "num_classes":  # (a data file's labels: whole numbers are class ids, others are not)
                raise ValueError(f"{program} classifies, and the data's labels are not all whole numbers (class ids "
                                 "0 to N-1): fix the labels (data.y, or the label column)")
            raise ValueError(f"{program} needs args.{key}: it cannot be inferred from the data config")
        expected = arg_expected(program, key, value)
        if expected is not None:
            raise ValueError(f"args.{key} for {program} must be {expected}, got {value!r}")
        resolved[key] = int(value)
        mismatch = data_mismatch(key, resolved[key], default, named=f"args.{key}") if key in args else None
        if mismatch is not None:
            problem, fix = mismatch
            raise ValueError(f"args.{key} for {program} {problem}: {fix}")
    return resolved


def dense(params: Params, name: str) -> np.ndarray:
    """A dense variable from ``params`` (a clear error if the runtime handed rows instead)."""
    value = params[name]
    if isinstance(value, EmbeddingRows):
        raise TypeError(f"variable {name!r} is dense but was given as embedding rows")
    return np.asarray(value)


def compute_dtype(param: np.ndarray) -> np.dtype:
    """float32 for float32 (or narrower) params; float64 when the caller checks gradients in float64."""
    return np.result_type(param.dtype, np.float32)

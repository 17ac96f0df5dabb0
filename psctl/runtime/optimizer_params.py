"""The optimizers' hyperparameters: names, defaults and allowed ranges, checked in one place (see
psctl.runtime.optimizers for the update rules that use them).

Kept free of numpy: validating a cluster spec (``psctl up``, ``psctl validate``, the supervisor's start) checks
``training.optimizer`` with these, and importing numpy for that cost ~50 ms per process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """One hyperparameter: its default, and which values it takes (``allowed`` says it in words)."""

    default: float
    allowed: str
    ok: Callable[[float], bool]


_NON_NEGATIVE = Param(0.0, "a finite number >= 0", lambda x: x >= 0)
_POSITIVE = Param(0.0, "a finite number > 0", lambda x: x > 0)
_DECAY = Param(0.0, "in [0, 1)", lambda x: 0 <= x < 1)


def _with(param: Param, default: float) -> Param:
    return Param(default, param.allowed, param.ok)


#: Each optimizer's hyperparameters besides learning_rate, as TensorFlow/Keras name and default them.
OPTIMIZER_PARAMS: dict[str, dict[str, Param]] = {
    "sgd": {},
    "momentum": {"momentum": _with(_NON_NEGATIVE, 0.9), "nesterov": Param(0.0, "0 or 1", lambda x: x in (0.0, 1.0))},
    "adagrad": {"initial_accumulator": _with(_NON_NEGATIVE, 0.1), "epsilon": _with(_POSITIVE, 1e-7)},
    "adam": {"beta1": _with(_DECAY, 0.9), "beta2": _with(_DECAY, 0.999), "epsilon": _with(_POSITIVE, 1e-7)},
}
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_PARAMS)


def optimizer_config(name: str, learning_rate: object, params: Mapping[str, object] | None = None) -> dict[str, float]:
    """Optimizer ``name``'s hyperparameters in effect: ``learning_rate`` and every parameter (defaults filled in),
    each checked; a ValueError says what is wrong."""
    known = OPTIMIZER_PARAMS.get(name)
    if known is None:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    params = dict(params or {})
    for key in params:
        if key not in known:
            valid = ", ".join(known) or "(none)"
            raise ValueError(f"unknown parameter {key!r} for optimizer {name!r}; valid: {valid}")
    config = {"learning_rate": check_range("learning_rate", learning_rate, _POSITIVE.allowed, _POSITIVE.ok)}
    for key, param in known.items():
        config[key] = check_range(key, params.get(key, param.default), param.allowed, param.ok)
    return config


def check_range(what: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a finite real number satisfying ``ok``; else a ValueError."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be {allowed}, got {value!r}") from None
    if isinstance(value, (str, bytes)) or not math.isfinite(x) or not ok(x):
        raise ValueError(f"{what} must be {allowed}, got {value!r}")
    return x

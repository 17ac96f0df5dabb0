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
    """One hyperparameter: its default and the values it takes, as bounds (a spec's checks use them too), in
    words (the runtime's error) and by example (a spec's fix)."""

    default: float
    allowed: str
    example: str
    above: float | None = None
    at_least: float | None = None
    below: float | None = None
    #: 0 or 1 on the wire, true or false in a spec.
    flag: bool = False

    def ok(self, x: float) -> bool:
        if self.flag:
            return x in (0.0, 1.0)
        return ((self.above is None or x > self.above) and (self.at_least is None or x >= self.at_least)
                and (self.below is None or x < self.below))


LEARNING_RATE = Param(0.01, "a finite number > 0", "0.01", above=0)


def _non_negative(default: float) -> Param:
    return Param(default, "a finite number >= 0", f"{default:g}", at_least=0)


def _positive(default: float) -> Param:
    return Param(default, "a finite number > 0", f"{default:g}", above=0)


def _decay(default: float) -> Param:
    return Param(default, "in [0, 1)", f"{default:g}", at_least=0, below=1)


#: Each optimizer's hyperparameters besides learning_rate, as TensorFlow/Keras name and default them.
OPTIMIZER_PARAMS: dict[str, dict[str, Param]] = {
    "sgd": {},
    "momentum": {"momentum": _non_negative(0.9), "nesterov": Param(0.0, "0 or 1", "true", flag=True)},
    "adagrad": {"initial_accumulator": _non_negative(0.1), "epsilon": _positive(1e-7)},
    "adam": {"beta1": _decay(0.9), "beta2": _decay(0.999), "epsilon": _positive(1e-7)},
}
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_PARAMS)


def params_of(name: str) -> dict[str, Param]:
    """Optimizer ``name``'s hyperparameters besides learning_rate; a ValueError for an unknown name."""
    known = OPTIMIZER_PARAMS.get(name)
    if known is None:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    return known


def optimizer_config(name: str, learning_rate: object, params: Mapping[str, object] | None = None) -> dict[str, float]:
    """Optimizer ``name``'s hyperparameters in effect: ``learning_rate`` and every parameter (defaults filled in),
    each checked; a ValueError says what is wrong."""
    known = params_of(name)
    params = dict(params or {})
    for key in params:
        if key not in known:
            valid = ", ".join(known) or "(none)"
            raise ValueError(f"unknown parameter {key!r} for optimizer {name!r}; valid: {valid}")
    config = {"learning_rate": check_range("learning_rate", learning_rate, LEARNING_RATE.allowed, LEARNING_RATE.ok)}
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

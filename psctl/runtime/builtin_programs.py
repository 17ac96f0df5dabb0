"""The built-in training programs (``psctl.models.*``) and the args each takes, without numpy.

The spec's check reads it before anything starts (``psctl validate``, ``up``): a misspelt program or arg is
a one-line error at its key instead of a chief that fails at start. The programs check their args against
the same table when they build (``psctl.models.resolve_args``).
"""

from __future__ import annotations

import numbers

#: Module -> the names its ``args`` may hold.
BUILTIN_PROGRAMS: dict[str, tuple[str, ...]] = {
    "psctl.models.softmax": ("num_features", "num_classes"),
    "psctl.models.mlp": ("hidden_units", "num_features", "num_classes"),
    "psctl.models.wide_embedding": ("vocab_size", "dim"),
}
#: Modules of psctl's own that are programs: any other ``psctl.`` module named as one is a mistake.
BUILTIN_PREFIX = "psctl."
#: Args that take a non-empty list of positive integers as well as one (an MLP's hidden layers' widths).
LIST_ARGS = frozenset({("psctl.models.mlp", "hidden_units")})


def arg_expected(program: str, key: str, value: object) -> str | None:
    """What a built-in program's arg ``key`` must be, where ``value`` is not that; None where it is. Every one
    is a positive integer (a list of them where LIST_ARGS says)."""
    many = (program, key) in LIST_ARGS
    values = value if many and isinstance(value, (list, tuple)) else [value]
    if values and all(not isinstance(v, bool) and isinstance(v, numbers.Integral) and int(v) >= 1 for v in values):
        return None
    return "a positive integer or a list of them" if many else "a positive integer"


#: Args a built-in program reads from its data unless given: what the data needs of each (the step would fail
#: at its first batch, naming no arg: "batch has 64 features but the model expects 10").
FROM_DATA = {
    "num_features": ("features per example", "equal"),
    "num_classes": ("classes (labels up to {top})", "at least"),
    "vocab_size": ("ids (up to {top})", "at least"),
}


def data_mismatch(key: str, given: int, data: int | None, *, named: str = "it") -> tuple[str, str] | None:
    """What is wrong with arg ``key`` given as ``given`` where the data implies ``data``, and the fix (which
    calls the arg ``named``); None if nothing is (or the data implies nothing)."""
    if key not in FROM_DATA or data is None:
        return None
    what, rule = FROM_DATA[key]
    if given == data or (rule == "at least" and given > data):
        return None
    need = f"give {data}" if rule == "equal" else f"give at least {data}"
    return (f"is {given}, but the data has {data} {what.format(top=data - 1)}",
            f"remove {named} (it is read from the data) or {need}")

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

"""The built-in training programs (``psctl.models.*``) and the args each takes, without numpy.

The spec's check reads it before anything starts (``psctl validate``, ``up``): a misspelt program or arg is
a one-line error at its key instead of a chief that fails at start. The programs check their args against
the same table when they build (``psctl.models.resolve_args``).
"""

from __future__ import annotations

#: Module -> the names its ``args`` may hold.
BUILTIN_PROGRAMS: dict[str, tuple[str, ...]] = {
    "psctl.models.softmax": ("num_features", "num_classes"),
    "psctl.models.mlp": ("hidden_units", "num_features", "num_classes"),
    "psctl.models.wide_embedding": ("vocab_size", "dim"),
}
#: Modules of psctl's own that are programs: any other ``psctl.`` module named as one is a mistake.
BUILTIN_PREFIX = "psctl."

"""A built-in program's data config (``training.data``): which source, with which options; without numpy.

The built-in programs read it (``psctl.models.data``), and the spec's check reads it before anything starts,
so a misspelt data set or option is an error at its key instead of workers that fail at start.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The names a data config may give as ``name``; the user's own files are given by ``path`` instead.
DATA_SOURCES = ("digits", "synthetic_classification", "synthetic_embedding")
#: Each source's options (files by their suffix) and their defaults.
DATA_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {},
    "synthetic_classification": {"num_examples": 10000, "num_features": 784, "num_classes": 10, "noise": 0.1},
    "synthetic_embedding": {"num_examples": 20000, "vocab_size": 100000, "ids_per_example": 10, "zipf": 0.0},
    ".npz": {"x": "x", "y": "y"},
    ".csv": {"label_column": -1, "skip_header": False, "delimiter": ","},
}


def is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_data_config(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Validate a data config: (source kind, options with defaults filled in). A ValueError says what is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"data config must be a mapping, got {type(data).__name__}")
    if "name" in data and "path" in data:
        raise ValueError("data config gives both 'name' and 'path': give one")
    if "name" in data:
        kind = data["name"]
        if kind not in DATA_SOURCES:
            raise ValueError(f"unknown data source {kind!r}: use one of {', '.join(DATA_SOURCES)} or give 'path'")
        given = {k: v for k, v in data.items() if k != "name"}
    elif "path" in data:
        if not isinstance(data["path"], (str, Path)):
            raise ValueError(f"data.path must be a file name, got {data['path']!r}")
        kind = Path(data["path"]).suffix.lower()
        if kind not in (".npz", ".csv"):
            raise ValueError(f"data file {str(data['path'])!r} must end in .npz or .csv")
        given = {k: v for k, v in data.items() if k != "path"}
    else:
        raise ValueError(
            f"data config needs 'name' (one of {', '.join(DATA_SOURCES)}) or 'path' (an .npz or .csv file)"
        )
    defaults = DATA_DEFAULTS[kind]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        valid = ", ".join(sorted(defaults)) or "none"
        source = kind if "name" in data else f"{kind} files"
        raise ValueError(f"unknown data key(s) {', '.join(map(repr, unknown))} for {source}; valid: {valid}")
    opts = {**defaults, **given}
    _check_options(kind, opts)
    if "path" in data:
        opts["path"] = str(data["path"])
    return kind, opts


def _check_options(kind: str, opts: dict[str, Any]) -> None:
    minimums = {"num_examples": 1, "num_features": 1, "num_classes": 2, "vocab_size": 1, "ids_per_example": 1}
    for key, minimum in minimums.items():
        if key in opts and (not is_int(opts[key]) or opts[key] < minimum):
            raise ValueError(f"data.{key} must be an integer >= {minimum}, got {opts[key]!r}")
    for key in ("noise", "zipf"):
        if key in opts and (not is_number(opts[key]) or opts[key] < 0):
            raise ValueError(f"data.{key} must be a number >= 0, got {opts[key]!r}")
    if kind == "synthetic_embedding" and 0 < opts["zipf"] <= 1:
        raise ValueError(f"data.zipf must be 0 (uniform ids) or > 1 (Zipf exponent), got {opts['zipf']!r}")
    for key in ("x", "y", "delimiter"):
        if key in opts and not isinstance(opts[key], str):
            raise ValueError(f"data.{key} must be a string, got {opts[key]!r}")
    if "label_column" in opts and not is_int(opts["label_column"]):
        raise ValueError(f"data.label_column must be an integer, got {opts['label_column']!r}")
    if "skip_header" in opts and not isinstance(opts["skip_header"], bool):
        raise ValueError(f"data.skip_header must be true or false, got {opts['skip_header']!r}")

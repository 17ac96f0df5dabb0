"""A built-in program's data config (``training.data``): which source, with which options; without numpy.

The built-in programs read it (``psctl.models.data``), and the spec's check reads it before anything starts,
so a misspelt data set or option is an error at its key instead of workers that fail at start.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
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


class DataConfigError(ValueError):
    """A data config the data sources refuse. Besides the message: the ``key`` it is about (``name``, ``path``,
    an option; None: the config as a whole), the ``problem`` said of that key, and what helps fix it: the
    unknown ``word`` and the ``choices`` it should be one of, an ``example`` value, or a ``fix`` in words."""

    def __init__(self, message: str, *, key: str | None = None, problem: str = "", word: str = "",
                 choices: tuple[str, ...] = (), example: Any = None, fix: str = "") -> None:
        super().__init__(message)
        self.key, self.problem, self.word, self.choices = key, problem or message, word, choices
        self.example, self.fix = example, fix


_EXAMPLE = "write e.g. data: {name: digits} or data: {path: data/train.npz}"


def is_int(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_data_config(data: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Validate a data config: (source kind, options with defaults filled in). A DataConfigError says what is
    wrong, and where."""
    if not isinstance(data, Mapping):
        raise DataConfigError(f"data config must be a mapping, got {type(data).__name__}", fix=_EXAMPLE)
    if "name" in data and "path" in data:
        raise DataConfigError("data config gives both 'name' and 'path': give one", key="path",
                              fix="remove one of them")
    if "name" in data:
        kind = data["name"]
        if kind not in DATA_SOURCES:
            raise DataConfigError(
                f"unknown data source {kind!r}: use one of {', '.join(DATA_SOURCES)} or give 'path'", key="name",
                problem=f"no data set {kind!r}", word=str(kind), choices=DATA_SOURCES)
        given = {k: v for k, v in data.items() if k != "name"}
    elif "path" in data:
        if not isinstance(data["path"], (str, Path)):
            raise DataConfigError(f"data.path must be a file name, got {data['path']!r}", key="path",
                                  fix="write e.g. path: data/train.npz")
        kind = Path(data["path"]).suffix.lower()
        if kind not in (".npz", ".csv"):
            raise DataConfigError(f"data file {str(data['path'])!r} must end in .npz or .csv", key="path",
                                  problem=f"{str(data['path'])!r}: the built-in programs read .npz and .csv files",
                                  fix="convert it, or train with a program of your own that reads it")
        given = {k: v for k, v in data.items() if k != "path"}
    else:
        raise DataConfigError(
            f"data config needs 'name' (one of {', '.join(DATA_SOURCES)}) or 'path' (an .npz or .csv file)",
            fix=_EXAMPLE)
    defaults = DATA_DEFAULTS[kind]
    unknown = sorted(str(key) for key in given if key not in defaults)
    if unknown:
        valid = ", ".join(sorted(defaults)) or "none"
        source = kind if "name" in data else f"{kind} files"
        raise DataConfigError(f"unknown data key(s) {', '.join(map(repr, unknown))} for {source}; valid: {valid}",
                              key=unknown[0], word=unknown[0], choices=tuple(defaults),
                              problem=f"not an option of {'data set ' if 'name' in data else ''}{source}")
    opts = {**defaults, **given}
    _check_options(kind, opts)
    if "path" in data:
        opts["path"] = str(data["path"])
    return kind, opts


def _check_options(kind: str, opts: dict[str, Any]) -> None:
    def refuse(key: str, must: str) -> None:
        raise DataConfigError(f"data.{key} {must}, got {opts[key]!r}", key=key, problem=f"{must}, got {opts[key]!r}",
                              example=DATA_DEFAULTS[kind][key])

    minimums = {"num_examples": 1, "num_features": 1, "num_classes": 2, "vocab_size": 1, "ids_per_example": 1}
    for key, minimum in minimums.items():
        if key in opts and (not is_int(opts[key]) or opts[key] < minimum):
            refuse(key, f"must be an integer >= {minimum}")
    for key in ("noise", "zipf"):
        if key in opts and (not is_number(opts[key]) or opts[key] < 0):
            refuse(key, "must be a number >= 0")
    if kind == "synthetic_embedding" and 0 < opts["zipf"] <= 1:
        refuse("zipf", "must be 0 (uniform ids) or > 1 (Zipf exponent)")
    for key in ("x", "y", "delimiter"):
        if key in opts and not isinstance(opts[key], str):
            refuse(key, "must be a string")
    if "label_column" in opts and not is_int(opts["label_column"]):
        refuse("label_column", "must be an integer")
    if "skip_header" in opts and not isinstance(opts["skip_header"], bool):
        refuse("skip_header", "must be true or false")


#: The share of a source's examples held out as its test split (the rest is the train split).
TEST_FRACTION = 0.2
#: The UCI digits' examples (scikit-learn's copy).
DIGITS_EXAMPLES = 1797


@dataclass(frozen=True)
class DataShape:
    """What a model can infer from a data config without the user repeating it in ``args``."""

    num_features: int | None
    num_classes: int | None
    vocab_size: int | None
    #: Examples in the source, both splits (None: not known without reading it).
    examples: int | None = None

    @property
    def train_examples(self) -> int | None:
        return None if self.examples is None else self.examples - round(self.examples * TEST_FRACTION)


def named_data_shape(data: Mapping[str, Any]) -> DataShape | None:
    """The shape of a named source's data, known from its config alone; None for a data file (read to know)."""
    kind, opts = parse_data_config(data)
    if kind == "digits":
        return DataShape(64, 10, None, DIGITS_EXAMPLES)
    if kind == "synthetic_classification":
        return DataShape(opts["num_features"], opts["num_classes"], None, opts["num_examples"])
    if kind == "synthetic_embedding":
        return DataShape(opts["ids_per_example"], 2, opts["vocab_size"], opts["num_examples"])
    return None

"""Data sources for the built-in programs: deterministic, shardable, resumable batches.

A worker's input is a pure function of (data config, seed, split, shard, position), so a restarted worker
resumes exactly where its last step left off, and every role that builds the same program sees the same
examples. Nothing here depends on wall-clock time or on process state beyond caches.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from psctl.runtime.data_config import TEST_FRACTION, DataShape, is_int, named_data_shape, parse_data_config

SPLITS = ("train", "test")
#: Where in scikit-learn's package its copy of the digits lies.
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
#: The train/test split ignores the run's seed, so the test set stays the same from run to run.
_SPLIT_SEED = 0x5EED5
_SEED_MASK = (1 << 64) - 1

@dataclass(eq=False)
class ArrayDataset:
    """An endless, epoch-shuffled stream over in-memory arrays; batch ``k`` is a pure function of ``k``.

    The stream is the concatenation of one permutation of the examples per epoch (derived from
    ``(seed, epoch)``); batch ``k`` of size ``bs`` is elements ``[k*bs, (k+1)*bs)`` of that stream, so
    consecutive batches cover every example exactly once per epoch and none is skipped at epoch boundaries.
    """

    x: np.ndarray
    y: np.ndarray
    seed: int
    #: len(x); a plain attribute rather than a property because the Dataset protocol declares it so.
    num_examples: int = field(init=False)
    _perms: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} examples but y has {len(self.y)}")
        if len(self.x) == 0:
            raise ValueError("a dataset needs at least one example")
        self.num_examples = len(self.x)

    def batch(self, position: int, batch_size: int) -> dict[str, np.ndarray]:
        """Batch number ``position`` of the stream (``{"x": ..., "y": ...}``)."""
        if position < 0:
            raise ValueError(f"batch position must be >= 0, got {position}")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        n = self.num_examples
        start, stop = position * batch_size, (position + 1) * batch_size
        parts = []
        while start < stop:
            epoch, offset = divmod(start, n)
            take = min(stop - start, n - offset)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            start += take
        idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return {"x": self.x[idx], "y": self.y[idx]}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which ``epoch`` visits the examples (cached: consecutive batches share it)."""
        order = self._perms.get(epoch)
        if order is None:
            rng = np.random.default_rng([self.seed & _SEED_MASK, epoch])
            order = rng.permutation(self.num_examples)
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = order
        return order


def load_dataset(data: Mapping[str, Any], *, split: str, shard: int, num_shards: int, seed: int) -> ArrayDataset:
    """The examples of ``split`` that belong to ``shard``: every ``num_shards``-th one of the split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    if not is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
    if not is_int(shard) or not 0 <= shard < num_shards:
        raise ValueError(f"shard index {shard!r} is out of range: use 0..{num_shards - 1}")
    x, y = _source_arrays(data, seed)
    idx = _split_indices(len(x), split)[shard::num_shards]
    if len(idx) == 0:
        raise ValueError(
            f"shard {shard} of {num_shards} of the {split} split is empty (the split has "
            f"{len(_split_indices(len(x), split))} examples): use fewer shards or more data"
        )
    return ArrayDataset(x[idx], y[idx], seed)


def data_shape(data: Mapping[str, Any], seed: int) -> DataShape:
    """Features, classes and vocabulary size implied by a data config (files are read to find out)."""
    named = named_data_shape(data)
    if named is not None:
        return named
    x, y = _source_arrays(data, seed)
    num_classes = int(y.max()) + 1 if y.dtype.kind == "i" else None
    vocab_size = int(x.max()) + 1 if x.dtype.kind == "i" else None
    return DataShape(int(np.prod(x.shape[1:])), num_classes, vocab_size)


def _source_arrays(data: Mapping[str, Any], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """All examples of a source (before the split), cached so build() and dataset() read a file once."""
    kind, opts = parse_data_config(data)
    stamp: tuple[str, int, int] | None = None
    if kind.startswith("."):
        path = Path(opts["path"]).expanduser()
        if not path.is_file():
            raise ValueError(f"data file {opts['path']!r} does not exist: check data.path")
        stat = path.stat()
        stamp = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    seed_key = seed & _SEED_MASK if kind.startswith("synthetic") else 0
    return _load(kind, tuple(sorted(opts.items())), seed_key, stamp)


@functools.lru_cache(maxsize=4)
def _load(
    kind: str, items: tuple[tuple[str, Any], ...], seed: int, stamp: tuple[str, int, int] | None
) -> tuple[np.ndarray, np.ndarray]:
    opts = dict(items)
    if kind == "digits":
        x, y = _digits()
    elif kind == "synthetic_classification":
        x, y = _synthetic_classification(opts, seed)
    elif kind == "synthetic_embedding":
        x, y = _synthetic_embedding(opts, seed)
    elif kind == ".npz":
        x, y = _read_npz(opts)
    else:
        x, y = _read_csv(opts)
    x, y = _as_examples(x, y, opts.get("path", kind))
    x.flags.writeable = False  # shared by every caller through the cache
    y.flags.writeable = False
    return x, y


def _split_indices(n: int, split: str) -> np.ndarray:
    order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    n_test = round(n * TEST_FRACTION)
    return np.sort(order[:n_test] if split == "test" else order[n_test:])


def _digits() -> tuple[np.ndarray, np.ndarray]:
    table = _digits_table()
    return (table[:, :-1] / 16.0).astype(np.float32), table[:, -1].astype(np.int64)


def _digits_table() -> np.ndarray:
    """The UCI digits as scikit-learn ships them: 1,797 rows of 64 pixels (0-16) and the label. Read from its
    file, without importing scikit-learn, whose import costs every role that loads digits ~1 s of CPU at start
    (a worker loads its data before it serves); through ``load_digits`` where the file is not where it was."""
    found = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if found is None:
        raise ValueError("the digits data set ships with scikit-learn: pip install 'psctl[datasets]'")
    for root in found.submodule_search_locations or ():
        path = Path(root, *DIGITS_FILE)
        if path.is_file():
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    digits = load_digits()
    return np.column_stack([digits.data, digits.target])


def _synthetic_classification(opts: dict[str, Any], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a random linear teacher, so a linear model can learn them."""
    rng = np.random.default_rng([seed, 1])
    n, f, c = opts["num_examples"], opts["num_features"], opts["num_classes"]
    teacher = rng.standard_normal((f, c), dtype=np.float32)
    x = rng.standard_normal((n, f), dtype=np.float32)
    logits = x @ teacher / np.float32(np.sqrt(f))  # unit-scale logits, so `noise` is relative to signal
    logits += np.float32(opts["noise"]) * rng.standard_normal((n, c), dtype=np.float32)
    return x, logits.argmax(axis=1).astype(np.int64)


def _synthetic_embedding(opts: dict[str, Any], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Id lists labelled by a hidden per-id weight: y = mean(w_true[ids]) above its median."""
    rng = np.random.default_rng([seed, 2])
    n, vocab, k, zipf = opts["num_examples"], opts["vocab_size"], opts["ids_per_example"], opts["zipf"]
    uniform = not zipf
    ids = rng.integers(0, vocab, size=(n, k), dtype=np.int64) if uniform else zipf_ids(rng, float(zipf), vocab, (n, k))
    w_true = rng.standard_normal(vocab)
    score = w_true[ids].mean(axis=1)
    # split at the median: both labels stay common however skewed the ids (with Zipf ids the few most popular
    # ids' weights would otherwise decide most labels alike)
    return ids, (score > np.median(score)).astype(np.int64)


#: Scatters Zipf ranks over the vocabulary (odd, and coprime with the vocabulary size once adjusted).
_SCATTER = 2_654_435_761


def zipf_ids(rng: np.random.Generator, s: float, vocab: int, shape: tuple[int, ...]) -> np.ndarray:
    """Ids whose popularity follows a power law of exponent ``s`` over the vocabulary's ranks (1..vocab, no
    clipping: the rarest rank is as rare as the law says), each rank then scattered to an id by a
    multiplicative hash, so popular ids fall on every shard of a table (as real ids do), not all at its start."""
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -s)
    rank = np.searchsorted(cdf, rng.random(shape) * cdf[-1], side="right").astype(np.int64)  # 0-based
    step = _SCATTER % vocab or 1
    while math.gcd(step, vocab) != 1:
        step += 1
    return np.asarray((rank * step) % vocab, dtype=np.int64)


def _read_npz(opts: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    path = opts["path"]
    try:  # (numpy takes a file that is no zip for one pickled array: it said to load it unsafely)
        if not zipfile.is_zipfile(Path(path).expanduser()):
            raise ValueError(f"{path} is not a .npz file (a zip of .npy arrays): write it with numpy.savez")
    except OSError as e:
        raise ValueError(f"cannot read {path} as .npz: {_one_line(e)}") from None
    try:
        with np.load(Path(path).expanduser(), allow_pickle=False) as arrays:
            names = list(arrays.files)
            if opts["x"] in names and opts["y"] in names:
                return arrays[opts["x"]], arrays[opts["y"]]
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"cannot read {path} as .npz: {_one_line(e)}") from None
    missing = next(opts[k] for k in ("x", "y") if opts[k] not in names)
    have = ", ".join(names) or "none"
    raise ValueError(f"{path} has no array {missing!r} (it has {have}): set data.x / data.y")


def _read_csv(opts: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    path = opts["path"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file warns; it is reported below instead
            table = np.loadtxt(
                Path(path).expanduser(),
                delimiter=opts["delimiter"],
                skiprows=1 if opts["skip_header"] else 0,
                ndmin=2,
                dtype=np.float64,
            )
    except ValueError as e:
        hint = "" if opts["skip_header"] else "; set skip_header: true if the first line is a header"
        raise ValueError(f"cannot read {path} as CSV numbers: {_one_line(e)}{hint}") from None
    if table.size == 0:
        raise ValueError(f"{path} has no rows of data")
    cols = table.shape[1]
    if cols < 2:
        raise ValueError(f"{path} needs at least two columns (features and a label), found {cols}")
    col = opts["label_column"]
    if not -cols <= col < cols:
        raise ValueError(f"data.label_column {col} is out of range for {path}, which has {cols} columns")
    return np.delete(table, col, axis=1), table[:, col]


def _as_examples(x: np.ndarray, y: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Common dtypes and shapes: x float32 features (or int64 ids), y int64 labels when integral."""
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"{where}: x and y must be arrays of examples, not scalars")
    if len(x) != len(y):
        raise ValueError(f"{where}: x has {len(x)} examples but y has {len(y)}")
    if len(x) == 0:
        raise ValueError(f"{where} has no examples")
    x = x.reshape(len(x), -1)
    y = y.reshape(len(y)) if y.ndim == 2 and y.shape[1] == 1 else y
    x = x.astype(np.int64) if x.dtype.kind in "iu" else x.astype(np.float32)
    if y.dtype.kind in "biu" or (y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y))):
        y = y.astype(np.int64)
    elif y.dtype.kind == "f":
        y = y.astype(np.float32)
    return np.ascontiguousarray(x), np.ascontiguousarray(y)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

"""psctl.models.data: deterministic resumable batches, disjoint shards and splits, file sources, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from psctl.models import data as data_mod
from psctl.models.data import ArrayDataset, data_shape, load_dataset
from psctl.runtime.data_config import DATA_SOURCES

N = 103  # not a multiple of any batch size or shard count used below


@pytest.fixture
def indexed_npz(tmp_path: Path) -> dict[str, str]:
    """A file whose x is each example's own index, so tests can see which examples they got."""
    path = tmp_path / "indexed.npz"
    np.savez(path, x=np.arange(N).reshape(-1, 1), y=np.arange(N) % 3)
    return {"path": str(path)}


def _ids(dataset: ArrayDataset) -> np.ndarray:
    return dataset.x[:, 0]


def test_same_position_same_batch_in_any_order_and_any_instance() -> None:
    a = ArrayDataset(np.arange(50).reshape(-1, 1), np.zeros(50), seed=4)
    b = ArrayDataset(np.arange(50).reshape(-1, 1), np.zeros(50), seed=4)
    forward = [a.batch(k, 7)["x"] for k in range(20)]
    for k in reversed(range(20)):  # a restarted worker jumps straight to its position
        np.testing.assert_array_equal(b.batch(k, 7)["x"], forward[k])
    assert not np.array_equal(ArrayDataset(a.x, a.y, seed=5).batch(0, 50)["x"], a.batch(0, 50)["x"]), (
        "the seed should change the order"
    )


@pytest.mark.parametrize("batch_size", [1, 10, 32, N, 250])
def test_each_epoch_of_consecutive_batches_covers_every_example_once(batch_size: int) -> None:
    ds = ArrayDataset(np.arange(N).reshape(-1, 1), np.arange(N), seed=1)
    batches = [ds.batch(k, batch_size) for k in range(-(-3 * N // batch_size))]
    assert all(len(b["x"]) == batch_size for b in batches)
    stream = np.concatenate([b["x"][:, 0] for b in batches])
    for epoch in range(3):
        np.testing.assert_array_equal(np.sort(stream[epoch * N : (epoch + 1) * N]), np.arange(N))
    assert not np.array_equal(stream[:N], stream[N : 2 * N]), "each epoch is reshuffled"
    np.testing.assert_array_equal(batches[0]["y"], batches[0]["x"][:, 0])  # x and y stay paired


def test_batch_arguments_checked() -> None:
    ds = ArrayDataset(np.zeros((4, 1)), np.zeros(4), seed=0)
    with pytest.raises(ValueError, match="position"):
        ds.batch(-1, 2)
    with pytest.raises(ValueError, match="batch size"):
        ds.batch(0, 0)
    with pytest.raises(ValueError, match="3 examples but y has 4"):
        ArrayDataset(np.zeros((3, 1)), np.zeros(4), seed=0)


@pytest.mark.parametrize("num_shards", [1, 3, 4])
def test_shards_are_disjoint_and_cover_the_split(indexed_npz, num_shards: int) -> None:
    for split in ("train", "test"):
        shards = [
            _ids(load_dataset(indexed_npz, split=split, shard=i, num_shards=num_shards, seed=0))
            for i in range(num_shards)
        ]
        whole = _ids(load_dataset(indexed_npz, split=split, shard=0, num_shards=1, seed=0))
        joined = np.concatenate(shards)
        assert len(joined) == len(np.unique(joined)) == len(whole)
        np.testing.assert_array_equal(np.sort(joined), np.sort(whole))
        np.testing.assert_array_equal(shards[-1], whole[num_shards - 1 :: num_shards])


def test_train_and_test_are_disjoint_and_cover_everything(indexed_npz) -> None:
    train = _ids(load_dataset(indexed_npz, split="train", shard=0, num_shards=1, seed=0))
    test = _ids(load_dataset(indexed_npz, split="test", shard=0, num_shards=1, seed=9))
    assert len(test) == round(0.2 * N)
    assert not set(train) & set(test)
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(N))


def test_npz_with_named_arrays(tmp_path: Path) -> None:
    path = tmp_path / "named.npz"
    rng = np.random.default_rng(0)
    np.savez(path, feats=rng.random((20, 2, 3)), labels=rng.integers(0, 4, 20).astype(np.float64))
    config = {"path": str(path), "x": "feats", "y": "labels"}
    ds = load_dataset(config, split="train", shard=0, num_shards=1, seed=0)
    assert ds.x.shape == (16, 6) and ds.x.dtype == np.float32  # flattened to features
    assert ds.y.dtype == np.int64  # integral labels become class ids
    assert data_shape(config, 0).num_features == 6
    with pytest.raises(ValueError, match=r"has no array 'x' \(it has feats, labels\)"):
        load_dataset({"path": str(path)}, split="train", shard=0, num_shards=1, seed=0)


def test_csv_with_header_and_label_column(tmp_path: Path) -> None:
    path = tmp_path / "table.csv"
    rows = [f"{i % 2},{i * 0.5},{-i}" for i in range(10)]
    path.write_text("label,a,b\n" + "\n".join(rows) + "\n")
    config = {"path": str(path), "label_column": 0, "skip_header": True}
    ds = load_dataset(config, split="test", shard=0, num_shards=1, seed=0)
    assert ds.x.shape == (2, 2) and ds.x.dtype == np.float32 and ds.y.dtype == np.int64
    np.testing.assert_array_equal(ds.y, (-ds.x[:, 1]).astype(np.int64) % 2)
    assert data_shape(config, 0) == data_mod.DataShape(2, 2, None)

    default_label = load_dataset({**config, "label_column": -1}, split="train", shard=0, num_shards=1, seed=0)
    np.testing.assert_array_equal(default_label.y, -2 * default_label.x[:, 1])
    with pytest.raises(ValueError, match="skip_header: true"):
        load_dataset({"path": str(path)}, split="train", shard=0, num_shards=1, seed=0)
    with pytest.raises(ValueError, match="label_column 5 is out of range"):
        load_dataset({**config, "label_column": 5}, split="train", shard=0, num_shards=1, seed=0)


def test_synthetic_sources_are_deterministic_per_seed() -> None:
    config = {"name": "synthetic_classification", "num_examples": 500, "num_features": 8, "num_classes": 3}
    a = load_dataset(config, split="train", shard=0, num_shards=1, seed=1)
    b = load_dataset(dict(config), split="train", shard=0, num_shards=1, seed=1)
    c = load_dataset(config, split="train", shard=0, num_shards=1, seed=2)
    np.testing.assert_array_equal(a.x, b.x)
    assert not np.array_equal(a.x, c.x)
    assert a.x.shape == (400, 8) and a.x.dtype == np.float32
    assert set(np.unique(a.y)) == {0, 1, 2}


@pytest.mark.parametrize("zipf", [0.0, 1.5])
def test_synthetic_embedding_ids_and_labels(zipf: float) -> None:
    config = {"name": "synthetic_embedding", "num_examples": 2000, "vocab_size": 500, "zipf": zipf}
    ds = load_dataset(config, split="train", shard=0, num_shards=1, seed=0)
    assert ds.x.shape == (1600, 10) and ds.x.dtype == np.int64
    assert ds.x.min() >= 0 and ds.x.max() < 500
    assert 0.05 < ds.y.mean() < 0.95  # both labels occur (Zipf ids make them less balanced)
    top = np.bincount(ds.x.ravel(), minlength=500).max() / ds.x.size
    assert (top > 0.2) if zipf else (top < 0.02)  # Zipf skews ids towards the most frequent one
    assert data_shape(config, 0).vocab_size == 500


def test_digits() -> None:
    pytest.importorskip("sklearn")
    train = load_dataset({"name": "digits"}, split="train", shard=0, num_shards=1, seed=0)
    test = load_dataset({"name": "digits"}, split="test", shard=0, num_shards=1, seed=0)
    assert train.num_examples + test.num_examples == 1797
    assert train.x.shape[1] == 64 and train.x.min() >= 0.0 and train.x.max() <= 1.0
    assert set(np.unique(train.y)) == set(range(10))


DIGITS_CHECK = """
import sys
import numpy as np
from psctl.models.data import _digits
x, y = _digits()
assert "sklearn" not in sys.modules, "loading the digits imported scikit-learn"
from sklearn.datasets import load_digits
digits = load_digits()
assert x.dtype == np.float32 and y.dtype == np.int64
assert np.array_equal(x, (digits.data / 16.0).astype(np.float32)) and np.array_equal(y, digits.target)
print("same")
"""


def test_digits_are_scikit_learns_read_without_importing_it() -> None:
    pytest.importorskip("sklearn")
    done = subprocess.run([sys.executable, "-c", DIGITS_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "same", done.stderr


def test_digits_come_through_load_digits_where_their_file_is_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    monkeypatch.setattr(data_mod, "DIGITS_FILE", ("datasets", "data", "no-such-file.csv.gz"))
    x, y = data_mod._digits()
    digits = load_digits()
    assert np.array_equal(x, (digits.data / 16.0).astype(np.float32)) and np.array_equal(y, digits.target)


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    data_mod._load.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as Python marks a package that cannot be imported
    with pytest.raises(ValueError, match=r"pip install 'psctl\[datasets\]'"):
        load_dataset({"name": "digits"}, split="train", shard=0, num_shards=1, seed=0)


@pytest.mark.parametrize(
    ("config", "kwargs", "message"),
    [
        ({"name": "imagenet"}, {}, "unknown data source 'imagenet': use one of " + ", ".join(DATA_SOURCES)),
        ({"name": "digits", "size": 3}, {}, r"unknown data key\(s\) 'size' for digits; valid: none"),
        ({"name": "synthetic_embedding", "vocab": 3}, {}, "'vocab' .* valid: ids_per_example, num_examples"),
        ({"name": "synthetic_embedding", "zipf": 0.5}, {}, "zipf must be 0"),
        ({"name": "synthetic_classification", "num_classes": 1}, {}, "num_classes must be an integer >= 2"),
        ({}, {}, "needs 'name'"),
        ({"path": "nowhere.npz"}, {}, "data file 'nowhere.npz' does not exist"),
        ({"path": "data.parquet"}, {}, "must end in .npz or .csv"),
        ({"name": "digits"}, {"shard": 2, "num_shards": 2}, r"shard index 2 is out of range: use 0..1"),
        ({"name": "digits"}, {"shard": -1}, "shard index -1 is out of range"),
        ({"name": "digits"}, {"num_shards": 0}, "num_shards must be an integer >= 1"),
        ({"name": "digits"}, {"split": "validation"}, "unknown split 'validation'"),
        (
            {"name": "synthetic_classification", "num_examples": 10},
            {"shard": 5, "num_shards": 6, "split": "test"},
            "shard 5 of 6 of the test split is empty",
        ),
    ],
)
def test_errors_say_what_is_wrong(config, kwargs, message: str) -> None:
    args = {"split": "train", "shard": 0, "num_shards": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(config, **args)
    assert "\n" not in str(info.value)


def test_unreadable_npz(tmp_path: Path) -> None:
    """A file that is no zip was read by numpy as one pickled array: the message said it "contains pickled
    (object) data" and to load it unsafely."""
    path = tmp_path / "broken.npz"
    path.write_text("not a zip file\n")
    with pytest.raises(ValueError) as caught:
        load_dataset({"path": str(path)}, split="train", shard=0, num_shards=1, seed=0)
    assert str(caught.value) == f"{path} is not a .npz file (a zip of .npy arrays): write it with numpy.savez"


def test_zipf_ids_follow_a_bounded_power_law_scattered_over_the_vocabulary() -> None:
    """The reference workload's ids (W2 Zipf): rank popularity ~ rank^-1.1 over ranks 1..vocab, no clipping,
    each rank hashed to an id: a batch of 512 x 10 touches the distinct ids the law predicts, spread out."""
    from psctl.models.data import zipf_ids

    vocab, s = 1_000_000, 1.1
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -s / (ranks ** -s).sum()
    expected = float((1 - (1 - p) ** 5120).sum())  # E[distinct ids among 5,120 draws] = 2,113
    seen = [len(np.unique(zipf_ids(np.random.default_rng(seed), s, vocab, (512, 10)))) for seed in range(5)]
    assert abs(np.mean(seen) - expected) < 0.03 * expected, (seen, expected)
    ids = zipf_ids(np.random.default_rng(0), s, vocab, (200_000,))
    assert ids.min() >= 0 and ids.max() < vocab
    assert np.count_nonzero(ids == vocab - 1) < 10  # nothing piles up at the end (the old generator clipped there)
    # the popular ids are spread over the table: a 4-way row split sees each quarter used
    quarters = np.bincount(ids // (vocab // 4), minlength=4) / ids.size
    assert quarters.min() > 0.1, quarters

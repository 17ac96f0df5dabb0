"""psctl.models: hand-written gradients match finite differences, and the models actually learn."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from psctl.models import mlp, softmax, wide_embedding
from psctl.models.wide_embedding import auc
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import (
    EmbeddingRows,
    LowRankGrad,
    Program,
    ProgramRef,
    SparseGrad,
    VariableDef,
    load_program,
)
from psctl.runtime.wire import DENSE, LEFT_FACTOR, RIGHT_FACTOR

SMALL_CLS = {"name": "synthetic_classification", "num_examples": 200, "num_features": 5, "num_classes": 3}
SMALL_EMB = {"name": "synthetic_embedding", "num_examples": 200, "vocab_size": 30, "ids_per_example": 6}


def _init(var: VariableDef, rng: np.random.Generator, dtype: type = np.float32) -> np.ndarray:
    """A stand-in for the runtime's initializers, so these tests depend only on the models."""
    if var.initializer == "zeros":
        return np.zeros(var.shape, dtype)
    if var.initializer == "normal":
        return (rng.standard_normal(var.shape) * (var.init_scale or 1.0)).astype(dtype)
    limit = np.sqrt(6.0 / (var.shape[0] + var.shape[-1]))
    return rng.uniform(-limit, limit, var.shape).astype(dtype)


def _random_params(program: Program, seed: int = 0) -> dict[str, np.ndarray]:
    """float64 params with every entry non-zero, so each gradient term is exercised."""
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape) * 0.5 for v in program.variables()}


def _numeric_grad(f: Callable[[], float], arr: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(arr)
    for i in np.ndindex(arr.shape):
        old = arr[i]
        arr[i] = old + eps
        up = f()
        arr[i] = old - eps
        down = f()
        arr[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def _sparse(grad: np.ndarray | SparseGrad) -> SparseGrad:
    assert isinstance(grad, SparseGrad)
    return grad


def _dense(grad: np.ndarray | SparseGrad | LowRankGrad) -> np.ndarray:
    """A dense gradient as it is, or a low-rank one multiplied out."""
    if isinstance(grad, LowRankGrad):
        return grad.dense()
    assert isinstance(grad, np.ndarray)
    return grad


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-12))


def _check_dense_grads(program: Program, batch: dict[str, np.ndarray]) -> None:
    params = _random_params(program)
    _, grads = program.loss_and_grads(params, batch)
    assert set(grads) == set(params)
    for name, value in params.items():
        numeric = _numeric_grad(lambda: program.loss_and_grads(params, batch)[0], value)
        assert _dense(grads[name]).dtype == np.float64
        assert _rel_err(_dense(grads[name]), numeric) < 1e-4, name


def test_softmax_gradients_match_finite_differences() -> None:
    program = softmax.build({}, SMALL_CLS, seed=1)
    _check_dense_grads(program, program.dataset("train", 0, 1).batch(0, 16))


def test_mlp_gradients_match_finite_differences() -> None:
    program = mlp.build({"hidden_units": 7}, SMALL_CLS, seed=1)
    _check_dense_grads(program, program.dataset("train", 0, 1).batch(0, 16))


def test_deep_mlp_gradients_match_finite_differences() -> None:
    program = mlp.build({"hidden_units": [7, 5, 6]}, SMALL_CLS, seed=1)
    names = [v.name for v in program.variables()]
    assert names[::2] == ["hid/kernel", "hid_2/kernel", "hid_3/kernel", "sm/kernel"]
    _check_dense_grads(program, program.dataset("train", 0, 1).batch(0, 16))


@pytest.mark.parametrize(
    "batch",
    [
        # Repeats within an example and across examples: each occurrence must add to the row's gradient.
        {"x": np.array([[1, 1, 3], [3, 5, 1], [7, 7, 7]]), "y": np.array([1, 0, 1])},
        None,  # a generated batch
    ],
    ids=["duplicates", "synthetic"],
)
def test_wide_embedding_sparse_gradient_matches_finite_differences(batch) -> None:
    program = wide_embedding.build({"dim": 4}, SMALL_EMB, seed=2)
    if batch is None:
        batch = program.dataset("train", 0, 1).batch(3, 12)
    dense = _random_params(program)
    ids = program.embedding_ids(batch)["emb/table"]
    np.testing.assert_array_equal(ids, np.unique(batch["x"]))
    rows = EmbeddingRows(ids, dense["emb/table"][ids].copy())
    params: dict[str, np.ndarray | EmbeddingRows] = {**dense, "emb/table": rows}

    loss, grads = program.loss_and_grads(params, batch)
    sparse = _sparse(grads["emb/table"])
    np.testing.assert_array_equal(sparse.ids, ids)

    def f() -> float:
        return program.loss_and_grads(params, batch)[0]

    assert _rel_err(sparse.values, _numeric_grad(f, rows.rows)) < 1e-4
    for name in ("head/kernel", "head/bias"):
        assert _rel_err(_dense(grads[name]), _numeric_grad(f, dense[name])) < 1e-4, name

    # A whole table gives the same loss and gradient as the rows the batch needs.
    full_loss, full_grads = program.loss_and_grads(dense, batch)
    assert full_loss == pytest.approx(loss)
    np.testing.assert_allclose(_sparse(full_grads["emb/table"]).values, sparse.values)


def test_wide_embedding_rows_beyond_the_batch_get_zero_gradient() -> None:
    program = wide_embedding.build({"dim": 3}, SMALL_EMB, seed=0)
    params = _random_params(program)
    batch = {"x": np.array([[2, 4], [4, 4]]), "y": np.array([0, 1])}
    ids = np.array([1, 2, 4, 9])
    params_rows: dict[str, np.ndarray | EmbeddingRows] = {
        **params,
        "emb/table": EmbeddingRows(ids, params["emb/table"][ids]),
    }
    values = _sparse(program.loss_and_grads(params_rows, batch)[1]["emb/table"]).values
    assert np.all(values[[0, 3]] == 0) and np.all(values[[1, 2]] != 0)


def test_wide_embedding_refuses_missing_rows_and_out_of_vocab_ids() -> None:
    program = wide_embedding.build({"dim": 3}, SMALL_EMB, seed=0)
    params = _random_params(program)
    batch = {"x": np.array([[2, 4]]), "y": np.array([1])}
    short: dict[str, np.ndarray | EmbeddingRows] = {
        **params,
        "emb/table": EmbeddingRows(np.array([2]), params["emb/table"][[2]]),
    }
    with pytest.raises(ValueError, match="do not include every id"):
        program.loss_and_grads(short, batch)
    with pytest.raises(ValueError, match=r"ids must be in \[0, 30\)"):
        program.embedding_ids({"x": np.array([[2, 30]]), "y": np.array([1])})


def test_args_the_data_contradicts_are_refused_at_build_naming_the_arg(tmp_path) -> None:
    """`num_features: 10` on digits failed at the first step ("batch has 64 features but the model expects 10"),
    `vocab_size` below the data's ids likewise ("ids must be in [0, 100)"): refused when the program is built,
    naming the arg, also for a data file (whose shape only the roles read)."""
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((20, 12), np.float32), y=np.arange(20) % 4)
    data = {"path": str(path)}
    with pytest.raises(ValueError, match=r"^args.num_features for psctl.models.mlp is 10, but the data has 12 "
                                         r"features per example: remove args.num_features \(it is read from the "
                                         r"data\) or give 12$"):
        mlp.build({"num_features": 10}, data, 0)
    with pytest.raises(ValueError, match=r"^args.num_classes for psctl.models.softmax is 3, but the data has 4 "
                                         r"classes \(labels up to 3\)"):
        softmax.build({"num_classes": 3}, data, 0)
    ids = {"name": "synthetic_embedding", "vocab_size": 500}
    with pytest.raises(ValueError, match=r"^args.vocab_size for psctl.models.wide_embedding is 100, but the data "
                                         r"has 500 ids \(up to 499\): .* or give at least 500$"):
        wide_embedding.build({"vocab_size": 100}, ids, 0)
    # what agrees with the data, or leaves room beyond it, is taken
    assert mlp.build({"num_features": 12, "num_classes": 6}, data, 0).num_classes == 6
    assert wide_embedding.build({"vocab_size": 800}, ids, 0).vocab_size == 800


def test_float32_params_give_float32_gradients_without_warnings() -> None:
    program = softmax.build({}, SMALL_CLS, seed=0)
    params = {k: (v * 1e4).astype(np.float32) for k, v in _random_params(program).items()}  # huge logits
    loss, grads = program.loss_and_grads(params, program.dataset("train", 0, 1).batch(0, 8))
    assert np.isfinite(loss) and all(_dense(g).dtype == np.float32 for g in grads.values())

    emb = wide_embedding.build({"dim": 3}, SMALL_EMB, seed=0)
    params = {k: (v * 1e4).astype(np.float32) for k, v in _random_params(emb).items()}
    batch = emb.dataset("train", 0, 1).batch(0, 8)
    loss, grads = emb.loss_and_grads(params, batch)
    assert np.isfinite(loss) and _sparse(grads["emb/table"]).values.dtype == np.float32
    assert np.isfinite(emb.evaluate(params, batch)["loss"])


def test_auc_is_the_rank_statistic() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.integers(0, 2, 200)
    pos, neg = scores[y == 1], scores[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert auc(scores, y) == pytest.approx(pairs)
    assert auc(np.array([0.1, 0.9]), np.array([0, 1])) == 1.0
    assert np.isnan(auc(np.array([0.1, 0.9]), np.array([1, 1])))


def _adam(program: Program, steps: int, batch_size: int, lr: float) -> dict[str, float]:
    """Plain in-process Adam (lazy on embedding rows), then metrics on the whole test split."""
    rng = np.random.default_rng(0)
    variables = program.variables()
    params = {v.name: _init(v, rng) for v in variables}
    embeddings = {v.name for v in variables if v.embedding}
    m = {k: np.zeros_like(p) for k, p in params.items()}
    s = {k: np.zeros_like(p) for k, p in params.items()}
    data = program.dataset("train", 0, 1)
    for step in range(steps):
        batch = data.batch(step, batch_size)
        ids = program.embedding_ids(batch)
        feed = {k: EmbeddingRows(ids[k], p[ids[k]]) if k in embeddings else p for k, p in params.items()}
        _, grads = program.loss_and_grads(feed, batch)
        for name, grad in grads.items():
            rows, g = (grad.ids, grad.values) if isinstance(grad, SparseGrad) else (slice(None), _dense(grad))
            m[name][rows] = 0.9 * m[name][rows] + 0.1 * g
            s[name][rows] = 0.999 * s[name][rows] + 0.001 * g * g
            params[name][rows] -= lr * m[name][rows] / (np.sqrt(s[name][rows]) + 1e-8)
    test = program.dataset("test", 0, 1)
    whole = test.batch(0, test.num_examples)  # the whole split, once
    ids = program.embedding_ids(whole)
    feed = {k: EmbeddingRows(ids[k], p[ids[k]]) if k in embeddings else p for k, p in params.items()}
    return program.evaluate(feed, whole)


def test_softmax_learns_digits() -> None:
    pytest.importorskip("sklearn")
    metrics = _adam(softmax.build({}, {"name": "digits"}, seed=0), steps=300, batch_size=64, lr=0.01)
    assert set(metrics) == {"loss", "accuracy"}
    assert metrics["accuracy"] >= 0.9


def test_mlp_learns_digits() -> None:
    pytest.importorskip("sklearn")
    metrics = _adam(mlp.build({"hidden_units": 32}, {"name": "digits"}, seed=0), 300, 64, 0.01)
    assert metrics["accuracy"] >= 0.9


def test_softmax_learns_the_planted_linear_teacher() -> None:
    data = {"name": "synthetic_classification", "num_examples": 3000, "num_features": 20, "num_classes": 4}
    assert _adam(softmax.build({}, data, seed=0), 300, 64, 0.02)["accuracy"] >= 0.85


@pytest.mark.parametrize("zipf", [0.0, 1.3])
def test_wide_embedding_learns_synthetic_embedding(zipf: float) -> None:
    data = {"name": "synthetic_embedding", "num_examples": 20000, "vocab_size": 1000, "zipf": zipf}
    metrics = _adam(wide_embedding.build({"dim": 8}, data, seed=0), 400, 128, 0.05)
    assert set(metrics) == {"loss", "accuracy", "auc"}
    assert metrics["accuracy"] > 0.8 and metrics["auc"] > 0.85


def test_args_default_from_data_and_override() -> None:
    kernel = {v.name: v for v in softmax.build({}, SMALL_CLS, 0).variables()}["softmax/kernel"]
    assert kernel.shape == (5, 3)
    names = [v.name for v in mlp.build({"num_classes": 12}, {"name": "digits"}, 0).variables()]
    assert names == ["hid/kernel", "hid/bias", "sm/kernel", "sm/bias"]
    shapes = {v.name: v.shape for v in mlp.build({"num_classes": 12}, {"name": "digits"}, 0).variables()}
    assert shapes["hid/kernel"] == (64, 100) and shapes["sm/bias"] == (12,)
    table = wide_embedding.build({}, SMALL_EMB, 0).variables()[0]
    assert (table.name, table.shape, table.embedding, table.initializer, table.init_scale) == (
        "emb/table",
        (30, 16),
        True,
        "normal",
        0.01,
    )


@pytest.mark.parametrize("module", [softmax, mlp, wide_embedding])
def test_unknown_args_refused(module) -> None:
    with pytest.raises(ValueError, match=r"unknown arg\(s\) 'bogus'.*valid args: .*"):
        module.build({"bogus": 1}, SMALL_EMB if module is wide_embedding else SMALL_CLS, 0)


def test_bad_or_missing_args_refused() -> None:
    with pytest.raises(ValueError, match=r"hidden_units .* positive integer"):
        mlp.build({"hidden_units": 0}, SMALL_CLS, 0)
    with pytest.raises(ValueError, match=r"hidden_units .* list of them"):
        mlp.build({"hidden_units": [16, 0]}, SMALL_CLS, 0)
    with pytest.raises(ValueError, match=r"dim .* positive integer"):
        wide_embedding.build({"dim": True}, SMALL_EMB, 0)
    with pytest.raises(ValueError, match=r"needs args\.vocab_size"):
        wide_embedding.build({}, {"name": "digits"}, 0)


def test_load_program_builds_a_builtin_model() -> None:
    program = load_program(ProgramRef("psctl.models.mlp", {"hidden_units": 8}, dict(SMALL_CLS), seed=3))
    assert program.dataset("test", 0, 1).num_examples == 40
    assert program.embedding_ids(program.dataset("train", 0, 1).batch(0, 4)) == {}


def test_a_dense_layers_gradient_travels_as_its_factors_only_where_they_are_smaller() -> None:
    """ShardedModel.push_plan: a LowRankGrad goes to each shard as LEFT_FACTOR/RIGHT_FACTOR where k x (rows +
    columns) < rows x columns (hid/kernel: 40 x 32 cut in two, batch 4), else multiplied out (sm/kernel: 32 x 3),
    and every shard's part equals the dense gradient's rows."""
    program = mlp.build({"hidden_units": 32}, {**SMALL_CLS, "num_features": 40}, seed=1)
    model = ShardedModel(program, 2, {"kind": "fixed", "num_shards": 2})
    params = {k: v.astype(np.float32) for k, v in _random_params(program).items()}
    _, grads = program.loss_and_grads(params, program.dataset("train", 0, 1).batch(0, 4))
    plan = model.push_plan(grads)
    sent: dict[str, dict[int, np.ndarray]] = {}
    for entries in plan.values():
        for entry in entries:
            sent.setdefault(entry.name, {})[int(entry.kind)] = entry.array
    assert set(sent["hid/kernel/part_0"]) == set(sent["hid/kernel/part_1"]) == {LEFT_FACTOR, RIGHT_FACTOR}
    assert set(sent["sm/kernel/part_0"]) == {DENSE}  # 4 x (16 + 3) > 16 x 3: the product is smaller
    for name in ("hid/kernel", "sm/kernel"):
        layout = model.layouts[name]
        whole = _dense(grads[name])
        for shard, want in zip(layout.shards, layout.split(whole), strict=True):
            got = sent[shard.name]
            part = got[DENSE] if DENSE in got else got[LEFT_FACTOR].T @ got[RIGHT_FACTOR]
            np.testing.assert_allclose(part, want, rtol=1e-6, atol=1e-7)
    factored = sum(a.nbytes for e in plan.values() for a in [x.array for x in e])
    assert factored < sum(_dense(g).nbytes for g in grads.values())


@pytest.mark.parametrize("form", ["dense", "sparse", "low-rank"])
def test_a_gradient_that_is_not_real_numbers_is_refused_naming_its_variable(form: str) -> None:
    """A complex gradient was cast to the variable's float32, its imaginary parts dropped with only numpy's
    warning in the log, and training went on; an int one is exact and stays accepted."""
    program = mlp.build({"hidden_units": 8}, dict(SMALL_CLS), seed=1)
    model = ShardedModel(program, 1, None)
    shape = model.layouts["hid/kernel"].variable.shape
    grads: dict[str, object] = {
        "dense": {"hid/kernel": np.ones(shape, dtype=np.complex128)},
        "sparse": {"hid/kernel": SparseGrad(np.array([0, 2]), np.ones((2, shape[1]), dtype=np.complex64))},
        "low-rank": {"hid/kernel": LowRankGrad(np.ones((4, shape[0])), np.full((4, shape[1]), "x"))},
    }[form]
    with pytest.raises(ValueError, match=r"gradient for 'hid/kernel' is of dtype (complex|<U).*; a gradient holds "
                                         r"real numbers \(the variable is float32\)"):
        model.push_plan(grads)  # type: ignore[arg-type]
    plan = model.push_plan({"hid/kernel": np.ones(shape, dtype=np.int64)})
    assert plan[0][0].array.dtype == np.float32 and np.all(plan[0][0].array == 1)


def test_a_classifier_on_labels_that_are_not_class_ids_says_so(tmp_path) -> None:
    """A data file whose labels hold a 1.5: it said mlp "needs args.num_classes: it cannot be inferred from the
    data config", and with it given, failed again on the labels."""
    import numpy as np
    import pytest

    path = tmp_path / "labels.npz"
    np.savez(path, x=np.ones((20, 3), np.float32), y=np.array([0, 1, 1.5, 2] * 5))
    with pytest.raises(ValueError) as caught:
        mlp.build({}, {"path": str(path)}, 0)
    assert str(caught.value) == ("psctl.models.mlp classifies, and the data's labels are not all whole numbers "
                                 "(class ids 0 to N-1): fix the labels (data.y, or the label column)")

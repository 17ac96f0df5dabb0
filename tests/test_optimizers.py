"""The PS-side optimizers against their textbook update rules, written out independently below."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from psctl.runtime.optimizers import OPTIMIZERS, Adam, Optimizer, make_optimizer

# (optimizer name, params) pairs covering every rule and its variants, with non-default values too.
CASES: list[tuple[str, dict[str, float]]] = [
    ("sgd", {}),
    ("momentum", {}),
    ("momentum", {"momentum": 0.5, "nesterov": 1}),
    ("adagrad", {}),
    ("adagrad", {"initial_accumulator": 0.0, "epsilon": 1e-3}),
    ("adam", {}),
    ("adam", {"beta1": 0.5, "beta2": 0.9, "epsilon": 1e-4}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'default'}" for n, p in CASES]
LR = 0.05


# -- reference implementations: one step of the textbook rule, float64, nothing shared with the module --


def ref_state(name: str, params: dict[str, float], var: np.ndarray) -> dict[str, Any]:
    if name == "momentum":
        return {"accum": np.zeros_like(var)}
    if name == "adagrad":
        return {"accum": np.full_like(var, params.get("initial_accumulator", 0.1))}
    if name == "adam":
        return {"m": np.zeros_like(var), "v": np.zeros_like(var), "t": 0}
    return {}


def ref_step(
    name: str, params: dict[str, float], var: np.ndarray, g: np.ndarray, st: dict[str, Any]
) -> tuple[np.ndarray, dict[str, Any]]:
    lr = LR
    if name == "sgd":
        return var - lr * g, {}
    if name == "momentum":
        mu = params.get("momentum", 0.9)
        accum = mu * st["accum"] + g
        if params.get("nesterov", 0):
            return var - lr * (g + mu * accum), {"accum": accum}
        return var - lr * accum, {"accum": accum}
    if name == "adagrad":
        eps = params.get("epsilon", 1e-7)
        accum = st["accum"] + g**2
        return var - lr * g / (np.sqrt(accum) + eps), {"accum": accum}
    assert name == "adam"
    b1, b2, eps = params.get("beta1", 0.9), params.get("beta2", 0.999), params.get("epsilon", 1e-7)
    t = st["t"] + 1
    m = b1 * st["m"] + (1 - b1) * g
    v = b2 * st["v"] + (1 - b2) * g**2
    lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    return var - lr_t * m / (np.sqrt(v) + eps), {"m": m, "v": v, "t": t}


def assert_state_close(slots: dict[str, np.ndarray], st: dict[str, Any], rtol: float = 1e-12) -> None:
    assert set(slots) == set(st)
    for key, want in st.items():
        if key == "t":
            assert int(slots[key]) == want
        else:
            np.testing.assert_allclose(slots[key], want, rtol=rtol, atol=1e-15)


def copies(var: np.ndarray, slots: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    return var.copy(), {k: v.copy() for k, v in slots.items()}


def assert_bitwise_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


# -- dense --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_dense_matches_reference_over_several_steps(name: str, params: dict[str, float]) -> None:
    rng = np.random.default_rng(1)
    opt = make_optimizer(name, LR, params)
    var = rng.normal(size=(6, 4))
    slots = opt.create_slots(var)
    ref_var, st = var.copy(), ref_state(name, params, var)
    assert_state_close(slots, st, rtol=0)
    for _ in range(5):
        g = rng.normal(size=var.shape)
        opt.apply_dense(var, g, slots)
        ref_var, st = ref_step(name, params, ref_var, g, st)
        np.testing.assert_allclose(var, ref_var, rtol=1e-12, atol=1e-15)
        assert_state_close(slots, st)


def test_adam_bias_correction_t1_to_t5() -> None:
    """With a constant gradient, m/(1-b1^t) = g and v/(1-b2^t) = g² exactly: each step moves by ~lr."""
    opt = make_optimizer("adam", 0.01, {"epsilon": 1e-12})
    g = np.array([0.3, -2.0, 1e-3])
    var = np.zeros(3)
    slots = opt.create_slots(var)
    for t in range(1, 6):
        before = var.copy()
        opt.apply_dense(var, g, slots)
        assert int(slots["t"]) == t
        np.testing.assert_allclose(slots["m"], (1 - 0.9**t) * g, rtol=1e-12)
        np.testing.assert_allclose(slots["v"], (1 - 0.999**t) * g**2, rtol=1e-12)
        # Bias-corrected step is lr * m_hat / sqrt(v_hat) = lr * sign(g) (epsilon negligible here).
        np.testing.assert_allclose(before - var, 0.01 * np.sign(g), rtol=1e-7)


def test_hand_computed_single_steps() -> None:
    def one(name: str, params: dict[str, float], g: float) -> float:
        var = np.array([1.0])
        opt = make_optimizer(name, 0.1, params)
        opt.apply_dense(var, np.array([g]), opt.create_slots(var))
        return float(var[0])

    assert one("sgd", {}, 0.5) == pytest.approx(0.95, rel=1e-15)
    assert one("momentum", {}, 0.5) == pytest.approx(0.95, rel=1e-15)
    assert one("momentum", {"nesterov": 1}, 0.5) == pytest.approx(1 - 0.1 * (0.5 + 0.9 * 0.5), rel=1e-15)
    assert one("adagrad", {}, 0.5) == pytest.approx(1 - 0.1 * 0.5 / (math.sqrt(0.35) + 1e-7), rel=1e-15)
    # Adam's first step: lr * sqrt(1-b2)/(1-b1) * (1-b1)g / (sqrt(1-b2)|g| + eps).
    want = 1 - 0.1 * math.sqrt(0.001) / 0.1 * 0.05 / (math.sqrt(0.001) * 0.5 + 1e-7)
    assert one("adam", {}, 0.5) == pytest.approx(want, rel=1e-14)


def test_momentum_second_step_uses_accumulator() -> None:
    opt = make_optimizer("momentum", 0.1, {"momentum": 0.5})
    var = np.array([0.0])
    slots = opt.create_slots(var)
    opt.apply_dense(var, np.array([1.0]), slots)  # accum 1, var -0.1
    opt.apply_dense(var, np.array([1.0]), slots)  # accum 1.5, var -0.25
    assert slots["accum"][0] == pytest.approx(1.5)
    assert var[0] == pytest.approx(-0.25)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_apply_is_in_place(name: str) -> None:
    opt = make_optimizer(name, LR)
    var = np.ones((3, 2))
    view = var[1]
    slots = opt.create_slots(var)
    slot_ids = {k: id(v) for k, v in slots.items()}
    opt.apply_dense(var, np.full((3, 2), 0.5), slots)
    assert view[0] != 1.0
    assert {k: id(v) for k, v in slots.items()} == slot_ids


# -- sparse -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_sparse_is_the_dense_rule_on_those_rows_only(name: str, params: dict[str, float]) -> None:
    rng = np.random.default_rng(2)
    opt = make_optimizer(name, LR, params)
    var = rng.normal(size=(10, 3))
    slots = opt.create_slots(var)
    ref_var, st = var.copy(), ref_state(name, params, var)
    for step, rows in enumerate([[7, 2, 4], [2, 9], [0, 7, 4, 5], [9]]):
        rows_a = np.array(rows, dtype=np.int64)
        g = rng.normal(size=(len(rows), 3))
        before_var, before_slots = copies(var, slots)
        opt.apply_sparse(var, rows_a, g, slots)

        # Reference: the dense rule on the touched rows; Adam's t counts calls on this variable.
        sub = {k: (v if k == "t" else v[rows_a]) for k, v in st.items()}
        new_rows, new_sub = ref_step(name, params, ref_var[rows_a], g, sub)
        ref_var[rows_a] = new_rows
        for k, v in new_sub.items():
            if k == "t":
                st[k] = v
            else:
                st[k][rows_a] = v
        np.testing.assert_allclose(var, ref_var, rtol=1e-12, atol=1e-15)
        assert_state_close(slots, st)
        if name == "adam":
            assert int(slots["t"]) == step + 1

        untouched = np.setdiff1d(np.arange(10), rows_a)
        assert_bitwise_equal(var[untouched], before_var[untouched])
        for k in opt.slot_names:
            if k not in opt.scalar_slot_names:
                assert_bitwise_equal(slots[k][untouched], before_slots[k][untouched])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_updates_stay_in_the_variables_dtype_and_follow_the_rule(
    name: str, params: dict[str, float], dtype: Any
) -> None:
    """The arithmetic runs in the variable's dtype (a float32 shard costs float32 bandwidth), on read-only
    gradients (decoded ones are views of the message), and still follows the textbook rule."""
    rng = np.random.default_rng(7)
    opt = make_optimizer(name, LR, params)
    var = rng.normal(size=(5, 7)).astype(dtype)
    slots = opt.create_slots(var)
    ref_var, st = var.astype(np.float64), ref_state(name, params, var.astype(np.float64))
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for _ in range(4):
        g = rng.normal(size=var.shape).astype(dtype)
        g.flags.writeable = False
        opt.apply_dense(var, g, slots)
        ref_var, st = ref_step(name, params, ref_var, g.astype(np.float64), st)
        assert var.dtype == dtype and all(v.dtype == (np.int64 if k == "t" else dtype) for k, v in slots.items())
        np.testing.assert_allclose(var, ref_var, rtol=rtol, atol=1e-6 if dtype == np.float32 else 1e-15)
        assert_state_close(slots, st, rtol=rtol)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_sparse_equals_dense_on_the_gathered_rows_bitwise(name: str, params: dict[str, float]) -> None:
    """Same arithmetic either way: a sparse update is exactly the dense update of the gathered rows."""
    rng = np.random.default_rng(3)
    opt = make_optimizer(name, LR, params)
    var = rng.normal(size=(8, 2, 3)).astype(np.float32)
    slots = opt.create_slots(var)
    opt.apply_dense(var, rng.normal(size=var.shape), slots)  # non-trivial slots first
    rows = np.array([1, 6, 3])
    g = rng.normal(size=(3, 2, 3)).astype(np.float32)

    sub_var = var[rows]
    sub_slots = {k: (v.copy() if k in opt.scalar_slot_names else v[rows]) for k, v in slots.items()}
    opt.apply_dense(sub_var, g, sub_slots)
    opt.apply_sparse(var, rows, g, slots)
    assert_bitwise_equal(var[rows], sub_var)
    for k in opt.slot_names:
        got = slots[k] if k in opt.scalar_slot_names else slots[k][rows]
        assert_bitwise_equal(got, sub_slots[k])


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_duplicate_rows_are_summed_and_updated_once(name: str, params: dict[str, float]) -> None:
    rng = np.random.default_rng(4)
    opt = make_optimizer(name, LR, params)
    var = rng.normal(size=(6, 2))
    slots = opt.create_slots(var)
    var2, slots2 = copies(var, slots)
    ref_var, st = var.copy(), ref_state(name, params, var)

    rows = np.array([4, 1, 4, 4, 0])
    g = rng.normal(size=(5, 2))
    opt.apply_sparse(var, rows, g, slots)
    distinct = np.array([0, 1, 4])
    summed = np.stack([g[4], g[1], g[0] + g[2] + g[3]])
    opt.apply_sparse(var2, distinct, summed, slots2)

    # Same as pushing the already-summed gradient once...
    for a, b in [(var, var2), *((slots[k], slots2[k]) for k in opt.slot_names)]:
        assert_bitwise_equal(a, b)
    # ...and as the textbook rule applied once to each distinct row (t advanced once, not per duplicate).
    sub = {k: (v if k == "t" else v[distinct]) for k, v in st.items()}
    ref_rows, ref_sub = ref_step(name, params, ref_var[distinct], summed, sub)
    np.testing.assert_allclose(var[distinct], ref_rows, rtol=1e-12, atol=1e-15)
    assert_state_close({k: (v if k == "t" else v[distinct]) for k, v in slots.items()}, ref_sub)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_empty_rows(name: str) -> None:
    opt = make_optimizer(name, LR)
    var = np.arange(6.0).reshape(3, 2)
    slots = opt.create_slots(var)
    before_var, before_slots = copies(var, slots)
    opt.apply_sparse(var, np.array([], dtype=np.int64), np.zeros((0, 2)), slots)
    assert_bitwise_equal(var, before_var)
    for k in opt.slot_names:
        if k == "t":
            assert int(slots[k]) == 1  # one apply_sparse call, one count
        else:
            assert_bitwise_equal(slots[k], before_slots[k])


def test_sparse_on_a_vector() -> None:
    opt = make_optimizer("sgd", 0.5)
    var = np.zeros(4)
    opt.apply_sparse(var, np.array([3, 0, 3]), np.array([1.0, 2.0, 4.0]), opt.create_slots(var))
    np.testing.assert_array_equal(var, [-1.0, 0.0, 0.0, -2.5])


# -- slots, dtypes, config ----------------------------------------------------------------------------


def test_create_slots() -> None:
    var = np.ones((3, 2), dtype=np.float32)
    assert make_optimizer("sgd", LR).create_slots(var) == {}
    mom = make_optimizer("momentum", LR).create_slots(var)
    assert set(mom) == {"accum"}
    assert mom["accum"].dtype == np.float32 and mom["accum"].shape == (3, 2) and not mom["accum"].any()
    ada = make_optimizer("adagrad", LR, {"initial_accumulator": 0.25}).create_slots(var)
    np.testing.assert_array_equal(ada["accum"], np.full((3, 2), 0.25, dtype=np.float32))
    adam_opt = make_optimizer("adam", LR)
    adam = adam_opt.create_slots(var)
    assert set(adam) == set(adam_opt.slot_names) == {"m", "v", "t"}
    assert adam["t"].shape == () and adam["t"].dtype == np.int64 and int(adam["t"]) == 0
    for k in ("m", "v"):
        assert adam[k].dtype == np.float32 and adam[k].shape == (3, 2) and not adam[k].any()
        assert not np.shares_memory(adam[k], var)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_float32_preserved_and_close_to_float64(name: str, params: dict[str, float]) -> None:
    rng = np.random.default_rng(5)
    opt = make_optimizer(name, LR, params)
    var64 = rng.normal(size=(5, 3))
    var32 = var64.astype(np.float32)
    s64, s32 = opt.create_slots(var64), opt.create_slots(var32)
    for _ in range(3):
        g = rng.normal(size=(5, 3))  # float64 gradient pushed to a float32 shard
        opt.apply_dense(var64, g, s64)
        opt.apply_dense(var32, g, s32)
        rows = np.array([3, 0])
        gr = rng.normal(size=(2, 3)).astype(np.float32)
        opt.apply_sparse(var64, rows, gr, s64)
        opt.apply_sparse(var32, rows, gr, s32)
    assert var32.dtype == np.float32
    for k, v in s32.items():
        assert v.dtype == (np.int64 if k == "t" else np.float32)
    np.testing.assert_allclose(var32, var64, rtol=1e-4, atol=1e-5)


def test_config_and_repr() -> None:
    assert make_optimizer("sgd", 0.1).config() == {"learning_rate": 0.1}
    assert make_optimizer("momentum", 0.1, {"nesterov": 1}).config() == {
        "learning_rate": 0.1,
        "momentum": 0.9,
        "nesterov": 1.0,
    }
    assert make_optimizer("adagrad", 0.1).config() == {
        "learning_rate": 0.1,
        "initial_accumulator": 0.1,
        "epsilon": 1e-7,
    }
    cfg = make_optimizer("adam", 0.002, {"beta2": 0.98}).config()
    assert cfg == {"learning_rate": 0.002, "beta1": 0.9, "beta2": 0.98, "epsilon": 1e-7}
    assert "beta2=0.98" in repr(make_optimizer("adam", 0.002, {"beta2": 0.98}))
    assert isinstance(Adam(0.1), Optimizer)
    assert [make_optimizer(n, 0.1).name for n in OPTIMIZERS] == list(OPTIMIZERS)


# -- hyperparameter errors ----------------------------------------------------------------------------


def test_unknown_optimizer() -> None:
    with pytest.raises(ValueError) as err:
        make_optimizer("x", 0.1)
    assert str(err.value) == "unknown optimizer 'x'; valid: sgd, momentum, adagrad, adam"


@pytest.mark.parametrize(
    ("name", "param", "valid"),
    [
        ("sgd", "momentum", "(none)"),
        ("momentum", "beta1", "momentum, nesterov"),
        ("adagrad", "initial_accumulator_value", "initial_accumulator, epsilon"),
        ("adam", "eps", "beta1, beta2, epsilon"),
    ],
)
def test_unknown_param(name: str, param: str, valid: str) -> None:
    with pytest.raises(ValueError, match=f"unknown parameter '{param}'") as err:
        make_optimizer(name, 0.1, {param: 1.0})
    assert f"valid: {valid}" in str(err.value)


@pytest.mark.parametrize(
    ("name", "lr", "params", "match"),
    [
        ("sgd", 0.0, {}, r"learning_rate must be a finite number > 0"),
        ("sgd", -0.1, {}, r"learning_rate must be a finite number > 0"),
        ("adam", float("nan"), {}, r"learning_rate must be a finite number > 0"),
        ("momentum", float("inf"), {}, r"learning_rate must be a finite number > 0"),
        ("adam", 0.1, {"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ("adam", 0.1, {"beta1": -0.1}, r"beta1 must be in \[0, 1\)"),
        ("adam", 0.1, {"beta2": 1.5}, r"beta2 must be in \[0, 1\)"),
        ("adam", 0.1, {"beta2": float("nan")}, r"beta2 must be in \[0, 1\)"),
        ("adam", 0.1, {"epsilon": 0.0}, r"epsilon must be a finite number > 0"),
        ("adagrad", 0.1, {"epsilon": -1e-7}, r"epsilon must be a finite number > 0"),
        ("adagrad", 0.1, {"initial_accumulator": -0.1}, r"initial_accumulator must be a finite number >= 0"),
        ("momentum", 0.1, {"momentum": -0.5}, r"momentum must be a finite number >= 0"),
        ("momentum", 0.1, {"nesterov": 0.5}, r"nesterov must be 0 or 1"),
    ],
)
def test_bad_hyperparameters(name: str, lr: float, params: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_optimizer(name, lr, params)


def test_the_learning_rate_is_not_a_parameter_a_request_can_also_name() -> None:
    # a PS builds optimizers from what came over the wire: a clash is a ValueError (refused), not a TypeError
    with pytest.raises(ValueError, match="unknown parameter 'learning_rate' for optimizer 'sgd'"):
        make_optimizer("sgd", 0.1, {"learning_rate": 0.2})


def test_zero_beta_and_momentum_allowed() -> None:
    make_optimizer("adam", 0.1, {"beta1": 0.0, "beta2": 0.0})
    make_optimizer("momentum", 0.1, {"momentum": 0.0})
    make_optimizer("adagrad", 0.1, {"initial_accumulator": 0.0})


# -- bad updates leave everything unchanged -----------------------------------------------------------


def _bad_updates() -> list[tuple[str, Any]]:
    return [
        ("dense wrong shape", lambda o, v, s: o.apply_dense(v, np.zeros((4, 2)), s)),
        ("dense transposed", lambda o, v, s: o.apply_dense(v, np.zeros((3, 5)), s)),
        ("dense string grad", lambda o, v, s: o.apply_dense(v, np.full((5, 3), "a"), s)),
        ("sparse wrong width", lambda o, v, s: o.apply_sparse(v, np.array([0, 1]), np.zeros((2, 4)), s)),
        ("sparse wrong count", lambda o, v, s: o.apply_sparse(v, np.array([0, 1]), np.zeros((3, 3)), s)),
        ("sparse row too big", lambda o, v, s: o.apply_sparse(v, np.array([0, 5]), np.ones((2, 3)), s)),
        ("sparse negative row", lambda o, v, s: o.apply_sparse(v, np.array([-1, 2]), np.ones((2, 3)), s)),
        ("sparse 2-D rows", lambda o, v, s: o.apply_sparse(v, np.array([[0, 1]]), np.ones((2, 3)), s)),
        ("sparse float rows", lambda o, v, s: o.apply_sparse(v, np.array([0.0, 1.0]), np.ones((2, 3)), s)),
    ]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(("what", "update"), _bad_updates(), ids=[w for w, _ in _bad_updates()])
def test_bad_update_changes_nothing(name: str, what: str, update: Any) -> None:
    rng = np.random.default_rng(6)
    opt = make_optimizer(name, LR)
    var = rng.normal(size=(5, 3))
    slots = opt.create_slots(var)
    opt.apply_dense(var, rng.normal(size=(5, 3)), slots)
    before_var, before_slots = copies(var, slots)
    with pytest.raises(ValueError):
        update(opt, var, slots)
    assert np.array_equal(var, before_var)
    assert set(slots) == set(before_slots)
    for k in slots:
        assert np.array_equal(slots[k], before_slots[k])


@pytest.mark.parametrize("name", ["momentum", "adagrad", "adam"])
def test_bad_slots_rejected_before_mutation(name: str) -> None:
    opt = make_optimizer(name, LR)
    var = np.ones((4, 2))
    before = var.copy()
    good = opt.create_slots(var)
    missing = {k: v for k, v in good.items() if k != opt.slot_names[0]}
    wrong_shape = {**good, opt.slot_names[0]: np.zeros((4, 3))}
    wrong_dtype = {**good, opt.slot_names[0]: np.zeros((4, 2), dtype=np.float32)}
    for slots in (missing, wrong_shape, wrong_dtype):
        with pytest.raises(ValueError, match="slot"):
            opt.apply_dense(var, np.ones((4, 2)), slots)
        with pytest.raises(ValueError, match="slot"):
            opt.apply_sparse(var, np.array([1]), np.ones((1, 2)), slots)
    assert np.array_equal(var, before)
    if name == "adam":
        assert int(good["t"]) == 0


def test_non_float_or_read_only_variable_rejected() -> None:
    opt = make_optimizer("sgd", LR)
    with pytest.raises(ValueError, match="floating-point"):
        opt.apply_dense(np.ones(3, dtype=np.int64), np.ones(3), {})
    with pytest.raises(ValueError, match="floating-point"):
        opt.create_slots(np.ones(3, dtype=np.int32))
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        opt.apply_dense(ro, np.ones(3), {})
    with pytest.raises(ValueError, match="at least one dimension"):
        opt.apply_sparse(np.array(1.0), np.array([0]), np.ones(1), {})

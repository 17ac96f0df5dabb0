"""Optimizers that run on the parameter server, beside the variable shards they update.

The PS holds each shard and its optimizer slots and applies pushed gradients in place, so the update
rules here are the whole optimizer: they follow the TensorFlow/Keras conventions (``ApplyMomentum``,
``ApplyAdagrad``, ``ApplyAdam``) so that a model trained under psctl behaves like the same model trained with
TF's parameter-server strategy. Their sparse forms are the lazy ones (TF's ``SparseApplyMomentum`` and
``SparseApplyAdagrad``; for Adam, Addons' ``LazyAdam``: TF's own Adam decays every row's moments each step).

Every argument is checked before anything is written: a bad push raises ``ValueError`` and leaves the
variable and its slots exactly as they were, so one malformed request cannot corrupt a shard. Each rule is
written once, in place (``_apply_in_place``: no temporaries as large as the variable beyond one scratch array;
nothing in it can fail half-way): a dense update runs it on the variable itself, a sparse one on the gathered
rows, scattered back. Arithmetic is done in the variable's dtype
(hyperparameters are cast to it), so a float32 shard stays float32 and costs float32 bandwidth.

Scalar state (Adam's step count ``t``) lives in the slots dict as a 0-d array, so that checkpointing the slots
captures the optimizer's whole state. It is the optimizer's, not the variable's: the PS sets it to its own step
count before each update (``VariableStore.optimizer_steps``), as TF counts ``iterations`` once for all variables.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from psctl.runtime.optimizer_params import OPTIMIZERS, optimizer_config, params_of
from psctl.runtime.rows import gather_rows, scatter_rows, unique_ids

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "Momentum",
    "Optimizer",
    "make_optimizer",
]

Slots = dict[str, np.ndarray]


class Optimizer(ABC):
    """An update rule plus the per-variable state (slots) it needs.

    ``slot_names`` lists every key ``create_slots`` returns; those also in ``scalar_slot_names`` are
    0-d per-variable state, the others have the variable's shape and dtype and are updated row by row
    by ``apply_sparse``.
    """

    name: ClassVar[str]
    slot_names: ClassVar[tuple[str, ...]] = ()
    scalar_slot_names: ClassVar[tuple[str, ...]] = ()
    learning_rate: float

    def __init__(self, learning_rate: float, params: Mapping[str, float] | None = None) -> None:
        """``params``: the optimizer's hyperparameters besides the learning rate (psctl.runtime.optimizer_params
        names them, their defaults and ranges); each becomes an attribute of the same name. A ValueError says
        which one is wrong."""
        self._config = optimizer_config(self.name, learning_rate, params)
        for key, value in self._config.items():
            setattr(self, key, value)

    # -- public API ---------------------------------------------------------------------------------

    def create_slots(self, var: np.ndarray) -> Slots:
        """Fresh slots for ``var``: row slots zero-filled (or the rule's initial value), scalars 0."""
        _check_float_var(var)
        slots: Slots = {}
        for key in self.slot_names:
            if key in self.scalar_slot_names:
                slots[key] = np.zeros((), dtype=np.int64)
            else:  # (zeros from np.zeros: pages the OS gives as they are first written, not all at once)
                initial = self._slot_initial_value(key)
                slots[key] = np.zeros(var.shape, var.dtype) if initial == 0 else np.full(var.shape, initial, var.dtype)
        return slots

    def apply_dense(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        """Apply the whole-variable gradient ``grad`` to ``var`` and ``slots`` in place."""
        grad = np.asarray(grad)
        self._check_var_and_slots(var, slots)
        _check_grad_dtype(grad)
        if grad.shape != var.shape:
            raise ValueError(f"gradient shape {grad.shape} does not match variable shape {var.shape}")
        self._apply_in_place(var, grad.astype(var.dtype, copy=False), slots)

    def apply_sparse(self, var: np.ndarray, rows: np.ndarray, grad_rows: np.ndarray, slots: Slots) -> None:
        """Apply a row-sparse gradient: only ``var[rows]`` and the slots' same rows change.

        This is the "lazy" sparse form: rows absent from the batch keep their slots untouched (their
        momentum does not decay), while scalar state such as Adam's ``t`` advances once per call.
        Duplicate entries in ``rows`` are summed first, so each row is updated exactly once.
        """
        rows = np.asarray(rows)
        grad_rows = np.asarray(grad_rows)
        self._check_var_and_slots(var, slots)
        if var.ndim == 0:
            raise ValueError("apply_sparse needs a variable with at least one dimension (rows)")
        _check_grad_dtype(grad_rows)
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise ValueError(f"rows must be a 1-D integer array, got dtype {rows.dtype} shape {rows.shape}")
        expected = (rows.shape[0], *var.shape[1:])
        if grad_rows.shape != expected:
            raise ValueError(
                f"gradient rows shape {grad_rows.shape} does not match {expected} "
                f"({rows.shape[0]} rows of a variable of shape {var.shape})"
            )
        num_rows = var.shape[0]
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            bad = rows[(rows < 0) | (rows >= num_rows)]
            raise ValueError(f"row index {int(bad[0])} out of range for a variable with {num_rows} rows")

        grad_rows = grad_rows.astype(var.dtype, copy=False)
        if bool(np.all(rows[1:] > rows[:-1])):  # sorted and unique already (what workers send)
            unique, summed = rows, grad_rows  # (the rules only read the gradient: it may be a read-only buffer)
        else:
            unique, inverse = unique_ids(rows, return_inverse=True)
            summed = np.zeros((unique.shape[0], *var.shape[1:]), dtype=var.dtype)
            np.add.at(summed, inverse, grad_rows)

        # the rule on gathered copies of the rows (scalar slots as they are), then the rows scattered back
        rows_var = gather_rows(var, unique)
        row_slots = {key: slots[key] if key in self.scalar_slot_names else gather_rows(slots[key], unique)
                     for key in self.slot_names}  # fmt: skip
        self._apply_in_place(rows_var, summed, row_slots)
        scatter_rows(var, unique, rows_var)
        for key in self.slot_names:
            if key not in self.scalar_slot_names:
                scatter_rows(slots[key], unique, row_slots[key])

    def config(self) -> dict[str, float]:
        """The hyperparameters in effect (defaults included), for logs."""
        return dict(self._config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    # -- for subclasses -----------------------------------------------------------------------------

    @abstractmethod
    def _apply_in_place(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        """The rule: update ``var`` and every slot in place, given a gradient of ``var``'s shape and dtype.

        ``var``, ``grad`` and the row slots are the whole variable (dense), a block of it, or gathered copies
        of its rows (sparse); scalar slots are the variable's own. ``grad`` may be read-only.
        """

    def _slot_initial_value(self, key: str) -> float:
        return 0.0

    # -- checks -------------------------------------------------------------------------------------

    def _check_var_and_slots(self, var: np.ndarray, slots: Mapping[str, np.ndarray]) -> None:
        _check_float_var(var)
        if not var.flags.writeable:
            raise ValueError("variable is read-only; optimizers update it in place")
        missing = [k for k in self.slot_names if k not in slots]
        if missing:
            raise ValueError(
                f"{self.name} slots missing {', '.join(missing)} (create them with create_slots)"
            )
        for key in self.slot_names:
            slot = slots[key]
            if not isinstance(slot, np.ndarray):
                raise ValueError(f"slot {key!r} must be a numpy array, got {type(slot).__name__}")
            if key in self.scalar_slot_names:
                want_shape, want_dtype = (), np.dtype(np.int64)
            else:
                want_shape, want_dtype = var.shape, var.dtype
            if slot.shape != want_shape or slot.dtype != want_dtype:
                raise ValueError(
                    f"slot {key!r} has shape {slot.shape} dtype {slot.dtype}, expected shape {want_shape} "
                    f"dtype {want_dtype}"
                )
            if not slot.flags.writeable:
                raise ValueError(f"slot {key!r} is read-only; optimizers update it in place")


class SGD(Optimizer):
    """Plain gradient descent: ``var -= lr * g``."""

    name = "sgd"

    def _apply_in_place(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        step = np.multiply(var.dtype.type(self.learning_rate), grad)
        np.subtract(var, step, out=var)


class Momentum(Optimizer):
    """Heavy-ball momentum as TF's ApplyMomentum: the accumulator is not scaled by (1 - momentum)."""

    name = "momentum"
    slot_names = ("accum",)
    momentum: float
    nesterov: float  # 1.0: Nesterov's form

    def _apply_in_place(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        c = var.dtype.type
        lr, mu = c(self.learning_rate), c(self.momentum)
        accum = slots["accum"]
        np.multiply(mu, accum, out=accum)
        np.add(accum, grad, out=accum)
        if self.nesterov:
            step = np.multiply(mu, accum)
            np.add(grad, step, out=step)
            np.multiply(lr, step, out=step)
        else:
            step = np.multiply(lr, accum)
        np.subtract(var, step, out=var)


class Adagrad(Optimizer):
    """Adagrad as Keras: ``accum += g²; var -= lr * g / (sqrt(accum) + epsilon)``."""

    name = "adagrad"
    slot_names = ("accum",)
    initial_accumulator: float
    epsilon: float

    def _slot_initial_value(self, key: str) -> float:
        return self.initial_accumulator

    def _apply_in_place(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        c = var.dtype.type
        accum = slots["accum"]
        scratch = np.multiply(grad, grad)
        np.add(accum, scratch, out=accum)
        np.sqrt(accum, out=scratch)
        np.add(scratch, c(self.epsilon), out=scratch)
        step = np.multiply(c(self.learning_rate), grad)
        np.divide(step, scratch, out=step)
        np.subtract(var, step, out=var)


class Adam(Optimizer):
    """Adam as TF's ApplyAdam: bias correction folded into the step size, epsilon added after sqrt."""

    name = "adam"
    slot_names = ("m", "v", "t")
    scalar_slot_names = ("t",)
    beta1: float
    beta2: float
    epsilon: float

    def _apply_in_place(self, var: np.ndarray, grad: np.ndarray, slots: Slots) -> None:
        c = var.dtype.type
        b1, b2 = self.beta1, self.beta2
        t = int(slots["t"]) + 1
        # Bias correction in float64 (b ** t underflows gracefully to 0), then cast to the var's dtype.
        lr_t = self.learning_rate * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        m, v = slots["m"], slots["v"]
        scratch = np.multiply(c(1.0 - b1), grad)
        np.multiply(c(b1), m, out=m)
        np.add(m, scratch, out=m)
        np.multiply(grad, grad, out=scratch)
        np.multiply(c(1.0 - b2), scratch, out=scratch)
        np.multiply(c(b2), v, out=v)
        np.add(v, scratch, out=v)
        np.sqrt(v, out=scratch)
        np.add(scratch, c(self.epsilon), out=scratch)
        step = np.multiply(c(lr_t), m)
        np.divide(step, scratch, out=step)
        np.subtract(var, step, out=var)
        slots["t"][...] = t


_CLASSES: dict[str, type[Optimizer]] = {cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam)}


def make_optimizer(name: str, learning_rate: float, params: Mapping[str, float] | None = None) -> Optimizer:
    """Build an optimizer from its wire form (name, learning rate, string→float params)."""
    params_of(name)  # an unknown name: a ValueError naming the valid ones
    return _CLASSES[name](learning_rate, params)


def _check_float_var(var: object) -> None:
    if not isinstance(var, np.ndarray) or var.dtype.kind != "f":
        desc = f"dtype {var.dtype}" if isinstance(var, np.ndarray) else type(var).__name__
        raise ValueError(f"variable must be a floating-point numpy array, got {desc}")


def _check_grad_dtype(grad: np.ndarray) -> None:
    if grad.dtype.kind not in "fiu":
        raise ValueError(f"gradient must be a real numeric array, got dtype {grad.dtype}")

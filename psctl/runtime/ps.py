"""The parameter server: variable shards, their optimizer slots, and at-most-once updates.

Every request is validated in full before anything changes, so a bad one (wrong name, dtype, shape, ids out
of range, non-finite gradient, fenced incarnation) is refused and leaves the PS exactly as it was.

Reads are not locked against concurrent updates (asynchronous training tolerates a read that sees part of
an update, as TensorFlow's does); updates to one shard are serialised by that shard's lock.

Arrays move in frames (see psctl.runtime.wire) over the ``*Framed`` rpcs; :func:`add_to_server` registers those
without protobuf (de)serializers, so the servicer reads and writes their bytes itself, in place.
"""

from __future__ import annotations

import collections
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import numpy as np

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import limits, wire
from psctl.runtime.accumulator import StepAccumulator
from psctl.runtime.fencing import ChiefFence, ChiefReplaced
from psctl.runtime.initializers import initialize
from psctl.runtime.optimizers import Optimizer, make_optimizer
from psctl.runtime.rows import gather_rows
from psctl.runtime.rpc import CHIEF_MEMBER, UNARY_THREADS, caller, member_of_task, refuse_unless_from
from psctl.runtime.sessions import SESSIONS_PER_PS, SessionSlots
from psctl.runtime.wire import (
    DENSE,
    IDS,
    LEFT_FACTOR,
    PULL_IDS,
    RIGHT_FACTOR,
    ROWS,
    SLOT,
    Entry,
    SplitArray,
    WireError,
)

#: Step ids this far below the newest one seen count as applied; older retries are refused as duplicates.
#: Bounds the memory of the at-most-once check; retries are never anywhere near this old.
DEDUPE_WINDOW = 1_000_000
#: Dense updates of larger shards run in blocks of this many elements, so that the optimizer's temporaries
#: stay in cache instead of streaming the whole shard through memory several times (measured on a 64 MiB shard:
#: SGD 6 ms instead of 21, Adam 26 instead of 90; smaller blocks pay more per-call overhead). The rules are
#: elementwise, so the result is bit for bit that of one whole update.
UPDATE_BLOCK = 1 << 18


def _thread_budget() -> int:
    """The cores this role may use: its launcher's thread count (OMP_NUM_THREADS, from the cores of its host
    divided among the roles there), else the machine's: roles that share a machine's cores gain nothing from
    more threads, only hand-offs."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


#: Dense updates and finite checks of shards of at least PARALLEL_MIN elements are split over this many threads.
UPDATE_THREADS = min(4, _thread_budget())
PARALLEL_MIN = 1 << 20
T = TypeVar("T")
X = TypeVar("X")
#: A dense gradient as it arrived: whole, or (streamed) in the pieces of its frames.
Gradient = np.ndarray | SplitArray
#: One validated update: the shard, the local rows of a sparse update (None: dense), the gradient.
Update = tuple["Shard", np.ndarray | None, Gradient]


class FencedError(Exception):
    """A push from an incarnation older than one already seen from the same task."""


class NotInitializedError(Exception):
    pass


@dataclass
class Shard:
    spec: pb.VariableSpec
    value: np.ndarray
    slots: dict[str, np.ndarray]
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def rows(self) -> int:
        return self.value.shape[0] if self.value.ndim else 0


@dataclass(frozen=True)
class PushOutcome:
    applied: bool
    global_step: int
    stale: bool = False


def _spec_key(spec: pb.VariableSpec) -> tuple[object, ...]:
    return (spec.name, spec.dtype, tuple(spec.shape))


class VariableStore:
    """The state of one PS. Thread-safe; every public method validates before it mutates."""

    def __init__(self, *, cluster_id: str = "psctl", chief_fence: ChiefFence | None = None) -> None:
        self.cluster_id = cluster_id
        #: The newest chief heard of: its requests, and the pushes of its steps, are admitted under the lock
        #: that also orders Init and GetState, so that once a new chief has read where each worker's input
        #: stands, nothing of the replaced one lands (see fencing).
        self.chief_fence = chief_fence or ChiefFence()
        self._shards: dict[str, Shard] = {}
        self._optimizer: Optimizer | None = None
        self._lock = threading.Lock()  # guards step ids, counters, incarnations, init
        self._applied: set[int] = set()
        self._applied_log: collections.deque[int] = collections.deque(maxlen=DEDUPE_WINDOW)
        self._newest_step = 0
        self._incarnations: dict[str, int] = {}
        self.global_step = 0
        #: The model the shards belong to: the id of the Init that created them or of the Assign that last
        #: replaced them (see InitResponse.model_id).
        self.model_id = 0
        #: The optimizer's step count (TF's ``iterations``): the updates applied here, one per step whichever
        #: variables and shards it touched. Every push reaches every PS, so each counts every step. It is the
        #: count each update runs at (Adam's ``t``, kept in every shard's scalar slots for checkpoints): per
        #: shard, the shards of a table that a batch missed fell behind, and a cut table trained otherwise.
        self.optimizer_steps = 0
        self.shard_positions: dict[int, int] = {}
        self.applied_updates = 0
        self.duplicate_updates = 0
        self.fenced_updates = 0
        #: Preempted (SIGTERM): serving on until a snapshot was pulled (see leave()).
        self.leaving = threading.Event()
        self.released = threading.Event()
        #: The chief finished training: once stopped, go at once (no chief will checkpoint it any more).
        self.training_over = threading.Event()
        self._handing_over = threading.Event()  # the chief saw it leave: no push comes while it checkpoints
        self.last_push = float("-inf")
        #: Synchronous mode (None: asynchronous, every push applied as it comes).
        self._sync: StepAccumulator | None = None
        self.sync_gradients_applied = 0
        self.stale_dropped = 0
        self.timed_out_steps = 0

    # -- set-up ---------------------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self._optimizer is not None

    def init(
        self,
        specs: Sequence[pb.VariableSpec],
        optimizer: pb.OptimizerConfig,
        *,
        reset: bool = False,
        replicas_to_aggregate: int = 0,
        distinct_replicas: bool = False,
        chief_incarnation: int = 0,
        model_id: int = 0,
    ) -> bool:
        """Create the shards, of model ``model_id``; True if exactly these already existed (a restarted chief):
        then they, and their model id, stay as they were.

        ``reset`` re-creates them from their initializers and zeroes the global step (recovery without a
        checkpoint); step ids already applied stay remembered.
        """
        with self._lock:
            self.chief_fence.admit(chief_incarnation)
            if self._optimizer is not None and not reset:
                if sorted(map(_spec_key, specs)) != sorted(map(_spec_key, (s.spec for s in self._shards.values()))):
                    raise ValueError("this PS already holds different variables; restart it to re-create them")
                return True
            opt = make_optimizer(optimizer.name, optimizer.learning_rate, dict(optimizer.params))
            for spec in specs:
                if spec.dtype not in ("float16", "float32", "float64"):
                    raise ValueError(f"variable {spec.name!r}: trainable variables must be float, got {spec.dtype}")
                _check_size(spec)
            _check_memory(specs, len(opt.slot_names) - len(opt.scalar_slot_names))
            shards: dict[str, Shard] = {}
            for spec in specs:
                if spec.name in shards:
                    raise ValueError(f"variable {spec.name!r} given twice")
                value = initialize(
                    spec.initializer or "zeros",
                    tuple(spec.shape),
                    spec.dtype,
                    full_shape=tuple(spec.full_shape) or tuple(spec.shape),
                    row_offset=spec.row_offset,
                    seed=spec.seed,
                    scale=spec.init_scale,
                )
                shards[spec.name] = Shard(spec, value, opt.create_slots(value))
            self._shards, self._optimizer = shards, opt
            self.model_id = model_id
            self.optimizer_steps = 0
            if reset:  # training starts again: its counts too
                self.global_step = 0
                self.shard_positions = {}
                self.sync_gradients_applied = self.stale_dropped = self.timed_out_steps = 0
            self._sync = StepAccumulator(replicas_to_aggregate, distinct_replicas, step=self.global_step) \
                if replicas_to_aggregate > 0 else None
            return False

    def _shard(self, name: str) -> Shard:
        if self._optimizer is None:
            raise NotInitializedError("this PS has no variables yet (the chief has not initialised it)")
        shard = self._shards.get(name)
        if shard is None:
            raise WireError(f"unknown variable {name!r} on this PS")
        return shard

    def leave(self, timeout: float, *, fed_recently: float = 2.0) -> bool:
        """Preempted: say so in the state the chief reads and, while a chief trains (a push came in the last
        ``fed_recently`` seconds, or it is handing over; not once it said training is over), wait up to
        ``timeout`` for it to release this PS:
        it stops scheduling, checkpoints every PS and restores that checkpoint into this one's successor.
        True if it did."""
        self.leaving.set()
        deadline = time.monotonic() + timeout
        while (time.monotonic() < deadline and not self.training_over.is_set()
               and (time.monotonic() - self.last_push < fed_recently or self._handing_over.is_set())):
            if self.released.wait(0.05):
                return True
        return self.released.is_set()

    def held_bytes(self) -> int:
        """The bytes of the variables and optimizer slots this PS holds."""
        return sum(s.value.nbytes + sum(v.nbytes for v in s.slots.values()) for s in list(self._shards.values()))

    # -- reads ----------------------------------------------------------------------------------------
    def pull(self, entries: Sequence[Entry], *, include_slots: bool = False) -> list[Entry]:
        out: list[Entry] = []
        for entry in entries:
            shard = self._shard(entry.name)
            if entry.kind == DENSE:
                if include_slots:  # a consistent copy of a shard and its slots, for checkpoints
                    with shard.lock:
                        out.append(Entry(entry.name, DENSE, shard.value.copy()))
                        out.extend(Entry(f"{entry.name}#{k}", SLOT, self._slot_now(k, v))
                                   for k, v in shard.slots.items())
                    continue
                out.append(Entry(entry.name, DENSE, shard.value))
            elif entry.kind == IDS:
                rows = _check_ids(entry, shard)
                if len(rows) > shard.rows:  # (ids of a byte each asked 256 times the request's size in copies)
                    raise WireError(f"the pull asks for {len(rows)} rows of {entry.name!r}, which has {shard.rows}: "
                                    "ask for each row once")
                out.append(Entry(entry.name, ROWS, gather_rows(shard.value, rows)))
            else:
                raise WireError(f"pull of {entry.name!r}: only DENSE names and IDS can be asked for")
        return out

    def _slot_now(self, key: str, slot: np.ndarray) -> np.ndarray:
        """A copy of a shard's slot as it stands: a scalar one (the step count) is this PS's, which the shard's
        own copy lags while no update touched it."""
        assert self._optimizer is not None
        if key in self._optimizer.scalar_slot_names:
            return np.asarray(self.optimizer_steps, dtype=slot.dtype)
        return slot.copy()

    # -- updates --------------------------------------------------------------------------------------
    def push(
        self,
        request: pb.PushRequest,
        entries: Sequence[Entry],
        split: Mapping[str, SplitArray] | None = None,
        pull_rows: Sequence[Entry] = (),
        *,
        from_chief: bool = True,
    ) -> PushOutcome:
        """Apply one step's gradients (``split``: dense ones still in the pieces they arrived in) at most once.
        ``pull_rows``: the IDS entries whose rows the push asks back (PULL_IDS on the wire), checked here with
        the gradients. ``from_chief``: sent with the chief's certificate (or without TLS): its chief incarnation
        may raise the fence; a worker's only relays it (checked, not learnt)."""
        self.last_push = time.monotonic()
        if self.training_over.is_set():  # (a chief that trains again: one restored after the end was said)
            self.training_over.clear()
        if self._optimizer is None:
            raise NotInitializedError("this PS has no variables yet (the chief has not initialised it)")
        updates = self._validate_update(entries, split or {})
        self._check_pull(request.pull_dense, pull_rows)
        if request.shard >= limits.MAX_DATA_SHARDS:  # (each shard's position is held, and sent in every GetState)
            raise WireError(f"data shard {request.shard} is beyond the {limits.MAX_DATA_SHARDS} a run may have")
        with self._lock:
            if request.step_id == 0:
                raise WireError("step_id must be non-zero")
            if self._sync is not None and request.local_step > self._sync.step:  # refuse before any bookkeeping
                raise WireError(f"gradient for step {request.local_step}, but this PS is at step {self._sync.step}")
            seen = self._incarnations.get(request.task)
            if seen is not None and request.incarnation < seen:
                self.fenced_updates += 1
                raise FencedError(
                    f"{request.task} incarnation {request.incarnation} was replaced by incarnation {seen}"
                )
            (self.chief_fence.admit if from_chief else self.chief_fence.check)(request.chief_incarnation)
            self._incarnations[request.task] = request.incarnation
            step = int(request.step_id)
            if step in self._applied or step <= self._newest_step - DEDUPE_WINDOW:
                self.duplicate_updates += 1
                return PushOutcome(False, self.global_step)
            if self._sync is not None:
                return self._push_sync(request, step, updates)
            self._record_applied(step)
            # Recorded with the fence check: a chief reading the positions after this sees the batch as taken.
            self._record_position(request)
            steps_before = self.optimizer_steps
            self.optimizer_steps += 1
        self._apply(updates, steps_before)
        with self._lock:
            self.applied_updates += 1
            if request.increment_global_step:
                self.global_step += 1
            return PushOutcome(True, self.global_step)

    def _record_position(self, request: pb.PushRequest) -> None:
        """The highest batch position applied per data shard (caller holds the lock)."""
        if request.position >= 0 and request.shard >= 0:
            self.shard_positions[request.shard] = max(self.shard_positions.get(request.shard, -1),
                                                      int(request.position))

    def _check_pull(self, names: Sequence[str], rows: Sequence[Entry]) -> None:
        """What a push asks back (whole shards, rows) must exist and fit its one-message answer, before anything
        changes."""
        size = sum(self._shard(name).value.nbytes for name in names)
        for entry in rows:
            shard = self._shard(entry.name)
            size += len(_check_ids(entry, shard)) * (shard.value.nbytes // max(1, shard.rows))
        if size > limits.UNARY_MAX_BYTES:
            raise WireError(f"the push asks back {size} bytes (pull_dense, PULL_IDS); one answer holds at most "
                            f"{limits.UNARY_MAX_BYTES}")

    def _push_sync(self, request: pb.PushRequest, step_id: int, updates: list[Update]) -> PushOutcome:
        """Accumulate a fresh gradient; apply the average once enough arrived (caller holds the lock)."""
        acc = self._sync
        assert acc is not None and self._optimizer is not None
        if request.local_step < acc.step:
            self.stale_dropped += 1
            return PushOutcome(False, self.global_step, stale=True)
        if request.local_step > acc.step:
            raise WireError(f"gradient for step {request.local_step}, but this PS is at step {acc.step}")
        self._record_applied(step_id)
        acc.add(request.task, [(s, r, g.join() if isinstance(g, SplitArray) else g) for s, r, g in updates])
        self._record_position(request)
        if acc.ready():
            self._apply_sync()
        return PushOutcome(True, self.global_step)

    def _apply_sync(self, *, timed_out: bool = False) -> None:
        acc = self._sync
        assert acc is not None
        self._apply(acc.averaged(), self.optimizer_steps)
        self.optimizer_steps += 1
        self.sync_gradients_applied += acc.gradients
        self.applied_updates += 1
        self.timed_out_steps += int(timed_out)
        self.global_step += 1
        acc.reset(self.global_step)

    def _apply(self, updates: Sequence[Update], steps_before: int) -> None:
        """Apply validated updates, each under its shard's lock, as the optimizer's step after ``steps_before``."""
        optimizer = self._optimizer
        assert optimizer is not None
        for shard, rows, grad in updates:
            with shard.lock:
                for key in optimizer.scalar_slot_names:  # (concurrent pushes: each at its own count)
                    shard.slots[key][...] = steps_before
                if rows is None:
                    _apply_dense(optimizer, shard, grad)
                else:
                    assert isinstance(grad, np.ndarray)  # only dense gradients arrive split
                    optimizer.apply_sparse(shard.value, rows, grad, shard.slots)

    def sync_flush(self, step: int, min_replicas: int, *, chief_incarnation: int = 0) -> tuple[bool, int]:
        """Apply ``step`` with what arrived if at least ``min_replicas`` did (replica timeout)."""
        with self._lock:
            self.chief_fence.admit(chief_incarnation)
            acc = self._sync
            if acc is None:
                raise WireError("this PS trains asynchronously: there is nothing to flush")
            if step < acc.step:
                return True, 0
            if step > acc.step:
                raise WireError(f"step {step} has not started here (this PS is at step {acc.step})")
            arrived = acc.count()
            if arrived >= max(1, min_replicas):
                self._apply_sync(timed_out=True)
                return True, arrived
            return False, arrived

    def _record_applied(self, step: int) -> None:
        """Remember an applied step id (caller holds the lock); memory stays bounded by the window."""
        self._applied.add(step)
        self._applied_log.append(step)
        if step > self._newest_step:
            self._newest_step = step
            if len(self._applied) > 2 * DEDUPE_WINDOW:
                floor = step - DEDUPE_WINDOW
                self._applied = {s for s in self._applied if s > floor}

    def _validate_update(self, entries: Sequence[Entry], split: Mapping[str, SplitArray]) -> list[Update]:
        dense: dict[str, Entry] = {}
        ids: dict[str, Entry] = {}
        rows: dict[str, Entry] = {}
        lefts: dict[str, Entry] = {}
        rights: dict[str, Entry] = {}
        by_kind: dict[int, dict[str, Entry]] = {DENSE: dense, IDS: ids, ROWS: rows, LEFT_FACTOR: lefts,
                                                RIGHT_FACTOR: rights}
        for entry in entries:
            target = by_kind.get(int(entry.kind))
            if target is None:
                raise WireError(f"entry {entry.name!r}: unknown kind")
            if entry.name in target:
                raise WireError(f"gradient for {entry.name!r} given twice")
            target[entry.name] = entry
        twice = (set(dense) & set(split)) | ((set(dense) | set(split)) & set(lefts))
        if twice:
            raise WireError(f"gradient for {sorted(twice)[0]!r} given twice")
        if set(ids) != set(rows):
            raise WireError(f"sparse gradients need IDS and ROWS for each variable: {sorted(set(ids) ^ set(rows))}")
        if set(lefts) != set(rights):
            raise WireError("low-rank gradients need LEFT_FACTOR and RIGHT_FACTOR for each variable: "
                            f"{sorted(set(lefts) ^ set(rights))}")
        updates: list[Update] = []
        whole: dict[str, Gradient] = {name: entry.array for name, entry in dense.items()}
        whole |= {name: self._multiplied_out(name, left.array, rights[name].array) for name, left in lefts.items()}
        for name, grad in (whole | dict(split)).items():
            shard = self._shard(name)
            _check_values(name, grad, shard, shard.value.shape)
            updates.append((shard, None, grad))
        for name, id_entry in ids.items():
            shard = self._shard(name)
            local = _check_ids(id_entry, shard)
            _check_values(name, rows[name].array, shard, (len(local), *shard.value.shape[1:]))
            updates.append((shard, local, rows[name].array))
        return updates

    def _multiplied_out(self, name: str, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """A low-rank gradient's product ``left.T @ right``, once its factors fit the shard (the product is
        checked like any dense gradient, by the caller: finite factors can still overflow)."""
        shard = self._shard(name)
        value = shard.value
        if value.ndim != 2:
            raise WireError(f"low-rank gradient for {name!r}: the variable has shape {value.shape}, not 2-d")
        for what, factor, columns in (("LEFT_FACTOR", left, value.shape[0]), ("RIGHT_FACTOR", right, value.shape[1])):
            if factor.dtype != value.dtype:
                raise WireError(f"{what} for {name!r} is {factor.dtype}, the variable is {value.dtype}")
            if factor.ndim != 2 or factor.shape[1] != columns or len(factor) != len(left):
                raise WireError(f"{what} for {name!r} has shape {factor.shape}; the factors of a {value.shape} "
                                f"gradient are k x {value.shape[0]} and k x {value.shape[1]} with the same k")
        if not (_all_finite(left) and _all_finite(right)):
            raise WireError(_non_finite("gradient", name))
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by the product's check
            return left.T @ right

    def assign(
        self, entries: Sequence[Entry], global_step: int, positions: Sequence[int], *, chief_incarnation: int = 0,
        counters: pb.SyncCounters | None = None, model_id: int = 0,
    ) -> None:
        """Replace every shard's value and slots (restoring a checkpoint, the shards now of model ``model_id``),
        and the synchronous training's counters where given (else they are kept). Validates all, then applies
        all."""
        if global_step < 0:
            raise WireError(f"assign's global step must be >= 0, got {global_step}")
        values: dict[str, np.ndarray] = {}
        slots: dict[str, dict[str, np.ndarray]] = {}
        for entry in entries:
            if entry.kind == DENSE:
                shard = self._shard(entry.name)
                _check_values(entry.name, entry.array, shard, shard.value.shape, what="value")
                values[entry.name] = entry.array
            elif entry.kind == SLOT:
                name, _, slot = entry.name.partition("#")
                shard = self._shard(name)
                current = shard.slots.get(slot)
                if current is None:
                    raise WireError(f"{name!r} has no optimizer slot {slot!r} (slots: {sorted(shard.slots)})")
                if entry.array.dtype != current.dtype or entry.array.shape != current.shape:
                    raise WireError(
                        f"slot {entry.name!r} is {entry.array.dtype}{entry.array.shape}, "
                        f"expected {current.dtype}{current.shape}"
                    )
                slots.setdefault(name, {})[slot] = entry.array
            else:
                raise WireError(f"assign takes DENSE and SLOT entries, not kind {entry.kind} ({entry.name!r})")
        missing = sorted(set(self._shards) - set(values))
        if missing:
            raise WireError(f"assign must give every variable of this PS; missing {missing}")
        given = () if counters is None else (counters.gradients_applied, counters.stale_dropped,
                                             counters.timed_out_steps)
        if min(given, default=0) < 0:
            raise WireError(f"assign's synchronous counters must be >= 0, got {given} (gradients applied, stale "
                            "dropped, timed-out steps)")
        for name, shard in self._shards.items():
            lacking = sorted(set(shard.slots) - set(slots.get(name, {})))
            if lacking:
                raise WireError(f"assign must give every slot of {name!r}; missing {lacking}")
        with self._lock:
            self.chief_fence.admit(chief_incarnation)
            self.training_over.clear()  # (a chief restoring: training goes on)
            for name, shard in self._shards.items():
                with shard.lock:
                    shard.value[...] = values[name]
                    for slot, array in slots.get(name, {}).items():  # SGD has no slots
                        shard.slots[slot][...] = array
            self.global_step = int(global_step)
            self.model_id = model_id
            # the checkpoint's step count (a checkpoint of per-shard counts: the most advanced shard's)
            assert self._optimizer is not None
            counted = self._optimizer.scalar_slot_names
            restored_counts = [int(a) for per in slots.values() for k, a in per.items() if k in counted]
            self.optimizer_steps = max(restored_counts, default=self.optimizer_steps)
            self.shard_positions = {i: int(p) for i, p in enumerate(positions) if p >= 0}
            if counters is not None:
                self.sync_gradients_applied = counters.gradients_applied
                self.stale_dropped = counters.stale_dropped
                self.timed_out_steps = counters.timed_out_steps
            if self._sync is not None:
                self._sync.reset(self.global_step)

    # -- inspection -----------------------------------------------------------------------------------
    def state(self, *, include_step_ids: bool = False, chief_incarnation: int = 0,
              release: bool = False, training_over: bool = False) -> pb.StateResponse:
        with self._lock:
            self.chief_fence.admit(chief_incarnation)
            if training_over:
                self.training_over.set()
            if self.leaving.is_set() and chief_incarnation:  # the chief has seen it leave
                self._handing_over.set()
            if release:
                self.released.set()
            positions = [self.shard_positions.get(i, -1) for i in range(max(self.shard_positions, default=-1) + 1)]
            return pb.StateResponse(
                global_step=self.global_step,
                variables=[
                    pb.VariableInfo(name=s.spec.name, dtype=s.spec.dtype, shape=list(s.spec.shape))
                    for s in self._shards.values()
                ],
                applied_updates=self.applied_updates,
                duplicate_updates=self.duplicate_updates,
                fenced_updates=self.fenced_updates,
                initialized=self.initialized,
                applied_step_ids=list(self._applied_log) if include_step_ids else [],
                shard_positions=positions,
                newest_step_id=self._newest_step,
                sync_gradients_applied=self.sync_gradients_applied,
                stale_dropped=self.stale_dropped,
                timed_out_steps=self.timed_out_steps,
                pending_replicas=self._sync.count() if self._sync is not None else 0,
                leaving=self.leaving.is_set(),
            )


def _check_size(spec: pb.VariableSpec) -> None:
    """A variable this PS could hold: a shape of at most MAX_RANK dimensions, none negative, within the wire's
    limit on one array (it is sent whole in a checkpoint; a larger one belongs in more shards)."""
    shape = tuple(spec.shape)
    size = math.prod(shape) * np.dtype(spec.dtype).itemsize
    if len(shape) > wire.MAX_RANK or min(shape, default=0) < 0 or size > wire.MAX_ARRAY_BYTES:
        raise ValueError(f"variable {spec.name!r} of shape {list(shape)} is not one a PS holds: at most "
                         f"{wire.MAX_RANK} dimensions, none negative, and {wire.MAX_ARRAY_BYTES >> 30} GiB "
                         "(partition it over more shards)")


def _check_memory(specs: Sequence[pb.VariableSpec], row_slots: int) -> None:
    """ValueError unless this host's memory could hold the variables and their optimizer's slots (``row_slots``
    of each one's size): refused before any is made, as the configuration error it is. A table larger than
    the host was allocated, and the kernel's OOM killer took the ps (other roles of the host with it) at every
    restart. (Against the host's whole memory: memory that is short only now is a MemoryError of the allocation,
    which a restart may not meet.)"""
    need = sum(math.prod(tuple(s.shape)) * np.dtype(s.dtype).itemsize for s in specs) * (1 + row_slots)
    total = _host_memory()
    if total is not None and need > total:
        raise ValueError(f"the variables need {need / 2**30:.1f} GiB with the optimizer's slots, more than this "
                         f"host's {total / 2**30:.1f} GiB: partition them over more ps (training.partitioner, "
                         "roles.ps.replicas)")


def _host_memory() -> int | None:
    """Bytes of memory this host has (its physical pages), None if it does not say. (Not psutil: a host's roles
    need only numpy, grpc and protobuf.)"""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _check_ids(entry: Entry, shard: Shard) -> np.ndarray:
    ids = entry.array
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise WireError(f"ids for {entry.name!r} must be a 1-d integer array, got {ids.dtype} {ids.shape}")
    if shard.value.ndim == 0:
        raise WireError(f"{entry.name!r} is a scalar and has no rows")
    if ids.size and (ids.min() < 0 or ids.max() >= shard.rows):
        bad = ids[(ids < 0) | (ids >= shard.rows)][0]
        raise WireError(f"row id {int(bad)} out of range for {entry.name!r} (rows 0..{shard.rows - 1})")
    return ids.astype(np.int64, copy=False)


def _check_values(
    name: str, array: Gradient, shard: Shard, shape: tuple[int, ...], *, what: str = "gradient"
) -> None:
    if array.dtype != shard.value.dtype:
        raise WireError(f"{what} for {name!r} is {array.dtype}, the variable is {shard.value.dtype}")
    if array.shape != shape:
        raise WireError(f"{what} for {name!r} has shape {array.shape}, expected {shape}")
    if not (isinstance(array, SplitArray) and array.runs_checked) and not _all_finite(array):
        raise WireError(_non_finite(what, name))


def _non_finite(what: str, name: str) -> str:
    return f"{what} for {name!r} contains NaN or infinity; refused (the variable is unchanged)"


def _refuse_non_finite_run(name: str, run: np.ndarray) -> None:
    """A streamed gradient's piece, checked as it arrives (the Assembler's check_run)."""
    if not _all_finite(run):
        raise WireError(_non_finite("gradient", name))


def _runs(array: Gradient) -> list[tuple[int, np.ndarray]]:
    """A gradient as consecutive 1-d runs of its elements: (index of the first one, the run)."""
    if isinstance(array, SplitArray):
        return list(array.runs())
    return [(0, np.ascontiguousarray(array).reshape(-1))]


def _blocks(runs: Sequence[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    """The runs cut into blocks of at most UPDATE_BLOCK elements (views), in order."""
    return [(start + at, run[at : at + UPDATE_BLOCK]) for start, run in runs for at in range(0, run.size, UPDATE_BLOCK)]


def _all_finite(array: Gradient) -> bool:
    """No NaN nor infinity. float32/64 first by sums of squares (BLAS, in parallel for large arrays): a NaN or an
    infinity makes them non-finite (so does overflow, for huge finite values: the exact check then decides), and
    they allocate nothing, where ``np.isfinite(array).all()`` allocates a boolean array as large as the gradient."""
    if array.dtype.kind != "f" or math.prod(array.shape) == 0:
        return True
    runs = _runs(array)
    if array.dtype.itemsize >= 4 and _squares_finite(runs, math.prod(array.shape)):
        return True
    return all(bool(np.isfinite(run).all()) for _, run in runs)


def _squares_finite(runs: Sequence[tuple[int, np.ndarray]], elements: int) -> bool:
    """The screen: every block's sum of squares finite. One run that is one block (a small whole gradient, most
    of them) is summed here directly, without the blocks' bookkeeping (W1's push handler 275 -> 267 us)."""
    if len(runs) == 1 and runs[0][1].size <= UPDATE_BLOCK:
        return bool(np.isfinite(_sum_of_squares(runs[0][1])))

    def finite(blocks: Sequence[tuple[int, np.ndarray]]) -> bool:
        return all(np.isfinite(_sum_of_squares(block)) for _, block in blocks)

    return all(_in_parallel(_blocks(runs), finite, elements))


def _sum_of_squares(flat: np.ndarray) -> np.floating:
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite is the answer looked for, not a problem
        return np.dot(flat, flat)  # type: ignore[no-any-return]


def _apply_dense(optimizer: Optimizer, shard: Shard, grad: Gradient) -> None:
    """``optimizer.apply_dense`` on the whole shard, in blocks of UPDATE_BLOCK elements when it is larger or its
    gradient arrived in pieces (and over UPDATE_THREADS threads when it is large).

    Every block starts from the scalar slots (Adam's step count) as they were before this update, and the last
    block's scalars are kept: for the elementwise rules that is exactly one update of the whole shard.
    """
    var = shard.value
    whole = not isinstance(grad, SplitArray)
    if (whole and var.size <= UPDATE_BLOCK) or not all(a.flags.c_contiguous for a in (var, *shard.slots.values())):
        optimizer.apply_dense(var, grad if isinstance(grad, np.ndarray) else grad.join(), shard.slots)
        return
    scalars = {k: shard.slots[k] for k in optimizer.scalar_slot_names}
    rows = {k: v.reshape(-1) for k, v in shard.slots.items() if k not in scalars}
    flat_var = var.reshape(-1)

    def apply(blocks: Sequence[tuple[int, np.ndarray]]) -> dict[str, np.ndarray]:
        slots: dict[str, np.ndarray] = {}
        for start, block_grad in blocks:
            block = slice(start, start + block_grad.size)
            slots = {k: v[block] for k, v in rows.items()} | {k: v.copy() for k, v in scalars.items()}
            optimizer.apply_dense(flat_var[block], block_grad, slots)
        return slots

    last = _in_parallel(_blocks(_runs(grad)), apply, var.size)[-1]
    for k, v in scalars.items():
        np.copyto(v, last[k])


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_parallel(items: Sequence[X], work: Callable[[Sequence[X]], T], elements: int) -> list[T]:
    """``work`` over consecutive groups of ``items`` covering them all, in order: one group per update thread
    when the items hold at least PARALLEL_MIN ``elements``, else one group in this thread. numpy releases the
    GIL, and while the PS applies a large push its worker waits idle, so the threads have cores to run on."""
    if elements < PARALLEL_MIN or UPDATE_THREADS == 1 or len(items) < 2:
        return [work(items)]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=UPDATE_THREADS, thread_name_prefix="ps-update")
    step = -(-len(items) // UPDATE_THREADS)
    return list(_pool.map(work, [items[i : i + step] for i in range(0, len(items), step)]))


#: Who may push (as the task its certificate names): workers, and the chief (benchmarks push as it).
_PUSHERS = re.compile(r"worker-\d+|chief-0")


def _refuse_unless_pusher(context: grpc.ServicerContext, sender: str | None) -> None:
    """PERMISSION_DENIED unless ``sender`` (a certificate's name; None without TLS) may push at all."""
    if sender is not None and not _PUSHERS.fullmatch(sender):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"a push is a worker's to send, not {sender}'s")

#: A PS server's threads: its unary calls', and one for each of the workers' sessions.
SERVER_THREADS = UNARY_THREADS + SESSIONS_PER_PS

#: The framed rpcs and the servicer methods that implement them on bytes: (gRPC handler kind, method).
_FRAMED: dict[str, tuple[Callable[..., grpc.RpcMethodHandler], str]] = {
    "PullFramed": (grpc.unary_unary_rpc_method_handler, "pull_framed"),
    "PullFramedStream": (grpc.unary_stream_rpc_method_handler, "pull_framed_stream"),
    "PushFramed": (grpc.unary_unary_rpc_method_handler, "push_framed"),
    "PushFramedStream": (grpc.stream_unary_rpc_method_handler, "push_framed_stream"),
    "AssignFramedStream": (grpc.stream_unary_rpc_method_handler, "assign_framed_stream"),
    "PullFramedSession": (grpc.stream_stream_rpc_method_handler, "pull_framed_session"),
    "PushFramedSession": (grpc.stream_stream_rpc_method_handler, "push_framed_session"),
}


def _pull_rows_apart(entries: list[Entry], *, streamed: bool) -> tuple[list[Entry], list[Entry]]:
    """A push's gradients, and the rows it asks back (its PULL_IDS entries, as a pull's IDS)."""
    rows = [Entry(e.name, IDS, e.array) for e in entries if e.kind == PULL_IDS]
    if rows and streamed:
        raise WireError("PULL_IDS needs a unary push: the answer is one message")
    return ([e for e in entries if e.kind != PULL_IDS] if rows else entries), rows


def _push_header(p: pb.PushRequest) -> pb.PushRequest:
    """A streamed push's header: the first chunk's fields without its arrays."""
    return pb.PushRequest(
        step_id=p.step_id, task=p.task, incarnation=p.incarnation, local_step=p.local_step,
        increment_global_step=p.increment_global_step, shard=p.shard, position=p.position,
        pull_dense=list(p.pull_dense), chief_incarnation=p.chief_incarnation,
    )


def _assign_header(p: pb.AssignRequest) -> pb.AssignRequest:
    header = pb.AssignRequest(global_step=p.global_step, shard_positions=list(p.shard_positions),
                              chief_incarnation=p.chief_incarnation, model_id=p.model_id)
    if p.HasField("sync_counters"):
        header.sync_counters.CopyFrom(p.sync_counters)
    return header


def _plain_parts(chunks: Iterator[Any]) -> Iterator[tuple[Any, list[tuple[pb.NamedTensor, bytes]]]]:
    """A plain stream's chunks as (header, pieces with their bytes)."""
    for chunk in chunks:
        yield chunk.part, [(item, item.tensor.data) for item in chunk.part.entries]


def _framed_parts(frames: Iterator[bytes], header_type: Any) -> Iterator[tuple[Any, list[tuple[Any, Any]]]]:
    for frame in frames:
        yield wire.decode_frame(frame, header_type)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    """gRPC front of a VariableStore: decodes, maps errors to status codes, encodes."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        #: Pulls and pushes served (for psctl top's requests/s; a lost increment under a race is harmless).
        self.requests = 0
        #: The workers' open sessions (a serving thread each).
        self.sessions = SessionSlots(SESSIONS_PER_PS)

    def _abort(self, context: grpc.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, ChiefReplaced):
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        if isinstance(exc, FencedError):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if isinstance(exc, NotInitializedError):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def Init(self, request: pb.InitRequest, context: grpc.ServicerContext) -> pb.InitResponse:
        refuse_unless_from(context, CHIEF_MEMBER, "Init")
        if request.cluster_id != self.store.cluster_id:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this PS belongs to cluster {self.store.cluster_id!r}, not {request.cluster_id!r}",
            )
        try:
            already = self.store.init(
                list(request.variables),
                request.optimizer,
                reset=request.reset,
                replicas_to_aggregate=request.replicas_to_aggregate,
                distinct_replicas=request.distinct_replicas,
                chief_incarnation=request.chief_incarnation,
                model_id=request.model_id,
            )
        except ChiefReplaced as exc:
            self._abort(context, exc)
            raise
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION if "already" in str(exc) else
                          grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except MemoryError as exc:  # (nothing was kept: the shards replace the old ones only once all are made)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"this PS has no memory for these variables: {exc}")
        return pb.InitResponse(already_initialized=already, global_step=self.store.global_step,
                               model_id=self.store.model_id)

    # -- shared by both forms -------------------------------------------------------------------------
    def _decoded(self, decode: Callable[[], T], context: grpc.ServicerContext) -> T:
        try:
            return decode()
        except WireError as exc:
            self._abort(context, exc)
            raise

    def _pull(self, request: pb.PullRequest, entries: list[Entry], context: grpc.ServicerContext) -> list[Entry]:
        self.requests += 1
        try:
            return self.store.pull(entries, include_slots=request.include_slots)
        except (ValueError, NotInitializedError) as exc:
            self._abort(context, exc)
            raise

    def _push(
        self,
        request: pb.PushRequest,
        entries: list[Entry],
        context: grpc.ServicerContext,
        sender: str | None,
        split: Mapping[str, SplitArray] | None = None,
    ) -> tuple[pb.PushResponse, list[Entry]]:
        """Apply a push from ``sender`` (the caller's certificate name; None without TLS); the response, and the
        shards its pull_dense names and the rows its PULL_IDS entries ask for, as they are after it."""
        self.requests += 1
        if sender is not None:
            _refuse_unless_pusher(context, sender)
            owner = member_of_task(request.task)  # (its incarnation can fence the task it names: only that task's)
            if sender != owner:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"a push of {request.task or 'no task'} is {owner}'s, not {sender}'s")
        try:
            gradients, rows = _pull_rows_apart(entries, streamed=split is not None)
            outcome = self.store.push(request, gradients, split, rows, from_chief=sender in (None, CHIEF_MEMBER))
            pulled = self.store.pull([*map(wire.whole_shard, request.pull_dense), *rows])
        except (ValueError, FencedError, NotInitializedError, ChiefReplaced) as exc:
            self._abort(context, exc)
            raise
        response = pb.PushResponse(applied=outcome.applied, global_step=outcome.global_step, stale=outcome.stale)
        return response, pulled

    def _read_stream(
        self,
        parts: Iterator[tuple[Any, Any]],
        header_of: Callable[[Any], Any],
        context: grpc.ServicerContext,
        *,
        split_dense: bool = False,
    ) -> tuple[Any, list[Entry], dict[str, SplitArray]]:
        """A streamed request: the header from the first chunk (its scalars only, not its data), and every
        chunk's pieces reassembled and validated (``split_dense``, for pushes: dense gradients left in the pieces
        they came in where those are element-aligned, each piece checked finite as it arrives, so that the
        check overlaps the transfer); a malformed stream is refused with INVALID_ARGUMENT."""
        header = None
        assembler = wire.Assembler(
            keep_dense_pieces=split_dense, check_run=_refuse_non_finite_run if split_dense else None
        )
        try:
            for part, pieces in parts:
                if header is None:
                    header = header_of(part)
                assembler.add_pieces(pieces)
            if header is None:
                raise WireError("empty stream")
            entries, split = assembler.split_entries()  # (nothing is split unless split_dense kept pieces)
            return header, entries, split
        except WireError as exc:
            self._abort(context, exc)
            raise

    def _assign(
        self, request: pb.AssignRequest, entries: list[Entry], context: grpc.ServicerContext
    ) -> pb.AssignResponse:
        """A restore, from the chief (each way in checks that first: a stream before it is read)."""
        try:
            self.store.assign(entries, request.global_step, list(request.shard_positions),
                              chief_incarnation=request.chief_incarnation, model_id=request.model_id,
                              counters=request.sync_counters if request.HasField("sync_counters") else None)
        except (ValueError, NotInitializedError, ChiefReplaced) as exc:
            self._abort(context, exc)
            raise
        return pb.AssignResponse(global_step=self.store.global_step)

    def _streamed_push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushRequest:
        if request.pull_dense:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "pull_dense needs a unary push: the answer is one message")
        return request

    # -- framed rpcs: bytes in, bytes out --------------------------------------------------------------
    def pull_framed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        header, entries = self._decoded(lambda: wire.read_frame(request, pb.PullRequest), context)
        pulled = self._pull(header, entries, context)
        return wire.encode_frame(pb.PullResponse(global_step=self.store.global_step), pulled)

    def pull_framed_stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        header, entries = self._decoded(lambda: wire.read_frame(request, pb.PullRequest), context)
        pulled = self._pull(header, entries, context)
        step = self.store.global_step
        yield from wire.frames(pulled, pb.PullResponse(global_step=step))

    def push_framed(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return self.push_frame(request, context, caller(context))

    def push_frame(self, request: bytes, context: grpc.ServicerContext, sender: str | None) -> bytes:
        """A framed push from ``sender`` (see ``_push``): every framed push's way in, unary or a session's."""
        header, entries = self._decoded(lambda: wire.read_frame(request, pb.PushRequest), context)
        return wire.encode_frame(*self._push(header, entries, context, sender))

    def push_framed_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        _refuse_unless_pusher(context, caller(context))  # (before its stream is read: it may be gigabytes)
        header, entries, split = self._read_stream(
            _framed_parts(requests, pb.PushRequest), _push_header, context, split_dense=True
        )
        return wire.encode_frame(*self._push(self._streamed_push(header, context), entries, context, caller(context),
                                             split))

    def assign_framed_stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        refuse_unless_from(context, CHIEF_MEMBER, "Assign")  # (before its stream is read: it may be gigabytes)
        header, entries, _ = self._read_stream(_framed_parts(requests, pb.AssignRequest), _assign_header, context)
        return self._assign(header, entries, context).SerializeToString()  # type: ignore[no-any-return]

    def pull_framed_session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        return self.sessions.serve(requests, context, self.pull_framed)

    def push_framed_session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        sender = caller(context)  # (once a session: its pushes all come over the one connection)
        _refuse_unless_pusher(context, sender)
        return self.sessions.serve(requests, context, lambda request, ctx: self.push_frame(request, ctx, sender))

    def framed_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """Handlers of the framed rpcs with no (de)serializer: gRPC hands over the received bytes as they are."""
        return {name: kind(getattr(self, method)) for name, (kind, method) in _FRAMED.items()}

    # The framed rpcs as the generated registration (pb_grpc.add_ParameterServerServicer_to_server) calls them,
    # with protobuf messages: re-encoded to bytes and back, correct but slower than add_to_server's handlers.
    def PullFramed(self, request: pb.PullRequestFrame, context: grpc.ServicerContext) -> pb.PullResponseFrame:
        return pb.PullResponseFrame.FromString(self.pull_framed(request.SerializeToString(), context))

    def PullFramedStream(
        self, request: pb.PullRequestFrame, context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponseFrame]:
        for frame in self.pull_framed_stream(request.SerializeToString(), context):
            yield pb.PullResponseFrame.FromString(frame)

    def PushFramed(self, request: pb.PushRequestFrame, context: grpc.ServicerContext) -> pb.PushResponseFrame:
        return pb.PushResponseFrame.FromString(self.push_framed(request.SerializeToString(), context))

    def PushFramedStream(
        self, request_iterator: Iterator[pb.PushRequestFrame], context: grpc.ServicerContext
    ) -> pb.PushResponseFrame:
        frames = (m.SerializeToString() for m in request_iterator)
        return pb.PushResponseFrame.FromString(self.push_framed_stream(frames, context))

    def AssignFramedStream(
        self, request_iterator: Iterator[pb.AssignRequestFrame], context: grpc.ServicerContext
    ) -> pb.AssignResponse:
        frames = (m.SerializeToString() for m in request_iterator)
        return pb.AssignResponse.FromString(self.assign_framed_stream(frames, context))

    def PullFramedSession(
        self, request_iterator: Iterator[pb.PullRequestFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.PullResponseFrame]:
        answers = self.pull_framed_session((m.SerializeToString() for m in request_iterator), context)
        return map(pb.PullResponseFrame.FromString, answers)

    def PushFramedSession(
        self, request_iterator: Iterator[pb.PushRequestFrame], context: grpc.ServicerContext
    ) -> Iterator[pb.PushResponseFrame]:
        answers = self.push_framed_session((m.SerializeToString() for m in request_iterator), context)
        return map(pb.PushResponseFrame.FromString, answers)

    # -- plain rpcs: the arrays inside the protobuf messages ----------------------------------------------
    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> pb.PullResponse:
        entries = self._decoded(lambda: wire.decode_entries(request.entries), context)
        pulled = self._pull(request, entries, context)
        response = pb.PullResponse(global_step=self.store.global_step)
        wire.add_entries(response.entries, pulled)
        return response

    def PullStream(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.PullChunk]:
        entries = self._decoded(lambda: wire.decode_entries(request.entries), context)
        pulled = self._pull(request, entries, context)
        step = self.store.global_step

        def new_chunk(i: int) -> pb.PullChunk:
            return pb.PullChunk(part=pb.PullResponse(global_step=step)) if i == 0 else pb.PullChunk()

        yield from wire.fill_chunks(pulled, new_chunk)

    def Push(self, request: pb.PushRequest, context: grpc.ServicerContext) -> pb.PushResponse:
        entries = self._decoded(lambda: wire.decode_entries(request.entries), context)
        response, pulled = self._push(request, entries, context, caller(context))
        wire.add_entries(response.entries, pulled)
        return response

    def PushStream(self, request_iterator: Iterator[pb.PushChunk], context: grpc.ServicerContext) -> pb.PushResponse:
        _refuse_unless_pusher(context, caller(context))  # (before its stream is read)
        request, entries, split = self._read_stream(
            _plain_parts(request_iterator), _push_header, context, split_dense=True
        )
        response, _ = self._push(self._streamed_push(request, context), entries, context, caller(context), split)
        return response

    def Assign(self, request: pb.AssignRequest, context: grpc.ServicerContext) -> pb.AssignResponse:
        refuse_unless_from(context, CHIEF_MEMBER, "Assign")
        entries = self._decoded(lambda: wire.decode_entries(request.entries), context)
        return self._assign(request, entries, context)

    def AssignStream(
        self, request_iterator: Iterator[pb.AssignChunk], context: grpc.ServicerContext
    ) -> pb.AssignResponse:
        refuse_unless_from(context, CHIEF_MEMBER, "Assign")  # (before its stream is read: it may be gigabytes)
        request, entries, _ = self._read_stream(_plain_parts(request_iterator), _assign_header, context)
        return self._assign(request, entries, context)

    def SyncFlush(self, request: pb.SyncFlushRequest, context: grpc.ServicerContext) -> pb.SyncFlushResponse:
        refuse_unless_from(context, CHIEF_MEMBER, "SyncFlush")
        try:
            applied, arrived = self.store.sync_flush(request.step, request.min_replicas,
                                                     chief_incarnation=request.chief_incarnation)
        except (ValueError, ChiefReplaced) as exc:
            self._abort(context, exc)
            raise
        return pb.SyncFlushResponse(applied=applied, replicas=arrived, global_step=self.store.global_step)

    def GetState(self, request: pb.StateRequest, context: grpc.ServicerContext) -> pb.StateResponse:
        if request.release or request.training_over or request.chief_incarnation:
            # (a chief incarnation raises the fence: a huge one from anyone else would fence every real chief)
            refuse_unless_from(context, CHIEF_MEMBER, "a state request in the chief's name")
        try:
            return self.store.state(include_step_ids=request.include_step_ids,
                                    chief_incarnation=request.chief_incarnation, release=request.release,
                                    training_over=request.training_over)
        except ChiefReplaced as exc:
            self._abort(context, exc)
            raise


class _Registrations:
    """Stands in for a grpc.Server to collect the handlers the generated registration makes."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers.update(handlers)


def add_to_server(servicer: ParameterServerServicer, server: grpc.Server) -> None:
    """Serve ``servicer`` on ``server``: the framed rpcs on raw bytes (decoded in place), the rest as generated.

    (``pb_grpc.add_ParameterServerServicer_to_server`` works too, with the framed rpcs parsed and re-encoded by
    protobuf on the way: what a plain gRPC server does.)
    """
    generated = _Registrations()
    pb_grpc.add_ParameterServerServicer_to_server(servicer, generated)
    if not generated.handlers:
        raise RuntimeError("the generated registration registered nothing: regenerate psctl/proto")
    handlers = {**generated.handlers, **servicer.framed_handlers()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.PS_SERVICE, handlers),))
    server.add_registered_method_handlers(wire.PS_SERVICE, handlers)

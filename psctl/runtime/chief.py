"""The chief: creates the variables, schedules every training step, logs metrics, evaluates at the end.

It keeps no training state of its own that matters: the global step and each data shard's position live
on ps 0, so a restarted chief reads them back and carries on without losing or repeating a step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from psctl.runtime.atomic import write_json_atomic
from psctl.runtime.call_size import CallSizer
from psctl.runtime.checkpoint import (
    DAMAGED_PREFIX,
    Checkpointer,
    CheckpointError,
    Snapshot,
    check_variables,
    list_checkpoints,
    mark_finished,
    reshard_onto,
    restorable_checkpoint,
    restore_snapshot,
    step_of,
    take_snapshot,
)
from psctl.runtime.cluster import ClusterInfo
from psctl.runtime.config import TrainingConfig
from psctl.runtime.coordinator import Closure, ClusterCoordinator, PsFailure, StepError
from psctl.runtime.evaluation import evaluate_split
from psctl.runtime.heartbeat import ADDRESSES, PROGRESS, tasks_of
from psctl.runtime.metrics import MetricsFile, TrainingMeter, metric_text, metrics_text
from psctl.runtime.model import ShardedModel
from psctl.runtime.optimizers import make_optimizer
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps_client import PsClient, PsUnavailable, sync_counters
from psctl.runtime.tensorboard import ScalarWriter

log = logging.getLogger("psctl.chief")

#: A restarted chief numbers its steps this far above the newest id any PS has seen, so they never collide
#: with the ids of steps the previous chief still had in flight (at most a few per worker).
STEP_ID_GAP = 1 << 20
#: Seconds a stopping chief waits for the steps running on workers (they finish theirs when stopped too).
STOP_JOIN = 5.0
#: Synchronous mode: extra seconds a round with no gradient at all may take (workers still starting).
FIRST_ROUND_GRACE = 120.0


def _cursors(positions: list[int]) -> dict[int, int]:
    """Each data shard's next batch position, from the highest applied position ps 0 records."""
    return {i: p + 1 for i, p in enumerate(positions) if p >= 0}


class Interrupted(Exception):
    """The chief was asked to stop (SIGTERM) before training finished."""


class CheckpointMismatch(Exception):
    """The checkpoint to resume from does not fit the spec (another model, optimizer or data split): a restart
    cannot help, and training afresh over it would lose it."""


class VariablesRefused(Exception):
    """A ps refused the model's variables (a shard larger than a ps holds, or all of them than its host's
    memory): a configuration error (partition them over more shards, or more ps), which a restart would meet
    again."""


class Chief:
    def __init__(self, info: ClusterInfo, *, stop: threading.Event | None = None, ready_timeout: float = 120.0) -> None:
        self.info = info
        self.config = TrainingConfig.from_dict(info.training)
        self.stop = stop or threading.Event()
        self.ready_timeout = ready_timeout
        cfg = self.config
        self.program = load_program(ProgramRef(cfg.program, cfg.args, cfg.data, cfg.seed))
        self.model = ShardedModel(self.program, len(info.ps), cfg.partitioner, cfg.placement)
        self.ps = PsClient(info.ps, tls=info.tls, chief_incarnation=info.incarnation)
        PROGRESS.metrics = {**PROGRESS.metrics, "ps_layout": len(info.ps)}  # the supervisor retires ps by it
        #: The ps addresses of a layout with another ps count (psctl scale ps=N), until resharded onto it.
        self._ps_wanted: list[str] | None = None
        #: PS clients of layouts resharded away from (each closed a while later, and all at the end).
        self._replaced: list[PsClient] = []
        self.meter = TrainingMeter(by_global_step=cfg.mode == "sync")
        #: Asynchronous steps per call to a worker (training.steps_per_execution); one in bounded mode, whose
        #: staleness bound counts the steps as the chief hands them out.
        self._call_size = CallSizer(cfg.steps_per_execution if cfg.mode == "async" else 1)
        run_dir = Path(info.run_dir)
        self.metrics = MetricsFile(run_dir / "metrics.jsonl")
        self.result_path = run_dir / "result.json"
        self.start_step = 0
        self._reporting_done = threading.Event()
        self._advanced = threading.Condition()
        #: Every PS's global step as the workers' push replies reported it (synchronous rounds).
        self._ps_steps = [0] * len(info.ps)
        ckpt = cfg.checkpoint or {}
        self.checkpointer = Checkpointer(ckpt) if ckpt.get("dir") else None
        #: The training data's shards, fixed for the run's life (the worker count at its start by default).
        self.data_shards = cfg.data_shards or len(info.workers)
        self.ps_wait = 300.0
        self.restores = 0
        #: Steps trained again after a lost ps: the global step reached, less the one every ps was restored to.
        self.recomputed_steps = 0
        #: The checkpoints that did not verify where a restore looked, each with why: set aside (``damaged-``).
        self.damaged_checkpoints: list[str] = []
        #: The ps that said they are leaving (preempted): checkpointed, then restored into their successors.
        self._leaving: set[int] = set()
        #: The stop's checkpoint was taken already (by the hand-over to a leaving ps, as the chief was stopped).
        self._stopped_with_checkpoint = False
        self.tensorboard = ScalarWriter(run_dir / "tensorboard" / "train")
        self._coordinator: ClusterCoordinator | None = None
        # a ps restarted on another host of its pool: go there; another ps count: reshard onto it
        self._unfollow_ps = ADDRESSES.subscribe(self._follow_ps)
        self._worker_steps: dict[int, int] = {}
        self._rates_at = time.monotonic()

    def run(self) -> dict[str, Any]:
        cfg = self.config
        log.info("waiting for %d ps", len(self.ps.addresses))
        self.ps.wait_ready(self.ready_timeout)
        self._init_or_restore()
        state = self.ps.state(0)
        self.start_step = state.global_step
        self._resumed_at(self.start_step)
        newest_id = max(self.ps.state(i).newest_step_id for i in range(len(self.ps.addresses)))
        log.info(
            "training %s: %d variables over %d ps, %d workers, from global step %d to %d (mode %s)",
            cfg.program, len(self.model.layouts), len(self.ps.addresses), len(self.info.workers),
            self.start_step, cfg.steps, cfg.mode,
        )
        coordinator = ClusterCoordinator(
            self.info.workers,
            tls=self.info.tls,
            step_id_base=newest_id + STEP_ID_GAP if newest_id else 0,
            cursors=_cursors(list(state.shard_positions)),
            step_timeout=cfg.step_timeout,
            on_result=self._on_result,
            on_worker_event=lambda message: log.warning("%s", message),
            staleness=cfg.staleness if cfg.mode == "bounded" else None,
            one_per_round=cfg.mode == "sync" and bool(cfg.distinct_replicas),
            # asynchronous: a second step waits on each worker (queued there, or computing at once when
            # pipelined), so the chief's round trip never leaves a worker idle
            steps_in_flight=2 if cfg.mode == "async" else 1,
            chief_incarnation=self.info.incarnation,
            num_shards=self.data_shards,
            ps_addresses=self.ps.addresses,
        )
        self._coordinator = coordinator
        unsubscribe = ADDRESSES.subscribe(lambda addresses: _follow_workers(coordinator, addresses))
        coordinator.wait_for_workers(self.ready_timeout)
        reporter = threading.Thread(target=self._report_loop, name="metrics", daemon=True)
        reporter.start()
        started = time.monotonic()
        try:
            backoff = 0.0
            last_failure = -1e9
            while True:
                try:
                    self._train(coordinator)
                    break
                except (PsFailure, PsUnavailable) as exc:
                    if self.stop.is_set():  # being stopped: the ps going away is part of it
                        break
                    # Workers' channels to a restarted PS reconnect on their own clock: back off when failures
                    # come back to back rather than spin restoring.
                    backoff = min(2.0, max(0.2, backoff * 2)) if time.monotonic() - last_failure < 5 else 0.0
                    last_failure = time.monotonic()
                    log.warning("ps lost (%s): restoring every ps and resuming", exc)
                    self.stop.wait(backoff)
                    self._restore_after_ps_loss(coordinator)
            if not self.stop.is_set():
                coordinator.tell_training_over()  # only the ps are asked for anything from here on
            if self.checkpointer is not None:
                if not self.stop.is_set():
                    self._checkpoint()
                else:
                    self._checkpoint_on_stop(coordinator)
        finally:
            if self.stop.is_set():  # every ps: they may all be leaving now (psctl down, a job's preemption)
                self._release(list(range(len(self.ps.addresses))))
            unsubscribe()
            coordinator.shutdown(tell_stopped=self.stop.is_set())
            self._reporting_done.set()
            reporter.join(timeout=5)
            if self.checkpointer is not None:
                self.checkpointer.wait()
        if self.stop.is_set():
            self._report()  # where it stopped (its stop checkpoint's step): status showed the last interval's
            # not asked of the ps: on `psctl down` they are stopping too
            raise Interrupted(f"stopped at global step {self.meter.global_step} of {cfg.steps}")
        metrics, global_step = evaluate_split(self.model, self.ps)
        seconds = time.monotonic() - started
        result = {
            "global_step": global_step,
            # each data shard's last batch: every step took one batch, none twice, so these sum to the steps
            "shard_positions": list(self.ps.state(0).shard_positions),
            "ps": len(self.ps.addresses),
            "workers": coordinator.active_workers(),
            "steps_this_run": global_step - self.start_step,
            "seconds": round(seconds, 3),
            "retried_steps": coordinator.retries,
            "handed_back_steps": coordinator.handed_back,
            "ps_restores": self.restores,
            "recomputed_steps": self.recomputed_steps,
            "max_observed_lag": coordinator.max_observed_lag if cfg.mode == "bounded" else None,
            # asynchronous: the steps a worker ran per call from the chief, on average (steps_per_execution)
            "steps_per_call": round(self._call_size.mean(), 2) if cfg.mode != "sync" else None,
            "sync": self._sync_counters(),
            "metrics": metrics,
            "checkpoint": str(self.checkpointer.latest) if self.checkpointer and self.checkpointer.latest else None,
        }
        if self.damaged_checkpoints:  # set aside: the run went on from an older one (or from its initializers)
            result["damaged_checkpoints"] = self.damaged_checkpoints
        if self.checkpointer is not None and self.checkpointer.failed:
            result["checkpoint_failures"] = {
                "count": self.checkpointer.failed,
                "last": self.checkpointer.last_error,
                # the latest checkpoint is older than the end of training (its model is not the trained one)
                "final_failed": self.checkpointer.latest is None or step_of(self.checkpointer.latest) < global_step,
            }
        self._report(final=True)
        self.metrics.write({"time": time.time(), "event": "final", **result})
        write_json_atomic(self.result_path, result)
        if self.checkpointer is not None:
            try:
                mark_finished(self.checkpointer.directory, self.info.cluster_id, global_step)
            except OSError as exc:  # training is done: an evaluator elsewhere then stops after its grace
                log.error("cannot leave word beside the checkpoints that training finished: %s", exc)
        # stopped next (the cluster is done), each ps goes at once, not after its grace for a checkpoint
        self._tell_ps(list(range(len(self.ps.addresses))), training_over=True)
        log.info(
            "training done: global step %d, %s",
            global_step,
            metrics_text(metrics),
        )
        return result

    def _train(self, coordinator: ClusterCoordinator) -> None:
        """Schedule steps until ps 0's global step reaches the target; checkpoint on the way."""
        if self.config.mode == "sync":
            self._train_sync(coordinator)
            return
        remaining = max(0, self.config.steps - self.ps.state(0).global_step)
        while remaining > 0 and not self.stop.is_set():
            coordinator.wait_below(2 * coordinator.active_workers() + 2, give_up=self.stop.is_set)
            if self.stop.is_set():
                break
            if self._ps_wanted is not None:
                self._reshard(coordinator)
                remaining = max(0, self.config.steps - self.ps.state(0).global_step)
                continue
            if self._leaving and self.checkpointer is not None:
                self._hand_over(coordinator)
                remaining = max(0, self.config.steps - self.ps.state(0).global_step)
                continue
            if self.checkpointer is not None and self.checkpointer.due(self.meter.global_step):
                if not self._join(coordinator):
                    break  # stopping: nothing to checkpoint consistently now (the stop path tries)
                self._checkpoint()
            steps = self._call_size.steps(remaining, coordinator.active_workers(), self._until_checkpoint(remaining))
            coordinator.schedule("train", steps=steps)
            remaining -= steps
        if self.stop.is_set() or not self._join(coordinator):
            self._stop_scheduling(coordinator)

    def _until_checkpoint(self, remaining: int) -> int | None:
        """Steps that may still be scheduled before the next checkpoint by steps falls due (None: none will), so
        that calls shrink towards it and the checkpoint is taken close to its step, not a queue of calls later."""
        due = self.checkpointer.next_due_step() if self.checkpointer is not None else None
        return None if due is None else max(0, due - (self.config.steps - remaining))

    def _join(self, coordinator: ClusterCoordinator) -> bool:
        """Wait until no step is queued or running; False if the chief is being stopped meanwhile."""
        return coordinator.join(give_up=self.stop.is_set)

    @staticmethod
    def _stop_scheduling(coordinator: ClusterCoordinator) -> None:
        """Stopping (SIGTERM): drop the steps not started and wait a little for those running; the workers are
        stopping too, and a step they refuse now would wait forever for another worker."""
        coordinator.settle(STOP_JOIN)

    def _checkpoint_on_stop(self, coordinator: ClusterCoordinator) -> None:
        """Stopped before the end (psctl down, a preempted or requeued Slurm job): a last checkpoint if nothing
        is in flight, so the next start resumes exactly here; the ps still serve for a moment (see leave)."""
        assert self.checkpointer is not None
        if self._stopped_with_checkpoint:  # the hand-over to a leaving ps took it, and nothing ran since
            return
        if coordinator.in_flight():
            log.warning("stopping without a final checkpoint: %d step(s) still in flight", coordinator.in_flight())
            return
        try:
            self._checkpoint()
            self.checkpointer.wait()
        except (PsUnavailable, PsFailure, grpc.RpcError, OSError) as exc:
            log.warning("stopping without a final checkpoint: %s", exc)
            return
        log.info("stopping: checkpoint %s taken at global step %d", self.checkpointer.latest, self.meter.global_step)

    def _train_sync(self, coordinator: ClusterCoordinator) -> None:
        """One round per global step: schedule its steps (``_replicas_per_round``), wait until every PS applied
        the step (R fresh gradients averaged), drop the round's unstarted steps. Stragglers' late gradients are
        stale and dropped by the PS. Missing replicas: after replica_timeout the step proceeds with what arrived if at
        least min_replicas did, else training fails saying so."""
        cfg = self.config
        r = int(cfg.replicas_to_aggregate or len(self.info.workers))
        min_replicas = int(cfg.min_replicas or r)
        timeout = float(cfg.replica_timeout or 60.0)
        while not self.stop.is_set():
            step = self.ps.state(0).global_step
            if step >= cfg.steps:
                break
            if self._ps_wanted is not None:
                self._reshard(coordinator)
                continue
            # One step per live worker, at least the R aggregated: the workers beyond R are the backups, racing
            # the slow ones, as in TensorFlow. More would be computed after a worker's own batch, always too late,
            # and the same data shard's batches would be the ones dropped every round (with one worker of three
            # left and N = 3, R = 2: a third of the data read and never trained on).
            n = max(r, coordinator.live_workers())
            if self._leaving and self.checkpointer is not None:
                self._hand_over(coordinator)
                continue
            if self.checkpointer is not None and self.checkpointer.due(step):
                self._checkpoint()  # between rounds nothing fresh is in flight: the PS are consistent
            for _ in range(n):
                coordinator.schedule("train", sync_step=step)
            # The replica timeout counts from the round's first gradient (missing replicas are the ones that
            # did not follow it); a round with none at all gets the start-up allowance on top.
            results_before = self.meter.steps
            scheduled_at = time.monotonic()
            first_arrival: float | None = None
            while True:
                with self._advanced:  # wake on the result that completed the round (no missed notification)
                    done = self._advanced.wait_for(partial(self._past, step), timeout=0.5)
                if done or self.stop.is_set():
                    break
                coordinator.check()  # raises a non-retryable error, or PsFailure
                now = time.monotonic()
                if first_arrival is None and self.meter.steps > results_before:
                    first_arrival = now
                waited = now - first_arrival if first_arrival is not None else now - scheduled_at - FIRST_ROUND_GRACE
                if waited > timeout:
                    self._flush_short_step(step, r, min_replicas, timeout)
                    break
            coordinator.drop_queued()
        if self.stop.is_set():
            self._stop_scheduling(coordinator)

    def _past(self, step: int) -> bool:
        """Every PS has applied ``step`` (caller holds ``_advanced``)."""
        return min(self._ps_steps) > step

    def _flush_short_step(self, step: int, r: int, min_replicas: int, timeout: float) -> None:
        """All or nothing: flush only if every PS still at ``step`` has at least ``min_replicas``."""
        states = [self.ps.state(i) for i in range(len(self.ps.addresses))]
        behind = [s for s in states if s.global_step == step]
        arrived = min((s.pending_replicas for s in behind), default=r)
        if arrived < min_replicas:
            raise StepError(
                "chief",
                f"synchronous step {step}: only {arrived} of {r} replicas arrived within {timeout:.0f}s "
                f"(min_replicas {min_replicas}); lower training.min_replicas or raise training.replica_timeout, "
                "and check the workers' logs",
            )
        replies = self.ps.sync_flush(step, min_replicas)
        if not all(reply.applied for reply in replies):  # a replica was dropped in between: say so
            raise StepError("chief", f"synchronous step {step}: the ps disagreed on the replicas that arrived")
        with self._advanced:
            self._ps_steps = [max(mine, reply.global_step) for mine, reply in zip(self._ps_steps, replies, strict=True)]
        log.warning("step %d proceeded with %d of %d replicas after %.0fs", step, arrived, r, timeout)

    def _checkpoint(self) -> None:
        """Snapshot with nothing in flight (consistent), then write in the background."""
        assert self.checkpointer is not None
        snapshot = take_snapshot(self.model, self.ps)
        snapshot.meta = self._meta()
        self.checkpointer.save_async(snapshot)

    def _resumed_at(self, step: int) -> None:
        """Training (re)starts at ``step``: rates, and the checkpoint interval, count from here."""
        self.meter.reset(step)
        with self._advanced:
            self._ps_steps = [step] * len(self.ps.addresses)
        if self.checkpointer is not None:
            self.checkpointer.mark(step)

    def _init_or_restore(self, *, ps_lost: bool = False) -> None:
        """Make every PS hold a consistent model: keep it if all have it (a restarted chief), else restore
        all from the latest valid checkpoint, else start all from their initializers. ``ps_lost``: training
        lost a ps (a restore then counts in ``restores`` even where no ps kept anything: a cluster of one ps)."""
        cfg = self.config
        specs = self.model.shard_specs(cfg.seed)
        r = int(cfg.replicas_to_aggregate or len(self.info.workers)) if cfg.mode == "sync" else 0
        distinct = bool(cfg.distinct_replicas)
        try:
            replies = self.ps.init(specs, cfg.optimizer_proto(), self.info.cluster_id,
                                   replicas_to_aggregate=r, distinct_replicas=distinct)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.INVALID_ARGUMENT:  # (RESOURCE_EXHAUSTED: memory short now, a restart may do)
                raise VariablesRefused(f"the ps refused the model's variables: {exc.details()}") from None  # type: ignore[attr-defined]
            if code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            # another layout of the variables (a chief lost while it resharded for psctl scale): the
            # checkpoint it took at the pause goes onto this layout
            log.warning("the ps hold another layout of the variables (%s): restoring the latest checkpoint",
                        exc.details())  # type: ignore[attr-defined]
            replies = self.ps.init(specs, cfg.optimizer_proto(), self.info.cluster_id, reset=True,
                                   replicas_to_aggregate=r, distinct_replicas=distinct)
            replies[0].already_initialized = True  # (counted as a restore below)
        kept = [r.already_initialized for r in replies]
        one_model = len({r.model_id for r in replies if r.model_id}) <= 1  # (0: a ps of an older psctl says none)
        if all(kept) and not one_model:
            log.warning("the ps hold parts of different models (a restore of every ps cut short by the loss of "
                        "the chief doing it): the latest checkpoint goes onto every ps")
        held = replies[0].global_step if all(kept) and one_model else None  # every ps holds the model, at this step
        if self.checkpointer is not None:
            self.checkpointer.wait()  # a checkpoint still being written counts
        # The ps hold nothing (or not all of them), or hold less than a checkpoint: a chief that died between
        # initialising them and restoring into them left them at their initializers, which must not count as
        # the model (its successor would train again from there). The checkpoints' names are read first: the
        # newest one is loaded (and verified, the whole model) only when it may be ahead.
        ahead = held is None or self._checkpoint_ahead_of(held)
        found = None
        if ahead and self.checkpointer is not None:
            found, damaged = restorable_checkpoint(self.checkpointer.directory)
            self.damaged_checkpoints += damaged
            if damaged and found is None:
                log.warning("no checkpoint in %s verifies (%d tried; the damaged set aside as %s*): training starts "
                            "from the initializers", self.checkpointer.directory, len(damaged), DAMAGED_PREFIX)
        if held is not None and (found is None or found[1].global_step <= held):
            log.info("every ps holds the variables: resuming at global step %d", held)
            return
        if found is not None:
            path, snapshot = found
            try:
                self._check_fits(snapshot)  # (before any ps takes its part)
                restore_snapshot(self.model, self.ps, snapshot)
            except CheckpointError as exc:
                raise CheckpointMismatch(
                    f"checkpoint {path} does not fit this spec: {exc}; resume it with the spec it was trained "
                    "with, or train afresh into another training.checkpoint.dir (or under another cluster name)"
                ) from None
            self.restores += ps_lost or any(kept)
            if held is not None:
                log.warning("the ps held the model at global step %d, behind the checkpoint: a restore was cut "
                            "short", held)
            log.info("restored %s (global step %d)", path, snapshot.global_step)
        elif any(kept) or ps_lost:
            if any(kept):  # (those that lost nothing are set back too: one model)
                self.ps.init(specs, cfg.optimizer_proto(), self.info.cluster_id, reset=True,
                             replicas_to_aggregate=r, distinct_replicas=distinct)
            self.restores += 1
            log.warning("no checkpoint to restore: every ps starts again from its initializers")

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint records of the run besides the model: what resuming it must match."""
        return {"optimizer": self.config.optimizer, "program": self.config.program, "data_shards": self.data_shards,
                "batch_size": self.config.batch_size}

    def _check_fits(self, snapshot: Snapshot) -> None:
        """CheckpointError unless ``snapshot`` can go on training under this spec: the same variables (of its
        program), data shards and batch size (its data positions count batches of each shard), optimizer (its
        slots are that optimizer's state, whatever their names: momentum's and Adagrad's are both ``accum``).
        What a checkpoint of an older psctl does not record is not compared."""
        meta, cfg = snapshot.meta, self.config
        try:
            check_variables(self.model, snapshot)
        except CheckpointError as exc:
            trained_by = meta.get("program")
            if trained_by and trained_by != cfg.program:
                raise CheckpointError(f"{exc} (it was trained by program {trained_by}, this spec's is "
                                      f"{cfg.program})") from None
            raise
        self._check_data_shards(snapshot)
        batch = meta.get("batch_size")
        if batch is not None and batch != cfg.batch_size:
            raise CheckpointError(f"it read its data in batches of {batch}, this spec's are of {cfg.batch_size} "
                                  f"(its data positions count batches): set training.batch_size: {batch} to resume "
                                  "it")
        optimizer = (meta.get("optimizer") or {}).get("name")
        if optimizer is not None and optimizer != cfg.optimizer["name"]:
            raise CheckpointError(f"it was trained with training.optimizer {optimizer}, this spec's is "
                                  f"{cfg.optimizer['name']} (its optimizer state is {optimizer}'s)")
        self._check_slots(snapshot)

    def _check_data_shards(self, snapshot: Snapshot) -> None:
        """CheckpointError unless ``snapshot`` read its data in this run's number of shards: as it records it, or
        (a checkpoint older than that record) at least as many as the shards its positions show read."""
        read_in = snapshot.meta.get("data_shards")
        if read_in is None:
            read = [i for i, p in enumerate(snapshot.shard_positions) if p >= 0]
            read_in = read[-1] + 1 if read and read[-1] >= self.data_shards else self.data_shards
        if read_in != self.data_shards:
            raise CheckpointError(
                f"it read its data in {read_in} shards, this run would split it in {self.data_shards} "
                f"(training.data_shards, or one per worker): set training.data_shards: {read_in} to resume it")

    def _check_slots(self, snapshot: Snapshot) -> None:
        """CheckpointError unless every variable's optimizer slots in ``snapshot`` are this run's optimizer's."""
        opt = self.config.optimizer_proto()
        wanted = set(make_optimizer(opt.name, opt.learning_rate, dict(opt.params)).slot_names)
        for name in self.model.layouts:
            have = set(snapshot.slots.get(name, {}))
            if have != wanted:
                raise CheckpointError(f"{name!r} has the optimizer slots {sorted(have)} there, training.optimizer "
                                      f"{opt.name} keeps {sorted(wanted)}")

    def _checkpoint_ahead_of(self, step: int) -> bool:
        """Whether the newest checkpoint's name says a global step past ``step`` (read without loading it)."""
        if self.checkpointer is None:
            return False
        listed = list_checkpoints(self.checkpointer.directory)
        return bool(listed) and step_of(listed[-1]) > step

    def _sync_counters(self) -> dict[str, int] | None:
        if self.config.mode != "sync":
            return None
        return sync_counters(self.ps.state(0))  # (every ps counts the same; a restored one from the checkpoint's)

    def _on_result(self, closure: Closure, response: Any, worker: int) -> None:
        if closure.function == "train":
            self._call_size.observe(max(1, response.steps), response.step_seconds)
            with self._advanced:
                self.meter.record(loss=response.loss, examples=response.examples, global_step=response.global_step,
                                  steps=max(1, response.steps))
                # (the heartbeats' step as it moves, not only at the next progress report: a run that fails
                # before it showed step 0 while checkpoints stood at step 213)
                PROGRESS.global_step = self.meter.global_step
                for ps, step in enumerate(response.ps_global_steps):
                    self._ps_steps[ps] = max(self._ps_steps[ps], step)
                self._advanced.notify_all()

    def _report(self, *, final: bool = False) -> None:
        report = self.meter.report(final=final)
        PROGRESS.global_step = int(report["global_step"])
        PROGRESS.loss = float(report["loss"])
        PROGRESS.steps_per_second = float(report["steps_per_sec"])
        PROGRESS.status = "done" if final else "training"
        record = {"time": time.time(), "event": "progress", **report}
        if self.config.mode != "sync":
            record["steps_per_call"] = self._call_size.last
        if self.checkpointer is not None and self.checkpointer.failed:  # (status shows it while training runs)
            latest = self.checkpointer.latest
            record["checkpoint_failures"] = {"count": self.checkpointer.failed, "last": self.checkpointer.last_error,
                                             "latest": str(latest) if latest else None}
        self.metrics.write(record)
        self._scalars(record)
        if not final:
            log.info(
                "step %d loss %s %.1f steps/s %.0f examples/s",
                report["global_step"], metric_text(report["loss"]), report["steps_per_sec"], report["examples_per_sec"],
            )

    def _scalars(self, record: dict[str, Any]) -> None:
        """The progress, and each worker's steps/s since the last report, for TensorBoard (when installed)."""
        if not self.tensorboard.enabled:
            return
        scalars: dict[str, float] = {k: record[k] for k in ("loss", "steps_per_sec", "examples_per_sec") if k in record}
        coordinator, now = self._coordinator, time.monotonic()
        if coordinator is not None:
            seconds = max(1e-6, now - self._rates_at)
            for w in coordinator.workers:
                done = w.steps - self._worker_steps.get(w.index, 0)
                scalars[f"workers/worker-{w.index}/steps_per_sec"] = done / seconds
                self._worker_steps[w.index] = w.steps
        self._rates_at = now
        self.tensorboard.add(int(record.get("global_step", 0)), scalars, wall_time=record["time"])

    def _report_loop(self) -> None:
        while not self._reporting_done.wait(self.config.log_every_seconds):
            self._report()
            self._look_for_leaving_ps()

    def _look_for_leaving_ps(self) -> None:
        if self.stop.is_set():  # stopping too (psctl down): a leaving ps must not wait for this chief
            self._release(sorted(self._leaving))
            return
        for index in range(len(self.ps.addresses)):
            try:
                if self.ps.state(index).leaving:
                    self._leaving.add(index)
            except PsUnavailable:
                continue

    def _release(self, leaving: list[int]) -> None:
        """Tell leaving ps they may go (their state is checkpointed, or this chief is stopping too)."""
        self._tell_ps(leaving, release=True)

    def _tell_ps(self, indices: list[int], *, release: bool = False, training_over: bool = False) -> None:
        """Say ``release`` or ``training_over`` (StateRequest) to each of ps ``indices``; best effort: one that
        is unavailable hears nothing, and waits at most its grace when stopped."""
        for index in indices:
            with contextlib.suppress(PsUnavailable):
                self.ps.state(index, release=release, training_over=training_over, timeout=2.0)

    def _hand_over(self, coordinator: ClusterCoordinator) -> None:
        """A ps is leaving (preempted) and waits for it: with nothing in flight, checkpoint every ps, wait until
        the leaving ones are gone, and restore that checkpoint into their successors: no step is recomputed."""
        leaving = sorted(self._leaving)
        if not self._join(coordinator):
            return
        assert self.checkpointer is not None
        self._checkpoint()
        self.checkpointer.wait()
        log.info("ps %s preempted: checkpoint %s taken before it left", leaving, self.checkpointer.latest)
        self._release(leaving)
        deadline = time.monotonic() + self.ps_wait
        while time.monotonic() < deadline and not self.stop.is_set():
            try:
                if not any(self.ps.state(i).leaving for i in leaving):
                    break  # its successor answers already
            except PsUnavailable:
                break  # gone
            self.stop.wait(0.1)
        self._leaving.clear()
        if self.stop.is_set():  # the chief is stopped too (the whole job is preempted): no successor will come
            self._stopped_with_checkpoint = True
            log.info("stopping: checkpoint %s taken at global step %d", self.checkpointer.latest,
                     self.meter.global_step)
            return
        self._restore_after_ps_loss(coordinator)

    def _follow_ps(self, addresses: dict[str, str]) -> None:
        """The supervisor's address map: a ps that moved is followed now; another ps count waits for the
        training loop to reshard (between steps)."""
        wanted = tasks_of("ps", addresses)
        if not wanted or sorted(wanted) != list(range(len(wanted))):
            return
        if len(wanted) == len(self.ps.addresses):
            self.ps.follow(addresses)
            self._ps_wanted = None  # (a scale undone before it was carried out)
            if self._coordinator is not None:  # a worker just started learns the layout from the steps
                self._coordinator.set_ps_addresses(self.ps.addresses)
        else:
            self._ps_wanted = [wanted[i] for i in range(len(wanted))]

    def _reshard(self, coordinator: ClusterCoordinator) -> None:
        """Move the variables onto another number of ps (psctl scale ps=N), losing nothing: with no step in
        flight, snapshot every variable and slot from the old layout, re-create the new layout on every ps of
        the new one, assign the snapshot split for it, check that what the new layout holds is the snapshot,
        and resume with the same global step and data positions."""
        addresses = self._ps_wanted
        assert addresses is not None
        cfg = self.config
        if not self._join(coordinator):
            return
        if self.checkpointer is not None:
            self.checkpointer.wait()
        before = take_snapshot(self.model, self.ps)
        before.meta = self._meta()
        if self.checkpointer is not None:  # a chief lost half-way restores this onto the layout it finds
            self.checkpointer.save_async(before)
            self.checkpointer.wait()
        old_count = len(self.ps.addresses)
        log.info("resharding from %d to %d ps at global step %d", old_count, len(addresses), before.global_step)
        model = ShardedModel(self.program, len(addresses), cfg.partitioner, cfg.placement)
        ps = PsClient(addresses, tls=self.info.tls, chief_incarnation=self.info.incarnation)
        try:
            ps.wait_ready(self.ps_wait)
            reshard_onto(before, model, ps, seed=cfg.seed, optimizer=cfg.optimizer_proto(),
                         cluster_id=self.info.cluster_id, distinct_replicas=bool(cfg.distinct_replicas),
                         replicas_to_aggregate=int(cfg.replicas_to_aggregate or 0) if cfg.mode == "sync" else 0)
        except CheckpointError as exc:  # never expected: stop rather than train on another model than the paused
            ps.close()
            raise StepError("chief", f"resharding onto {len(addresses)} ps: {exc}; training stopped at global "
                                     f"step {before.global_step} (the checkpoints hold the model)") from None
        except BaseException:
            ps.close()
            raise
        old, self.ps, self.model, self._ps_wanted = self.ps, ps, model, None
        old.close_later()  # the metrics thread may be asking it for a state now
        self._replaced.append(old)  # (closed at the end too: its pool's thread held the process at its exit)
        coordinator.set_ps_addresses(addresses)
        PROGRESS.metrics = {**PROGRESS.metrics, "ps_layout": len(addresses)}
        self._resumed_at(before.global_step)
        coordinator.recover(_cursors(list(before.shard_positions)))
        self.metrics.write({"time": time.time(), "event": "resharded", "from_ps": old_count, "to_ps": len(addresses),
                            "global_step": before.global_step, "variables": len(before.variables)})
        log.info("resharded from %d to %d ps at global step %d: every variable and slot verified",
                 old_count, len(addresses), before.global_step)

    def _restore_after_ps_loss(self, coordinator: ClusterCoordinator) -> None:
        """Wait for every ps (at its new address if it moved), restore them all, re-plan the queued steps.

        A ps can look ready and still fail the restore (a channel to a cut-off host stays open until keepalive
        gives up on it): that is retried until ``ps_wait`` has passed, then it is the training's failure."""
        deadline = time.monotonic() + self.ps_wait
        reached = self.meter.global_step
        while True:
            try:
                self.ps.wait_ready(max(1.0, deadline - time.monotonic()))
                self._init_or_restore(ps_lost=True)
                restored = self.ps.state(0)
                break
            except PsUnavailable as exc:
                if self.stop.is_set() or time.monotonic() >= deadline:
                    raise
                log.warning("restore not done yet (%s): retrying", exc)
                self.stop.wait(1.0)
        self._resumed_at(restored.global_step)
        again = max(0, reached - restored.global_step)
        self.recomputed_steps += again
        dropped = coordinator.recover(_cursors(list(restored.shard_positions)))
        log.info("resuming at global step %d: %d steps to train again (%d queued steps re-planned)",
                 restored.global_step, again, dropped)

    def close(self) -> None:
        self._unfollow_ps()
        for client in (*self._replaced, self.ps):
            client.close()
        self.metrics.close()


def _follow_workers(coordinator: ClusterCoordinator, addresses: dict[str, str]) -> None:
    """The workers the supervisor says there are, where it says they are (psctl scale adds and removes)."""
    workers = tasks_of("worker", addresses)
    if workers:
        coordinator.set_workers(workers)


"""The worker: runs steps the coordinator schedules — pull parameters, compute gradients, push them.

A step names the data shard and batch position it consumes. Datasets are deterministic, so any worker can
compute any shard's batch: a step re-run elsewhere after its worker died consumes exactly the data the dead
worker would have, and nothing is repeated or skipped.

Asynchronous steps of a model without embeddings cost one round trip per PS: each push brings back the variables
as they are right after it (PsClient.push_pull), and the worker's next step starts from the newest such variables
instead of pulling again, provided nothing could have replaced them meanwhile (same params epoch from the chief,
no PS failure since). They miss only the pushes of other workers that land between this worker's steps, the
staleness asynchronous training has anyway. In asynchronous training the chief keeps two steps on each worker:
the worker runs them one after the other (the second waits its turn, so the chief's round trip for the next
step overlaps this one, and nothing changes in what each step sees). With pipelined training
(``training.pipelined``) a step computes while the previous one's push is still on its way, on the newest
variables the worker has, so it misses the worker's own previous update too (one step more of staleness, for
communication that overlaps computation). A dense model's calls of several steps do it in one thread, step
after step, the calls one at a time; otherwise (one step per call, embeddings) the chief's two calls run at
once, a thread each.

A model with embeddings cannot reuse what a push brought back: the next batch needs other rows. Within a call
of several asynchronous steps, the worker reads the next step's batch ahead, and each push asks back that
batch's rows (and the dense shards) as they are right after the update: the next step pulls nothing, which is
what a pull sent right after the push would have read, in one round trip per PS instead of two. Where calls
run one at a time, a call's last push asks back the rows of the batch after it, kept for the next call if it
starts there (same data shard, same params epoch, as the dense variables are kept).

Status codes the coordinator relies on:
- FAILED_PRECONDITION "ps unavailable: ..." — a PS is down; the step can be retried once it is back.
- UNAVAILABLE "preempted: ..." — the worker is leaving (SIGTERM) and ran nothing of this step: hand it to
  another worker (not a retry: nothing is recomputed).
- PERMISSION_DENIED — this worker's incarnation was fenced off; it stops.
- RESOURCE_EXHAUSTED "out of memory: ..." — the step ran out of memory: the worker leaves, to be restarted.
- INVALID_ARGUMENT / INTERNAL — the program failed on this step: not retryable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import grpc
import numpy as np

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.coordinator import OUT_OF_MEMORY
from psctl.runtime.evaluation import evaluate_batch
from psctl.runtime.fencing import ChiefFence, ChiefReplaced
from psctl.runtime.heartbeat import PROGRESS, Progress
from psctl.runtime.limits import UNARY_MAX_BYTES
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Batch, Dataset, LowRankGrad, SparseGrad
from psctl.runtime.ps_client import PsClient, PsUnavailable, PushHeader
from psctl.runtime.rpc import CHIEF_MEMBER, caller, refuse_unless_from
from psctl.runtime.stepstats import StepStats
from psctl.runtime.wire import DENSE, IDS, Entry, payload_bytes

log = logging.getLogger("psctl.worker")


@dataclass(frozen=True)
class Prefetched:
    """The variables a push brought back, for the next step of the same params epoch."""

    epoch: int
    pulled: dict[int, list[Entry]]
    steps: dict[int, int]  # each PS's global step right after the push


@dataclass(frozen=True)
class _Computed:
    """A step computed and not yet pushed: what its push and its reply to the chief need."""

    start: float
    compute_start: float
    push_start: float
    loss: float
    examples: int
    header: PushHeader
    gradients: dict[int, list[Entry]]
    pushed_bytes: int
    plan: dict[int, list[Entry]]
    reuse: bool
    pulled_bytes: int


@dataclass(frozen=True)
class _Ahead:
    """The next step of a call, read ahead (where: params epoch, data shard, position): its batch, embedding ids
    and pull plan; once the previous step's push has answered, the variables it brought back for it and each
    PS's global step then."""

    epoch: int
    shard: int
    position: int
    batch: Batch
    ids: dict[str, np.ndarray]
    plan: dict[int, list[Entry]]
    pulled: dict[int, list[Entry]] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    #: How long reading it ahead took: the next step's input time, not the push it delayed.
    read_seconds: float = 0.0


@dataclass(frozen=True)
class _Pushed:
    """A step whose push is on its way: ``answers()`` waits for the PS' responses (and keeps the variables
    they bring back); ``sending``: the seconds sending it took."""

    step: _Computed
    answers: Callable[[], dict[int, pb.PushResponse]]
    sending: float


#: A worker that was asked for a step this recently is being fed by the chief (see WorkerServicer.drain).
FED_RECENTLY = 0.5
#: A step still running this long after the chief's deadline for it (it gave up and sent it elsewhere) hangs in
#: the program: the worker leaves, to be restarted, rather than hold a thread (and, one step at a time, itself)
#: and push that step's stale update later. Looked at this often.
HUNG_AFTER_DEADLINE = 2.0
HUNG_LOOK_EVERY = 0.5


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        model: ShardedModel,
        ps: PsClient,
        *,
        task: str,
        incarnation: int,
        batch_size: int,
        num_shards: int,
        on_fenced: threading.Event | None = None,
        progress: Progress = PROGRESS,
        chief_fence: ChiefFence | None = None,
        relayout: Callable[[Sequence[str]], tuple[ShardedModel, PsClient]] | None = None,
        serial: bool = True,
        on_first_step: Callable[[], object] | None = None,
        on_out_of_memory: Callable[[], object] | None = None,
        on_hung: Callable[[], object] | None = None,
    ) -> None:
        """``relayout(ps_addresses)``: the model and ps client of another ps layout (psctl scale ps=N), which a
        step from the chief may carry. ``serial``: training steps run one at a time (the chief keeps a second one
        queued here so that its round trip overlaps this worker's step); False
        for pipelined training, whose two steps compute at once. ``on_first_step``: called once, as the first
        training step begins (the worker then yields its CPU to the ps and the chief where they share it).
        ``on_out_of_memory``: called when a step ran out of memory (the process should end, to be restarted).
        ``on_hung``: called (from a thread of its own) when a step runs HUNG_AFTER_DEADLINE past the chief's
        deadline for it: the process must end at once (the step's thread cannot be stopped), to be restarted."""
        self.relayout = relayout
        self._on_first_step = on_first_step
        self._on_out_of_memory = on_out_of_memory
        #: A step ran out of memory: this process leaves as failed (restarted by its policy, counted).
        self.out_of_memory = False
        self._serial = threading.Lock() if serial else None
        self._pipeline = threading.Lock()
        self.model = model
        self.ps = ps
        self.task = task
        self.incarnation = incarnation
        self.batch_size = batch_size
        self.num_shards = num_shards
        self.progress = progress
        self.stats = StepStats(progress=progress)
        self.fenced = on_fenced or threading.Event()
        #: The newest chief heard of: a step or probe from an older (replaced) chief is refused.
        self.chief_fence = chief_fence or ChiefFence()
        self._datasets: dict[tuple[str, int], Dataset] = {}
        #: A step failed because a PS was unavailable: before the next, wait for the channels to reconnect
        #: (the chief resends work only after the PS is back and restored).
        self._ps_was_down = False
        self._prefetched: Prefetched | None = None
        #: The rows a call's last push brought back for the batch after it, and the params epoch of that call.
        self._rows_ahead: _Ahead | None = None
        self._lock = threading.Lock()
        #: Steps running now, whether the worker is leaving (see drain), and when a step was last asked of it.
        self._running = 0
        self._draining = False
        self._last_request = float("-inf")
        #: The chief said training is over: no step comes any more (drain need not wait for the last one).
        self.training_over = False
        self._steps = threading.Condition()
        self._on_hung = on_hung
        #: The deadline (monotonic) of each step call running now that has one, by call.
        self._deadlines: dict[object, float] = {}
        self._watchdog: threading.Thread | None = None

    def drain(self, timeout: float) -> int:
        """The worker is leaving (preempted): refuse new steps and probes from now on, so that the chief hands
        them to other workers, and wait up to ``timeout`` seconds for the steps running to finish (their
        updates land: nothing is recomputed). Then, unless the chief said training is over, it waits until the
        chief has stopped feeding it (no step asked for FED_RECENTLY seconds; the chief stops at its first
        "preempted"): a step sent as the server shuts down would be lost in flight and re-run, and the chief may
        have sent a second one (it keeps two steps on a worker) just before it heard. Returns how many steps
        were still running."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._steps:
            self._draining = True
            self._steps.wait_for(lambda: self._running == 0, timeout=max(0.0, deadline - time.monotonic()))
            while (self._running == 0 and time.monotonic() < deadline and not self.training_over
                   and time.monotonic() - self._last_request < FED_RECENTLY):
                self._steps.wait(0.05)
            return self._running

    def _leaving(self, context: grpc.ServicerContext) -> None:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"preempted: {self.task} is leaving")

    def dataset(self, split: str, shard: int) -> Dataset:
        key = (split, shard)
        with self._lock:
            if key not in self._datasets:
                self._datasets[key] = self.model.program.dataset(split, shard, self.num_shards)
            return self._datasets[key]

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        if request.training_over or request.feeding_stopped:
            refuse_unless_from(context, CHIEF_MEMBER, "a ping that says training is over or feeding stopped")
        if request.chief_incarnation >= self.chief_fence.newest:  # not a replaced chief's word
            if request.training_over:
                self.training_over = True
            if request.feeding_stopped:  # drain need not wait for the chief to stop sending steps: it has
                with self._steps:
                    self._last_request = float("-inf")
                    self._steps.notify_all()
        if self._draining:
            self._leaving(context)
        if caller(context) in (None, CHIEF_MEMBER):  # anyone may ask if it is up; only the chief's word teaches
            self.chief_fence.learn(request.chief_incarnation)
        return pb.PingResponse(incarnation=self.incarnation, task=self.task)

    def RunStep(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        refuse_unless_from(context, CHIEF_MEMBER, "RunStep")
        call = object()
        remaining = context.time_remaining()
        with self._steps:
            self._last_request = time.monotonic()
            self.training_over = False  # (a chief that trains again: one restored after the end was said)
            draining = self._draining
            if not draining:
                self._running += 1
                if remaining is not None and self._on_hung is not None:
                    self._deadlines[call] = self._last_request + remaining
                    self._watch_deadlines()
        if draining:
            self._leaving(context)
        try:
            return self._run_step(request, context)
        finally:
            with self._steps:
                self._running -= 1
                self._deadlines.pop(call, None)
                self._steps.notify_all()

    def _watch_deadlines(self) -> None:
        """Start the thread that looks for a step running past its deadline (once; caller holds _steps)."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._look_for_hung_steps, daemon=True,
                                              name=f"psctl-hung-steps-{self.task}")
            self._watchdog.start()

    def _look_for_hung_steps(self) -> None:
        while True:
            time.sleep(HUNG_LOOK_EVERY)
            with self._steps:
                due = min(self._deadlines.values(), default=None)
            late = time.monotonic() - due if due is not None else 0.0
            if late > HUNG_AFTER_DEADLINE:
                log.error("%s: a step is still running %.0fs past the chief's deadline for it, which sent it to "
                          "another worker (hung in the program?): leaving, to be restarted", self.task, late)
                assert self._on_hung is not None
                self._on_hung()
                return

    def _run_step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        if self.fenced.is_set():
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.task} incarnation {self.incarnation} is fenced")
        if not 0 <= request.shard < self.num_shards:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"shard {request.shard} out of range 0..{self.num_shards - 1}"
            )
        if request.function not in ("train", "evaluate"):  # (checked here: an abort in the try below is taken
            # for the program's own error)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown step function {request.function!r}")
        if request.steps > 1 and (request.sync_step or request.function != "train"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "several steps in one call are for asynchronous training steps only")  # fmt: skip
        try:
            self.chief_fence.admit(request.chief_incarnation)
            if request.function == "train":
                try:
                    return self._train(request)
                except BaseException:
                    with self._lock:  # the variables a push brought back may no longer be the PS's
                        self._prefetched, self._rows_ahead = None, None
                    raise
            return self._evaluate(request)
        except ChiefReplaced as exc:  # a PS refused this step's chief: tell that chief so, in the same words
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except PsUnavailable as exc:
            self._ps_was_down = True
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"ps unavailable: {exc}")
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code == grpc.StatusCode.PERMISSION_DENIED:
                self.fenced.set()
            if code == grpc.StatusCode.FAILED_PRECONDITION:  # a PS without variables: it was restarted
                self._ps_was_down = True
                context.abort(code, f"ps unavailable: {exc.details()}")  # type: ignore[attr-defined]
            context.abort(code, f"{self.task}: {exc.details()}")  # type: ignore[attr-defined]
        except MemoryError as exc:  # this process's resource, not the program's bug: another worker takes the step
            log.error("%s ran out of memory in a %s step (%s): it leaves, to be restarted", self.task,
                      request.function, exc)
            self.out_of_memory = True
            if self._on_out_of_memory is not None:
                self._on_out_of_memory()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{OUT_OF_MEMORY} {self.task} ran out of memory in a {request.function} step ({exc}): it "
                          "leaves, to be restarted")
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # the program's own code failed (or called
            # sys.exit, which in a server's thread went unseen and left the call unanswered): report it
            log.exception("program error in a %s step", request.function)  # (where: in the program's own lines)
            context.abort(grpc.StatusCode.INTERNAL, f"{self.task}: program error: {type(exc).__name__}: {exc} "
                                                    f"(traceback in {self.task.replace(':', '-')}'s log)")
        raise AssertionError("unreachable")

    def _follow_layout(self, addresses: Sequence[str]) -> None:
        """Take the chief's ps layout when its ps count differs (the chief resharded the variables: no step of
        the old layout is in flight then). A ps that moved is followed through the heartbeats' address map,
        which may be newer than the chief's."""
        if len(addresses) == self.model.num_ps or not addresses:
            return
        with self._lock:
            if len(addresses) == self.model.num_ps:
                return
            if self.relayout is None:
                raise ValueError(f"the chief's layout has {len(addresses)} ps, this worker {self.model.num_ps}")
            old = self.ps
            self.model, self.ps = self.relayout(addresses)
            self._prefetched, self._rows_ahead = None, None
        old.close_later()

    def _train(self, request: pb.StepRequest) -> pb.StepResponse:
        """One step, or ``request.steps`` consecutive ones (each with its own step id and batch, each pushed
        before the next starts); the reply sums them up."""
        one_thread = self._pipelines_in_one_thread(request)
        one_at_a_time = self._pipeline if one_thread else self._serial
        if one_at_a_time is None:
            return self._train_now(request, one_thread)
        with one_at_a_time:
            return self._train_now(request, one_thread)

    def _pipelines_in_one_thread(self, request: pb.StepRequest) -> bool:
        """Whether a pipelined call's steps run in this thread, each computed while the previous one's push
        travels (calls then run one at a time): where every push brings the next step's variables back (a
        dense model, asynchronous), and a call has several steps. Otherwise two calls run at once, a thread
        each: the same overlap, with the hand-offs between two threads' gRPC calls to pay (W1 on 2 cores: 4-8%
        more CPU per step; benchmarks/README.md)."""
        if self._serial is not None or request.steps <= 1:
            return False
        model = self.model
        if any(layout.variable.embedding for layout in model.layouts.values()):
            return False
        plan = model.pull_plan()
        return _reusable(request, plan, model.pull_bytes(plan))

    def _train_now(self, request: pb.StepRequest, one_thread: bool) -> pb.StepResponse:
        first, self._on_first_step = self._on_first_step, None
        if first is not None:
            first()
        self._follow_layout(request.ps_addresses)
        if self._ps_was_down:
            self.ps.wait_ready(5.0)
            self._ps_was_down = False
        count = max(1, request.steps)
        replies = self._train_pipelined(request, count) if one_thread else self._train_steps(request, count)
        if count == 1:
            return replies[0]
        last = replies[-1]
        return pb.StepResponse(
            loss=sum(r.loss for r in replies) / count,
            examples=sum(r.examples for r in replies),
            compute_seconds=sum(r.compute_seconds for r in replies),
            step_seconds=sum(r.step_seconds for r in replies),
            global_step=last.global_step,
            applied=any(r.applied for r in replies),
            ps_global_steps=last.ps_global_steps,
            steps=count,
        )

    def _train_steps(self, request: pb.StepRequest, count: int) -> list[pb.StepResponse]:
        """``count`` consecutive steps, each pushed before the next computes; each push brings back the next
        step's rows where it can (see _read_ahead)."""
        replies: list[pb.StepResponse] = []
        ahead = self._kept_ahead(request)
        # calls one at a time, of a params epoch: nothing else runs on this worker before the next call's first
        # step, and a new epoch tells when the variables may have been replaced meanwhile (see _kept_ahead)
        keep = self._serial is not None and request.params_epoch != 0
        for i in range(count):
            step = self._compute(request, request.step_id + i, request.position + i, ahead)
            last = i + 1 == count
            ahead = self._read_ahead(request, step, request.position + i + 1) if keep or not last else None
            if ahead is None:
                responses = self._push(request, step.header, step.gradients, step.plan if step.reuse else None)
                pushing = time.perf_counter() - step.push_start
            else:
                responses, after = self.ps.push_pull(step.header, step.gradients, ahead.plan)
                ahead = replace(ahead, pulled=after, steps={ps: r.global_step for ps, r in responses.items()})
                pushing = time.perf_counter() - step.push_start - ahead.read_seconds
            replies.append(self._finish(step, responses, pushing))
        if ahead is not None:
            with self._lock:
                self._rows_ahead = ahead
        return replies

    def _kept_ahead(self, request: pb.StepRequest) -> _Ahead | None:
        """The rows the previous call's last push brought back, if this call starts at that batch (same data
        shard, next position) in the same params epoch; taken either way (they are for one step only)."""
        with self._lock:
            kept, self._rows_ahead = self._rows_ahead, None
        if kept is None or request.params_epoch == 0:
            return None
        same = (kept.epoch, kept.shard, kept.position) == (request.params_epoch, request.shard, request.position)
        return kept if same else None

    def _read_ahead(self, request: pb.StepRequest, step: _Computed, position: int) -> _Ahead | None:
        """The step at ``position``, next in this call (or the next call's first, kept), read ahead so that
        ``step``'s push asks back its rows: for a model with embeddings (a dense model's push brings its shards
        back already), asynchronous, where each PS's push and answer fit one message. None where the next step
        pulls for itself."""
        if step.reuse or request.sync_step or not any(e.kind == IDS for es in step.plan.values() for e in es):
            return None
        started = time.perf_counter()
        try:
            batch, ids, plan = self._input(request, position)
        except Exception:  # the data may end here, or hold bad ids: the step that needs it, if one does, says so
            return None
        answers = self.model.pull_bytes(plan)
        for ps, asked in plan.items():
            sent = payload_bytes([*step.gradients.get(ps, []), *(e for e in asked if e.kind == IDS)])
            if max(sent, answers[ps]) > UNARY_MAX_BYTES:
                return None
        return _Ahead(request.params_epoch, request.shard, position, batch, ids, plan,
                      read_seconds=time.perf_counter() - started)

    def _input(
        self, request: pb.StepRequest, position: int
    ) -> tuple[Batch, dict[str, np.ndarray], dict[int, list[Entry]]]:
        """The batch at ``position`` of the request's data shard, its embedding ids, and what to pull for them."""
        batch = self.dataset("train", request.shard).batch(position, self.batch_size)
        ids = self.model.program.embedding_ids(batch)
        return batch, ids, self.model.pull_plan(ids)

    def _train_pipelined(self, request: pb.StepRequest, count: int) -> list[pb.StepResponse]:
        """``count`` consecutive steps in this thread, each computed while the previous one's push is on its way
        (on the newest variables a push brought back: one step more of staleness, as two steps at once have)."""
        replies: list[pb.StepResponse] = []
        pushed: _Pushed | None = None  # the step whose push is on its way
        try:
            for i in range(count):
                step = self._compute(request, request.step_id + i, request.position + i)
                if pushed is not None:
                    replies.append(self._answered(pushed))
                    pushed = None
                pushed = self._start_push(request, step)
            assert pushed is not None
            replies.append(self._answered(pushed))
            pushed = None
        finally:
            if pushed is not None:  # a later step failed: the push already sent lands or fails, not unseen
                with contextlib.suppress(Exception):
                    pushed.answers()
        return replies

    def _answered(self, pushed: _Pushed) -> pb.StepResponse:
        """The reply for a step whose push went ahead of the next step's compute, once its answers are in."""
        waited = time.perf_counter()
        responses = pushed.answers()
        return self._finish(pushed.step, responses, pushed.sending + time.perf_counter() - waited)

    def _compute(self, request: pb.StepRequest, step_id: int, position: int, ahead: _Ahead | None = None) -> _Computed:
        """A step up to its push: its batch, its variables (``ahead``: read ahead, brought back by the previous
        push), its loss and gradients."""
        start = time.perf_counter()
        program = self.model.program
        if ahead is not None and ahead.position == position and ahead.pulled:
            start -= ahead.read_seconds  # its input was read during the previous step's push
            batch, ids, plan = ahead.batch, ahead.ids, ahead.plan
            reuse, expected = False, {}  # (its bytes came with the previous push's answer)
            pulled, steps = ahead.pulled, ahead.steps
        else:
            batch, ids, plan = self._input(request, position)
            expected = self.model.pull_bytes(plan)
            reuse = _reusable(request, plan, expected)
            pulled, steps = self._variables(request, plan, expected, reuse)
        params = self.model.assemble(ids, pulled)
        compute_start = time.perf_counter()
        loss, grads = program.loss_and_grads(params, batch)
        push_start = time.perf_counter()
        header = PushHeader(
            step_id=step_id,
            task=self.task,
            incarnation=self.incarnation,
            # synchronous: every PS gets the round's step (a late step is stale everywhere, not only on some)
            local_steps={ps: request.sync_step - 1 for ps in steps} if request.sync_step else steps,
            shard=request.shard,
            position=position,
            chief_incarnation=request.chief_incarnation,
        )
        return _Computed(start, compute_start, push_start, float(loss), len(next(iter(batch.values()))), header,
                         self.model.push_plan(grads), sum(_nbytes(g) for g in grads.values()), plan, reuse,
                         0 if reuse else sum(expected.values()))

    def _finish(self, step: _Computed, responses: dict[int, pb.PushResponse], pushing: float) -> pb.StepResponse:
        """A step whose push was answered (``pushing``: the seconds spent sending it and waiting for its answer):
        its timings and progress recorded, its reply to the chief."""
        first = responses[0]
        compute = step.push_start - step.compute_start
        self.stats.record(pull=step.compute_start - step.start, compute=compute, push=pushing,
                          nbytes=step.pulled_bytes + step.pushed_bytes)
        p = self.progress  # what this worker's heartbeats report
        p.local_step += 1
        p.global_step = first.global_step
        p.loss = step.loss
        p.status = "training"
        return pb.StepResponse(
            loss=step.loss,
            examples=step.examples,
            compute_seconds=compute,
            step_seconds=step.push_start - step.start + pushing,  # (not the next step's compute meanwhile)
            global_step=first.global_step,
            applied=any(r.applied for r in responses.values()),
            ps_global_steps=[responses[ps].global_step for ps in sorted(responses)],
            steps=1,
        )

    def _variables(
        self, request: pb.StepRequest, plan: dict[int, list[Entry]], expected: dict[int, int], reuse: bool
    ) -> tuple[dict[int, list[Entry]], dict[int, int]]:
        """The step's variables and each PS's global step: what the previous push brought back if they may be
        reused (and are of this epoch), else pulled."""
        with self._lock:
            prefetched = self._prefetched  # the newest; a concurrent (pipelined) step may use it too
        if reuse and prefetched is not None and prefetched.epoch == request.params_epoch:
            return prefetched.pulled, prefetched.steps
        return self.ps.pull_with_steps(plan, expected)

    def _push(
        self,
        request: pb.StepRequest,
        header: PushHeader,
        gradients: dict[int, list[Entry]],
        plan: dict[int, list[Entry]] | None,
    ) -> dict[int, pb.PushResponse]:
        """Push the gradients; with the step's pull ``plan``, also bring its shards back for the next step."""
        if plan is None:
            return self.ps.push(header, gradients)
        responses, after = self.ps.push_pull(header, gradients, plan)
        self._keep(request, responses, after)
        return responses

    def _start_push(self, request: pb.StepRequest, step: _Computed) -> _Pushed:
        """``_push`` of a step whose shards come back, sent now: its answers are waited for later."""
        answers = self.ps.start_push_pull(step.header, step.gradients, step.plan)

        def done() -> dict[int, pb.PushResponse]:
            responses, after = answers()
            self._keep(request, responses, after)
            return responses

        return _Pushed(step, done, time.perf_counter() - step.push_start)

    def _keep(self, request: pb.StepRequest, responses: dict[int, pb.PushResponse],
              after: dict[int, list[Entry]]) -> None:
        """Keep the variables a push brought back for the next step, unless newer ones are kept already."""
        steps = {ps: r.global_step for ps, r in responses.items()}
        with self._lock:
            newest = self._prefetched
            # pipelined pushes may come back out of order: keep the variables of the later update
            if newest is None or newest.epoch != request.params_epoch or sum(steps.values()) >= sum(
                    newest.steps.values()):
                self._prefetched = Prefetched(request.params_epoch, after, steps)

    def _evaluate(self, request: pb.StepRequest) -> pb.StepResponse:
        self._follow_layout(request.ps_addresses)
        start = time.perf_counter()
        batch = self.dataset("test", request.shard).batch(request.position, self.batch_size)
        metrics, global_step = evaluate_batch(self.model, self.ps, batch)
        return pb.StepResponse(
            loss=float(metrics.get("loss", float("nan"))),
            examples=len(next(iter(batch.values()))),
            metrics=metrics,
            step_seconds=time.perf_counter() - start,
            global_step=global_step,
        )


def _nbytes(grad: object) -> int:
    """Bytes of a gradient: an array, an embedding's (ids, rows) or SparseGrad, a low-rank one's factors."""
    if isinstance(grad, tuple):
        return sum(_nbytes(part) for part in grad)
    if isinstance(grad, SparseGrad):  # (counted as 0: `top` showed an embedding model's worker at 0.02 MB/s)
        return _nbytes(grad.ids) + _nbytes(grad.values)
    if isinstance(grad, LowRankGrad):
        return _nbytes(grad.left) + _nbytes(grad.right)
    return int(getattr(grad, "nbytes", 0))


def _reusable(request: pb.StepRequest, plan: dict[int, list[Entry]], expected: dict[int, int]) -> bool:
    """Whether this step may bring back the variables for the next one: asynchronous (a synchronous step must
    see its round's variables), an epoch from the chief, only whole dense shards (embedding rows depend on the
    batch), each PS's small enough for one message."""
    return (
        request.sync_step == 0
        and request.params_epoch != 0
        and all(e.kind == DENSE for entries in plan.values() for e in entries)
        and max(expected.values(), default=0) <= UNARY_MAX_BYTES
    )

"""The worker: runs steps the coordinator schedules — pull parameters, compute gradients, push them.

A step names the data shard and batch position it consumes. Datasets are deterministic, so any worker can
compute any shard's batch: a step re-run elsewhere after its worker died consumes exactly the data the dead
worker would have, and nothing is repeated or skipped.

Status codes the coordinator relies on:
- FAILED_PRECONDITION "ps unavailable: ..." — a PS is down; the step can be retried once it is back.
- PERMISSION_DENIED — this worker's incarnation was fenced off; it stops.
- INVALID_ARGUMENT / INTERNAL — the program failed on this step: not retryable.
"""

from __future__ import annotations

import threading
import time

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.evaluation import evaluate_batch
from psctl.runtime.heartbeat import PROGRESS, Progress
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Dataset
from psctl.runtime.ps_client import PsClient, PsUnavailable, PushHeader


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
    ) -> None:
        self.model = model
        self.ps = ps
        self.task = task
        self.incarnation = incarnation
        self.batch_size = batch_size
        self.num_shards = num_shards
        self.progress = progress
        self.fenced = on_fenced or threading.Event()
        self._datasets: dict[tuple[str, int], Dataset] = {}
        #: A step failed because a PS was unavailable: before the next, wait for the channels to reconnect
        #: (the chief resends work only after the PS is back and restored).
        self._ps_was_down = False
        self._lock = threading.Lock()

    def dataset(self, split: str, shard: int) -> Dataset:
        key = (split, shard)
        with self._lock:
            if key not in self._datasets:
                self._datasets[key] = self.model.program.dataset(split, shard, self.num_shards)
            return self._datasets[key]

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse(incarnation=self.incarnation, task=self.task)

    def RunStep(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        if self.fenced.is_set():
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{self.task} incarnation {self.incarnation} is fenced")
        if not 0 <= request.shard < self.num_shards:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"shard {request.shard} out of range 0..{self.num_shards - 1}"
            )
        try:
            if request.function == "train":
                return self._train(request)
            if request.function == "evaluate":
                return self._evaluate(request)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown step function {request.function!r}")
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
        except Exception as exc:  # the program's own code failed: report it, do not crash the server
            context.abort(grpc.StatusCode.INTERNAL, f"{self.task}: program error: {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    def _train(self, request: pb.StepRequest) -> pb.StepResponse:
        if self._ps_was_down:
            self.ps.wait_ready(5.0)
            self._ps_was_down = False
        start = time.perf_counter()
        program = self.model.program
        batch = self.dataset("train", request.shard).batch(request.position, self.batch_size)
        ids = program.embedding_ids(batch)
        plan = self.model.pull_plan(ids)
        pulled, steps = self.ps.pull_with_steps(plan, self.model.pull_bytes(plan))
        params = self.model.assemble(ids, pulled)
        compute_start = time.perf_counter()
        loss, grads = program.loss_and_grads(params, batch)
        compute = time.perf_counter() - compute_start
        header = PushHeader(
            step_id=request.step_id,
            task=self.task,
            incarnation=self.incarnation,
            # synchronous: every PS gets the round's step (a late step is stale everywhere, not only on some)
            local_steps={ps: request.sync_step - 1 for ps in steps} if request.sync_step else steps,
            shard=request.shard,
            position=request.position,
        )
        responses = self.ps.push(header, self.model.push_plan(grads))
        first = responses[0]
        p = self.progress  # what this worker's heartbeats report
        p.local_step += 1
        p.global_step = first.global_step
        p.loss = float(loss)
        p.status = "training"
        return pb.StepResponse(
            loss=float(loss),
            examples=len(next(iter(batch.values()))),
            compute_seconds=compute,
            step_seconds=time.perf_counter() - start,
            global_step=first.global_step,
            applied=any(r.applied for r in responses.values()),
            ps_global_steps=[responses[ps].global_step for ps in sorted(responses)],
        )

    def _evaluate(self, request: pb.StepRequest) -> pb.StepResponse:
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

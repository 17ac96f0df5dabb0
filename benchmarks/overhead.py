"""Per-step framework overhead of W1 (MLP 784-100-10, batch 100, Adam): what a step costs beyond its numpy math.

    python -m benchmarks.overhead [--ps 1] [--steps 500] [--warmup 50]

Starts ``--ps`` ps and one worker as real ``python -m psctl.runtime`` processes, but no chief: this process
plays the chief. It initialises the PS (PsClient.init with ShardedModel.shard_specs, as the chief does) and
drives a psctl ClusterCoordinator, scheduling one step at a time (no queueing), so that for every step it
knows

- ``rtt``: schedule() -> on_result callback, the whole step as the chief's coordinator sees it;
- ``step``: the worker's StepResponse.step_seconds (batch + pull + assemble + compute + push);
- ``compute``: the worker's StepResponse.compute_seconds (the program's loss_and_grads only).

It prints the medians (and p90) of ``rtt - compute`` (the framework overhead the issue bounds at 1 ms),
``step - compute`` (the part spent inside the worker) and ``rtt - step`` (the chief->worker rpc and the
coordinator's hand-off). Then, as training runs, ``--steps`` steps queued at once, timed as a whole: the
per-step wall time minus the median compute, with one step in flight per worker (plain asynchronous training)
and with two (``training.pipelined``: a worker computes its next step while its last one's push travels), each
with one step per call from the chief and with ``--steps-per-execution`` (``training.steps_per_execution``).
For attribution it then times, from this process with the same payloads, one W1 pull
and one W1 push against the PS, and an empty Ping to the worker and GetState to the PS (bare rpc latency).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from benchmarks.common import (
    THREADS_HELP,
    Monitor,
    auto_or_count,
    bench_cluster,
    cpu_seconds,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    median,
    percentile,
    resolve_threads,
    rounded,
    run_as_role,
    run_directory,
)
from benchmarks.workloads import training_config
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.config import TrainingConfig
from psctl.runtime.coordinator import Closure, ClusterCoordinator
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Grads, ProgramRef, load_program
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.rpc import make_channel


def ms_stats(values: list[float]) -> dict[str, float | None]:
    return {"median": rounded(median(values) * 1e3), "p90": rounded(percentile(values, 90) * 1e3)}


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


#: The queued runs: (field of the result, steps in flight per worker, whether several steps go in one call).
QUEUED_RUNS = (
    ("queued_one_in_flight", 1, False),
    ("queued_pipelined_two_in_flight", 2, False),
    ("queued_per_execution_one_in_flight", 1, True),
    ("queued_per_execution_pipelined", 2, True),
)


def duplicates(client: PsClient) -> int:
    """Pushes every PS refused as already applied: a timed run must cause none (it would time no update)."""
    return sum(client.state(ps).duplicate_updates for ps in range(len(client.addresses)))


def queued_steps(
    new_coordinator: Callable[[int], ClusterCoordinator], in_flight: int, per_call: int, args: argparse.Namespace,
    compute: float, processes: dict[str, psutil.Process],
) -> dict[str, Any]:
    """``args.steps`` steps queued at once (after ``args.warmup``), timed as a whole: the steady per-step cost,
    and the CPU each of ``processes`` spent per step meanwhile. ``per_call``: steps per closure
    (training.steps_per_execution)."""
    coordinator = new_coordinator(in_flight)
    try:
        def schedule(count: int) -> None:
            for start in range(0, count, per_call):
                coordinator.schedule("train", steps=min(per_call, count - start))

        schedule(args.warmup)
        coordinator.join(timeout=600)
        cpu_before = {name: cpu_seconds(p) for name, p in processes.items()}
        start = time.perf_counter()
        schedule(args.steps)
        coordinator.join(timeout=600)
        per_step = (time.perf_counter() - start) / args.steps
    finally:
        coordinator.shutdown()
    cpu = {name: (cpu_seconds(p) - cpu_before[name]) / args.steps * 1e3 for name, p in processes.items()}
    return {
        "steps_per_s": rounded(1.0 / per_step, 1),
        "per_step_ms": rounded(per_step * 1e3),
        "per_step_minus_compute_ms": rounded((per_step - compute) * 1e3),
        "cpu_ms_per_step": {name: rounded(ms) for name, ms in cpu.items()},
        # the machine's floor for this rate: all the CPU a step takes, spread over every core
        "cpu_floor_per_step_ms": rounded(sum(cpu.values()) / (os.cpu_count() or 1)),
    }


def attribution(
    model: ShardedModel, client: PsClient, worker: str, ps: str, repeats: int, first_step_id: int
) -> dict[str, Any]:
    """Bare rpc latencies and one W1 pull / push, timed from this process (pushes numbered from
    ``first_step_id``, above every step id used before, so that each is applied)."""
    plan = model.pull_plan({})
    expected = model.pull_bytes(plan)
    pulled, _ = client.pull(plan, expected)
    params = model.assemble({}, pulled)
    grads: Grads = {name: np.zeros_like(np.asarray(value)) for name, value in params.items()}
    push_plan = model.push_plan(grads)
    step_id = [first_step_id]

    def push() -> None:
        step_id[0] += 1
        client.push(PushHeader(step_id=step_id[0], task="bench:0", incarnation=1), push_plan)

    worker_channel, ps_channel = make_channel(worker), make_channel(ps)
    try:
        worker_stub = pb_grpc.WorkerStub(worker_channel)
        ps_stub = pb_grpc.ParameterServerStub(ps_channel)
        for _ in range(20):  # warm the channels
            worker_stub.Ping(pb.PingRequest(), timeout=10)
            ps_stub.GetState(pb.StateRequest(), timeout=10)
        return {
            "payload_bytes": sum(expected.values()),
            "pull_ms": ms_stats(timed(lambda: client.pull(plan, expected), repeats)),
            "push_ms": ms_stats(timed(push, repeats)),
            "assemble_ms": ms_stats(timed(lambda: model.assemble({}, pulled), repeats)),
            "push_plan_ms": ms_stats(timed(lambda: model.push_plan(grads), repeats)),
            "worker_ping_ms": ms_stats(timed(lambda: worker_stub.Ping(pb.PingRequest(), timeout=10), repeats)),
            "ps_getstate_ms": ms_stats(timed(lambda: ps_stub.GetState(pb.StateRequest(), timeout=10), repeats)),
        }
    finally:
        worker_channel.close()
        ps_channel.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    training = training_config("w1", steps=args.warmup + args.steps, seed=args.seed)
    cfg = TrainingConfig.from_dict(training)
    program = load_program(ProgramRef(cfg.program, cfg.args, cfg.data, cfg.seed))
    with run_directory(args.run_dir) as run_dir, bench_cluster(
        run_dir, training, num_ps=args.ps, num_workers=1, with_chief=False, threads=args.threads
    ) as cluster:
        monitor = Monitor(cluster, poll_steps=False)
        cluster.start_all()
        monitor.start()
        model = ShardedModel(program, args.ps, cfg.partitioner)
        client = PsClient(cluster.jobs["ps"], timeout=60.0)
        done_at: dict[int, float] = {}
        responses: dict[int, pb.StepResponse] = {}
        lock = threading.Lock()

        def on_result(closure: Closure, response: pb.StepResponse, _worker: int) -> None:
            now = time.perf_counter()
            with lock:
                done_at[closure.step_id] = now
                responses[closure.step_id] = response

        # Every run numbers its steps above all earlier ones: a PS refuses step ids far below the newest it saw.
        step_id_bases = (k << 40 for k in itertools.count())

        def new_coordinator(in_flight: int) -> ClusterCoordinator:
            return ClusterCoordinator(cluster.jobs["worker"], on_result=on_result, steps_in_flight=in_flight,
                                      step_id_base=next(step_id_bases))  # fmt: skip

        try:
            client.wait_ready(60.0)
            client.init(model.shard_specs(cfg.seed), cfg.optimizer_proto(), cluster.cluster_id)
            coordinator = new_coordinator(1)
            try:
                if coordinator.wait_for_workers(60.0) < 1:
                    raise TimeoutError("the worker did not answer within 60s")
                rtt: list[float] = []
                step: list[float] = []
                compute: list[float] = []
                for i in range(1, args.warmup + args.steps + 1):
                    start = time.perf_counter()
                    coordinator.schedule("train").fetch(timeout=60)
                    with lock:
                        response, finished = responses[i], done_at[i]
                    if i > args.warmup:
                        rtt.append(finished - start)
                        step.append(response.step_seconds)
                        compute.append(response.compute_seconds)
            finally:
                coordinator.shutdown()
            processes = {"chief (this process)": psutil.Process()}
            processes.update({role.task: role.process for role in cluster.roles if role.process is not None})
            queued = {
                name: queued_steps(new_coordinator, in_flight, args.steps_per_execution if many else 1, args,
                                   np.median(compute), processes)
                for name, in_flight, many in QUEUED_RUNS
            }
            parts = attribution(model, client, cluster.jobs["worker"][0], cluster.jobs["ps"][0], args.repeats,
                                next(step_id_bases))  # fmt: skip
            refused = duplicates(client)
            if refused:
                raise RuntimeError(f"the PS refused {refused} timed pushes as already applied")
            cluster.check_alive()
        except BaseException:
            log(cluster.logs())
            raise
        finally:
            client.close()
            monitor.stop()
    rtt_a, step_a, compute_a = np.array(rtt), np.array(step), np.array(compute)
    overhead = rtt_a - compute_a
    return {
        "benchmark": "overhead_w1",
        "ps": args.ps,
        "workers": 1,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": cfg.batch_size,
        "threads_per_role": args.threads,
        "ok": True,
        "overhead_ms": rounded(median(list(overhead)) * 1e3),
        "target_ms": 1.0,
        "meets_target": bool(median(list(overhead)) <= 1e-3),
        "rtt_minus_compute_ms": ms_stats(list(overhead)),
        "step_minus_compute_ms": ms_stats(list(step_a - compute_a)),
        "rtt_minus_step_ms": ms_stats(list(rtt_a - step_a)),
        "compute_ms": ms_stats(compute),
        "step_ms": ms_stats(step),
        "rtt_ms": ms_stats(rtt),
        "sequential_steps_per_s": rounded(1.0 / median(rtt), 1),
        **queued,
        "pipelined_overhead_ms": queued["queued_pipelined_two_in_flight"]["per_step_minus_compute_ms"],
        "pipelined_meets_target": bool(queued["queued_pipelined_two_in_flight"]["per_step_minus_compute_ms"] <= 1.0),
        "steps_per_execution": args.steps_per_execution,
        "per_execution_overhead_ms": min(queued[name]["per_step_minus_compute_ms"]
                                         for name in ("queued_per_execution_one_in_flight",
                                                      "queued_per_execution_pipelined")),
        "from_this_process": parts,
        "peak_rss_mb": monitor.peak_rss_mb(),
        "machine": machine(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ps", type=int, default=1, help="number of ps (default 1)")
    parser.add_argument("--steps", type=int, default=500, help="timed steps (default 500)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps first (default 50)")
    parser.add_argument("--repeats", type=int, default=200, help="repeats of each attribution timing (default 200)")
    parser.add_argument("--threads", type=auto_or_count, default="auto", help=THREADS_HELP)
    parser.add_argument("--steps-per-execution", type=int, default=10,
                        help="steps per call for the queued runs with training.steps_per_execution (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", help="keep the roles' logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.ps < 1 or args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.steps_per_execution < 2:
        parser.error("--ps, --steps and --repeats must be >= 1, --steps-per-execution >= 2, --warmup >= 0")
    args.threads = resolve_threads(args.threads, args.ps + 2)  # the ps, one worker, this process as the chief
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_as_role("benchmarks.overhead", args.threads, argv)
    install_signal_handlers()
    return emit_all("overhead_w1", lambda: [run(args)])


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end training workloads on a fresh cluster of real processes; one JSON line of figures per run.

    python -m benchmarks.workloads w1 [--ps 1] [--workers 2] [--steps 3000]
    python -m benchmarks.workloads w2 [--ps 2] [--workers 2] [--steps 400] [--zipf 1.2]
    python -m benchmarks.workloads w3 [--ps 1] [--workers 1] [--steps 300]

Each run starts ``--ps`` ps, ``--workers`` workers and a chief as ``python -m psctl.runtime`` processes (with
PSCTL_CLUSTER as the launcher writes it), lets the chief train ``--steps`` steps and evaluate, then stops
everything. Figures (see benchmarks/README.md): steady steps/s and examples/s, start-to-first-step seconds,
peak RSS and CPU seconds per role, plus the parameters and the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    THREADS_HELP,
    BenchCluster,
    Monitor,
    auto_or_count,
    bench_cluster,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    resolve_threads,
    rounded,
    run_directory,
)
from psctl.launch.cpus import CPU_BINDINGS
from psctl.runtime.metrics import read_metrics

WORKLOADS = ("w1", "w2", "w3")
#: Defaults sized so that a run takes well under two minutes on a 2-core machine.
DEFAULTS: dict[str, dict[str, int]] = {
    "w1": {"ps": 1, "workers": 2, "steps": 3000},
    "w2": {"ps": 2, "workers": 2, "steps": 400},
    "w3": {"ps": 1, "workers": 1, "steps": 300},
}


def training_config(
    workload: str,
    *,
    steps: int,
    seed: int = 0,
    batch_size: int = 0,
    vocab: int = 1_000_000,
    zipf: float = 0.0,
    shards: int = 0,
) -> dict[str, Any]:
    """The chief's training section for a workload (see psctl/runtime/config.py for the keys). ``shards``: cut
    every variable in that many row ranges (fixed partitioner, placed round-robin over the ps); w2's table is
    always cut, in 2 by default."""
    common: dict[str, Any] = {"steps": steps, "mode": "async", "seed": seed, "log_every_seconds": 1.0}
    if shards or workload == "w2":
        common["partitioner"] = {"kind": "fixed", "num_shards": shards or 2}
    if workload == "w1":
        return {
            **common,
            "program": "psctl.models.mlp",
            "args": {"hidden_units": 100},
            "data": {"name": "synthetic_classification", "num_features": 784, "num_classes": 10},
            "batch_size": batch_size or 100,
            "optimizer": {"name": "adam", "learning_rate": 0.01},
        }
    if workload == "w2":
        return {
            **common,
            "program": "psctl.models.wide_embedding",
            "args": {"vocab_size": vocab, "dim": 64},
            "data": {"name": "synthetic_embedding", "vocab_size": vocab, "ids_per_example": 10, "zipf": zipf},
            "batch_size": batch_size or 512,
            "optimizer": {"name": "adagrad", "learning_rate": 0.05},
        }
    if workload == "w3":
        return {
            **common,
            "program": "psctl.models.mlp",
            "args": {"hidden_units": [1024, 1024]},
            "data": {"name": "synthetic_classification", "num_features": 1024, "num_classes": 10},
            "batch_size": batch_size or 64,
            "optimizer": {"name": "sgd", "learning_rate": 0.01},
        }
    raise ValueError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}")


def chief_figures(run_dir: Path, launched: float) -> dict[str, Any]:
    """What the chief itself recorded: its metrics records (once per log_every_seconds) and result.json."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "progress"]
    training = [r for r in records if (r.get("global_step") or 0) > 0]
    out: dict[str, Any] = {"first_metrics_record_s": None, "chief_steps_per_s": None}
    if training:
        out["first_metrics_record_s"] = rounded(training[0]["time"] - launched)
    if len(training) >= 2:
        first, last = training[0], training[-1]
        if last["time"] > first["time"]:
            rate = (last["global_step"] - first["global_step"]) / (last["time"] - first["time"])
            out["chief_steps_per_s"] = rounded(rate, 1)
    result_path = run_dir / "result.json"
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        out["chief_seconds"] = result.get("seconds")
        out["final_metrics"] = {k: rounded(float(v), 4) for k, v in (result.get("metrics") or {}).items()}
    return out


def startup(cluster: BenchCluster, launched: float, first_step: float | None) -> dict[str, Any]:
    """Where start-to-first-step goes, from the roles' own log timestamps (millisecond resolution)."""
    marks: dict[str, float | None] = {}
    for role in cluster.roles:
        marker = "training " if role.task_type == "chief" else "serving on"
        at = role.first_log_time(f"{role.task} starting")
        marks[f"{role.task} imported"] = rounded(at - launched) if at else None
        at = role.first_log_time(marker)
        marks[f"{role.task} {'scheduling' if role.task_type == 'chief' else 'serving'}"] = (
            rounded(at - launched) if at else None
        )
    marks["first_step"] = rounded(first_step - launched) if first_step else None
    # Steps the coordinator sent to a worker that was not serving yet: each costs a reconnect back-off.
    marks["worker_lost_events"] = cluster.role("chief").count_log_lines(" lost (")
    return marks


def cpu_ms_per_step(window_cpu: dict[str, float], steps: int) -> dict[str, float | None]:
    """CPU milliseconds per global step of each role over the measured window, and of all roles together."""
    if not steps or not window_cpu:
        return {}
    out: dict[str, float | None] = {task: rounded(1000 * cpu / steps, 2) for task, cpu in window_cpu.items()}
    out["total"] = rounded(1000 * sum(window_cpu.values()) / steps, 2)
    return out


def wait_for_chief(cluster: BenchCluster, timeout: float) -> int:
    chief = cluster.role("chief")
    deadline = time.monotonic() + timeout
    while True:
        rc = chief.popen.poll()
        if rc is not None:
            return rc
        cluster.check_alive(except_types=("chief",))
        if time.monotonic() > deadline:
            raise TimeoutError(f"the chief did not finish within {timeout:.0f}s")
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    training = training_config(
        args.workload, steps=args.steps, seed=args.seed, batch_size=args.batch_size, vocab=args.vocab,
        zipf=args.zipf, shards=args.shards or (max(2, args.ps) if args.workload == "w2" else 0),
    )
    training["pipelined"] = args.pipelined
    training["steps_per_execution"] = args.steps_per_execution
    training["placement"] = args.placement
    params = {
        "benchmark": args.workload,
        "ps": args.ps,
        "workers": args.workers,
        "steps": args.steps,
        "batch_size": training["batch_size"],
        "threads_per_role": args.threads,
        "pipelined": args.pipelined,
        "steps_per_execution": args.steps_per_execution,
        "placement": args.placement,
        "cpu_binding": args.cpu_binding,
        "program": Path(training["program"]).name if args.workload == "w3" else training["program"],
        "optimizer": training["optimizer"]["name"],
    }
    if args.workload == "w2":
        params.update(vocab=args.vocab, dim=64, ids_per_example=10, zipf=args.zipf)
    if "partitioner" in training:
        params["shards"] = training["partitioner"]["num_shards"]
    with run_directory(args.run_dir) as run_dir, bench_cluster(
        run_dir, training, num_ps=args.ps, num_workers=args.workers, threads=args.threads,
        cpu_binding=args.cpu_binding == "auto",
    ) as cluster:
        monitor = Monitor(cluster)
        launched = cluster.start_all()
        monitor.start()
        try:
            rc = wait_for_chief(cluster, args.timeout)
        except BaseException:
            log(cluster.logs())
            raise
        finally:
            monitor.stop()
        finished = time.time()
        if rc != 0:
            log(cluster.logs())
            raise RuntimeError(f"the chief exited with code {rc}")
        warm = max(1, round(args.steps * args.warmup_fraction))
        steps_per_s, counted, seconds = monitor.rate(warm, args.steps)
        window = monitor.window(warm, args.steps)
        window_cpu = monitor.cpu_between(window[0].time, window[1].time) if window else {}
        first = monitor.first_step_at()
        init = monitor.ps_initialized_at
        return {
            **params,
            "ok": True,
            "steps_per_s": rounded(steps_per_s, 1),
            "examples_per_s": rounded(steps_per_s * training["batch_size"], 0),
            "start_to_first_step_s": rounded(first - launched) if first else None,
            "start_to_ps_init_s": rounded(init - launched) if init else None,
            "startup_s": startup(cluster, launched, first),
            "measured": {"from_step": warm, "steps": counted, "seconds": rounded(seconds)},
            "wall_s": rounded(finished - launched),
            "peak_rss_mb": monitor.peak_rss_mb(),
            "cpu_s": monitor.cpu_seconds(),
            "cpu_ms_per_step": cpu_ms_per_step(window_cpu, counted),
            **chief_figures(run_dir, launched),
            "machine": machine(),
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("--ps", type=int, help="number of ps (default: w1 1, w2 2, w3 1)")
    parser.add_argument("--workers", type=int, help="number of workers (default: w1 2, w2 2, w3 1)")
    parser.add_argument("--steps", type=int, help="training steps (default: w1 3000, w2 400, w3 300)")
    parser.add_argument("--batch-size", type=int, default=0, help="override the workload's batch size")
    parser.add_argument("--threads", type=auto_or_count, default="auto", help=THREADS_HELP)
    parser.add_argument("--zipf", type=float, default=0.0,
                        help="w2: Zipf exponent of the ids (> 1), 0 for uniform ids (default)")
    parser.add_argument("--vocab", type=int, default=1_000_000, help="w2: embedding rows (default 1000000)")
    parser.add_argument("--shards", type=int, default=0,
                        help="cut every variable in N row shards, placed over the ps (default: w2 "
                             "max(2, ps), w1 and w3 none: each variable whole on one ps)")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="steps/s is measured from this fraction of the steps to the last (default 0.1)")
    parser.add_argument("--pipelined", action="store_true", help="training.pipelined: two steps in flight per worker")
    parser.add_argument("--steps-per-execution", type=auto_or_count, default="auto",
                        help="training.steps_per_execution: steps per call from the chief, or auto (the default: "
                             "sized from the steps' durations)")
    parser.add_argument("--placement", choices=("balanced", "round_robin"), default="balanced",
                        help="training.placement: by bytes (psctl's default) or TensorFlow's round-robin")
    parser.add_argument("--cpu-binding", choices=CPU_BINDINGS, default="auto",
                        help="roles.*.cpu_binding: auto (the default) binds each role to a CPU when the roles "
                             "outnumber this machine's CPUs, as psctl's agents do; none leaves them to the kernel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--run-dir", help="keep logs, metrics.jsonl and result.json here (default: a temp dir)")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ps < 1 or args.workers < 1 or args.steps < 1:
        parser.error("--ps, --workers and --steps must be >= 1")
    args.threads = resolve_threads(args.threads, args.ps + args.workers + 1)  # with the chief
    if args.zipf and args.zipf <= 1:
        parser.error("--zipf must be 0 (uniform) or > 1")
    return args


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    args = parse_args(argv)
    return emit_all(args.workload, lambda: [run(args)])


if __name__ == "__main__":
    sys.exit(main())

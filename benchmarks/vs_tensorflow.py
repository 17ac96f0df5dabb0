"""psctl against TensorFlow's ParameterServerStrategy, side by side on the same machine; one JSON line per workload.

    python -m benchmarks.vs_tensorflow [--workloads w1,w2,w2_zipf,w3] [--rounds 3]
        [--psctl-steps-per-execution auto] [--psctl-pipelined] [--tf-steps-per-execution 1]

Needs TensorFlow (``pip install -e '.[tensorflow]'``). For every round, every workload runs once on psctl
(``benchmarks.workloads``: psctl's runtime with its default options) and once on TensorFlow
(``benchmarks.tf_pss_chief`` as the chief, ``python -m psctl.tfserver`` as each ps and worker), the two
interleaved and their order swapped every round, so that the machine's drift hits both alike. The same cluster
sizes, models, optimizers, batches and data on both. Each line gives both steady rates (median of the rounds)
and their ratio, CPU milliseconds per step of each role during the measured steps, peak RSS per role and
start-to-first-step. Both systems run their defaults unless told otherwise: psctl sizes its calls to a worker
(``steps_per_execution: auto``) and binds each role to a CPU where they outnumber the CPUs (``cpu_binding:
auto``); TensorFlow's coordinator schedules one step per function, and its processes run where the kernel puts
them (bound to one CPU each, its parameter-server training hangs: its inter-op pool gets one thread). Give
TensorFlow several steps per function (``--tf-steps-per-execution K``, as Keras's ``steps_per_execution``), or
psctl none of its own (``--psctl-steps-per-execution 1 --psctl-cpu-binding none``), or psctl two steps in
flight per worker (``--psctl-pipelined``, ``training.pipelined``), to compare those too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.common import (
    REPO_ROOT,
    THREADS_HELP,
    BenchCluster,
    Monitor,
    auto_or_count,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    resolve_threads,
    rounded,
    run_directory,
)
from psctl.launch.cpus import CPU_BINDINGS


@dataclass(frozen=True)
class Workload:
    name: str
    program: str  # the workload of benchmarks.workloads
    ps: int
    workers: int
    steps: int
    zipf: float = 0.0


#: The issue's cluster sizes: W1 on 1 ps / 2 workers, W2 2/2, W2 with Zipf ids (s = 1.1) 1/2, W3 2/2.
WORKLOADS = {
    "w1": Workload("w1", "w1", ps=1, workers=2, steps=3000),
    "w2": Workload("w2", "w2", ps=2, workers=2, steps=600),
    "w2_zipf": Workload("w2_zipf", "w2", ps=1, workers=2, steps=600, zipf=1.1),
    "w3": Workload("w3", "w3", ps=2, workers=2, steps=300),
}


class TfCluster(BenchCluster):
    """A TensorFlow ParameterServerStrategy cluster: ``psctl.tfserver`` ps and workers, the workload's chief."""

    def __init__(self, run_dir: Path, workload: Workload, *, threads: int, steps_per_execution: int = 1) -> None:
        # never bound to CPUs: TensorFlow sizes its inter-op pool by the CPUs it may use, and its
        # parameter-server training hangs with one (observed bound to one CPU)
        super().__init__(run_dir, {}, num_ps=workload.ps, num_workers=workload.workers, threads=threads,
                         cpu_binding=False)
        self.workload = workload
        self.steps_per_execution = steps_per_execution

    def env(self, task_type: str, index: int) -> dict[str, str]:
        env = super().env(task_type, index)
        env.pop("PSCTL_CLUSTER", None)
        env["TF_CONFIG"] = json.dumps({"cluster": self.jobs, "task": {"type": task_type, "index": index}})
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        return env

    def command(self, task_type: str, index: int) -> list[str]:
        if task_type != "chief":
            return [sys.executable, "-m", "psctl.tfserver"]
        w = self.workload
        return [sys.executable, "-m", "benchmarks.tf_pss_chief", w.program, "--steps", str(w.steps),
                "--zipf", str(w.zipf), "--steps-per-execution", str(self.steps_per_execution)]


def threads_per_role(workload: Workload, args: argparse.Namespace) -> int:
    """The BLAS threads each role of ``workload`` gets, both systems (psctl's workloads resolve ``auto`` alike)."""
    return resolve_threads(args.threads, workload.ps + workload.workers + 1)


@contextlib.contextmanager
def tf_cluster(run_dir: Path, workload: Workload, args: argparse.Namespace) -> Iterator[TfCluster]:
    cluster = TfCluster(run_dir, workload, threads=threads_per_role(workload, args),
                        steps_per_execution=args.tf_steps_per_execution)
    try:
        yield cluster
    finally:
        cluster.close()


def chief_report(cluster: BenchCluster) -> dict[str, Any]:
    """The TensorFlow chief's JSON line (the last line of its log that is one)."""
    for line in reversed(cluster.role("chief").log_tail(20_000).splitlines()):
        if line.startswith('{"steps_per_s"'):
            return dict(json.loads(line))
    raise RuntimeError("the TensorFlow chief printed no result line:\n" + cluster.role("chief").log_tail())


def run_tensorflow(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    with run_directory(None) as run_dir, tf_cluster(run_dir, workload, args) as cluster:
        monitor = Monitor(cluster, poll_steps=False)
        launched = cluster.start_all()
        monitor.start()
        try:
            rc = workloads.wait_for_chief(cluster, args.timeout)
        except BaseException:
            log(cluster.logs())
            raise
        finally:
            monitor.stop()
        if rc != 0:
            log(cluster.logs())
            raise RuntimeError(f"the TensorFlow chief exited with code {rc}")
        report = chief_report(cluster)
        window_cpu = monitor.cpu_between(report["measured_from"], report["measured_to"])
        return {
            "steps_per_s": rounded(report["steps_per_s"], 1),
            "start_to_first_step_s": rounded(report["first_step_at"] - launched),
            "cpu_ms_per_step": workloads.cpu_ms_per_step(window_cpu, report["measured_steps"]),
            "peak_rss_mb": monitor.peak_rss_mb(),
        }


def run_psctl(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    argv = [workload.program, "--ps", str(workload.ps), "--workers", str(workload.workers),
            "--steps", str(workload.steps), "--threads", str(threads_per_role(workload, args)),
            "--timeout", str(args.timeout),
            "--steps-per-execution", str(args.psctl_steps_per_execution), "--cpu-binding", args.psctl_cpu_binding]
    if workload.zipf:
        argv += ["--zipf", str(workload.zipf)]
    if args.psctl_pipelined:
        argv.append("--pipelined")
    result = workloads.run(workloads.parse_args(argv))
    return {key: result[key] for key in ("steps_per_s", "start_to_first_step_s", "cpu_ms_per_step", "peak_rss_mb")}


def summary(workload: Workload, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One line per workload: medians over the rounds, per-round rates and ratios."""
    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[system])

    def per_role(system: str, key: str, pick: Any) -> dict[str, float | None]:
        tasks = rounds[system][0][key].keys()
        return {t: rounded(pick([r[key][t] for r in rounds[system] if r[key].get(t) is not None]), 2) for t in tasks}

    psctl_rate, tf_rate = med("psctl", "steps_per_s"), med("tensorflow", "steps_per_s")
    return {
        "benchmark": "vs_tensorflow",
        "workload": workload.name,
        "ps": workload.ps,
        "workers": workload.workers,
        "steps": workload.steps,
        "zipf": workload.zipf,
        "rounds": len(rounds["psctl"]),
        "psctl_steps_per_s": rounded(psctl_rate, 1),
        "tf_steps_per_s": rounded(tf_rate, 1),
        "ratio": rounded(psctl_rate / tf_rate, 2),
        "round_ratios": [rounded(p["steps_per_s"] / t["steps_per_s"], 2)
                         for p, t in zip(rounds["psctl"], rounds["tensorflow"], strict=True)],
        "psctl_rounds": [r["steps_per_s"] for r in rounds["psctl"]],
        "tf_rounds": [r["steps_per_s"] for r in rounds["tensorflow"]],
        "cpu_ms_per_step": {s: per_role(s, "cpu_ms_per_step", statistics.median) for s in rounds},
        "peak_rss_mb": {s: per_role(s, "peak_rss_mb", max) for s in rounds},
        "start_to_first_step_s": {s: rounded(med(s, "start_to_first_step_s"), 2) for s in rounds},
    }


def versions() -> dict[str, str]:
    """Of the packages that decide the figures (read from their metadata: this process never imports TF)."""
    out = {}
    for name in ("tensorflow", "tensorflow-cpu", "numpy", "grpcio", "protobuf"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    chosen = [WORKLOADS[name] for name in args.workloads]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w.name: {"psctl": [], "tensorflow": []} for w in chosen}
    runners = {"psctl": run_psctl, "tensorflow": run_tensorflow}
    for round_index in range(args.rounds):
        order = ["psctl", "tensorflow"] if round_index % 2 == 0 else ["tensorflow", "psctl"]
        for workload in chosen:
            for system in order:
                log(f"round {round_index + 1}/{args.rounds}: {workload.name} on {system}")
                started = time.monotonic()
                result = runners[system](workload, args)
                results[workload.name][system].append(result)
                log(f"  {result['steps_per_s']} steps/s ({time.monotonic() - started:.0f} s)")
    context = {"machine": machine(), "versions": versions(),
               "steps_per_execution": {"psctl": args.psctl_steps_per_execution,
                                       "tensorflow": args.tf_steps_per_execution},
               "pipelined": {"psctl": args.psctl_pipelined, "tensorflow": False},
               "cpu_binding": {"psctl": args.psctl_cpu_binding, "tensorflow": "none"}}
    for workload in chosen:
        yield {**summary(workload, results[workload.name]), "threads_per_role": threads_per_role(workload, args),
               **context}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--threads", type=auto_or_count, default="auto", help=THREADS_HELP + ", both systems")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a run after this many seconds")
    parser.add_argument("--psctl-steps-per-execution", default="auto",
                        help="psctl's training.steps_per_execution (default auto, psctl's default)")
    parser.add_argument("--tf-steps-per-execution", type=int, default=1,
                        help="steps per function TensorFlow's coordinator schedules (default 1, its default)")
    parser.add_argument("--psctl-pipelined", action="store_true",
                        help="psctl's training.pipelined: two steps in flight per worker (default off)")
    parser.add_argument("--psctl-cpu-binding", choices=CPU_BINDINGS, default="auto",
                        help="psctl's roles.*.cpu_binding (default auto, psctl's default)")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        parser.error(f"unknown workload(s) {', '.join(unknown)}: use {', '.join(WORKLOADS)}")
    if args.rounds < 1 or args.tf_steps_per_execution < 1:
        parser.error("--rounds and --tf-steps-per-execution must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    args = parse_args(argv)
    if importlib.util.find_spec("tensorflow") is None:
        print("benchmarks.vs_tensorflow: TensorFlow is not installed in this environment: "
              "pip install -e '.[tensorflow]' (or tensorflow-cpu)", file=sys.stderr)
        return 2
    os.chdir(REPO_ROOT)
    return emit_all("vs_tensorflow", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

"""Shared machinery of the benchmarks: a cluster of real ``python -m psctl.runtime`` processes, a monitor that
samples their memory and the global step, statistics, and the one-JSON-line output.

Every process is started in its own session (its own process group) and :meth:`BenchCluster.close` kills
every group it ever started (SIGTERM, then SIGKILL), also when the benchmark fails or is interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import psutil

from psctl.launch.cpus import (  # as agents bind roles
    CPUS_VARIABLE,
    ClusterCpus,
    cpu_list,
    host_slots,
)
from psctl.launch.env import default_threads, tuning_env  # as the supervisor gives roles
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.rpc import make_channel

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
MB = 1e6  # throughput figures are in MB/s of 10**6 bytes
MIB = 1 << 20


# -- environment ------------------------------------------------------------------------------------------
def thread_env(threads: int) -> dict[str, str]:
    """BLAS / OpenMP thread counts for a role: set deliberately, since every role shares the machine's cores."""
    return tuning_env(threads)


#: ``--threads`` help, the same for every benchmark.
THREADS_HELP = ("numpy/BLAS threads per role, or auto (default): the machine's CPUs shared out among the roles, "
                "at least 1, as psctl's launcher does")


def auto_or_count(value: str) -> int | str:
    """argparse type of an option that takes ``auto`` or a whole number >= 1 (``--threads``,
    ``--steps-per-execution``)."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number >= 1, got {value!r}")
    return int(value)


def resolve_threads(threads: int | str, roles: int) -> int:
    """BLAS threads per role for ``--threads``: the number given, or for ``auto`` the share psctl's launcher
    gives a role when ``roles`` run on this machine (psctl.launch.env.default_threads)."""
    return default_threads(os.cpu_count() or 1, roles) if threads == "auto" else int(threads)


#: Environment variables that change the figures (glibc malloc tuning), recorded with them when set.
RECORDED_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")


def machine() -> dict[str, Any]:
    """What the figures were measured on, and how busy the machine was (1-minute load average)."""
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    out: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    env = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
    if env:
        out["env"] = env
    return out


def run_as_role(module: str, threads: int, argv: Sequence[str] | None) -> None:
    """Re-execute ``python -m module`` with the environment a role gets (malloc thresholds, BLAS threads) unless
    this process has it already: the benchmark process plays a role itself (the worker in pushpull, the chief in
    overhead), and the launcher starts every role with that environment. Helper processes inherit it."""
    env = thread_env(threads)
    if any(os.environ.get(k) != v for k, v in env.items()):
        args = sys.argv[1:] if argv is None else argv
        os.execvpe(sys.executable, [sys.executable, "-m", module, *args], {**os.environ, **env})


def install_signal_handlers() -> None:
    """SIGTERM / SIGHUP unwind like Ctrl-C, so ``finally`` blocks stop every process the benchmark started."""

    def raise_exit(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, raise_exit)


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line (the benchmark's result) and flush it."""
    print(json.dumps(record, sort_keys=False), flush=True)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- statistics -------------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[rank])


def rounded(value: float, digits: int = 3) -> float | None:
    """JSON has no NaN: unknown figures become null."""
    return None if value != value else round(value, digits)


# -- ports ------------------------------------------------------------------------------------------------
def reserve_port() -> socket.socket:
    """A loopback port held open (bound, not listening) until its role is started.

    The reservation has no SO_REUSEPORT, so nothing else can bind the port, the role's gRPC server included:
    it is released just before the role starts (no unrelated process takes the port in the meantime, but for
    that instant, and a role never shares its port with a leftover socket of the benchmark).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


# -- the cluster --------------------------------------------------------------------------------------------
@dataclass
class Role:
    task_type: str
    index: int
    popen: subprocess.Popen[bytes]
    process: psutil.Process | None
    log_path: Path
    started_at: float  # time.time() just before the process was started
    peak_rss: int = 0
    cpu_seconds: float = 0.0

    @property
    def task(self) -> str:
        return f"{self.task_type}:{self.index}"

    def first_log_time(self, marker: str) -> float | None:
        """Wall time of the first line of this role's log containing ``marker`` (the runtime's logging format,
        ``2026-01-31 12:00:00,123 INFO ...``, in local time), or None."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if marker in line:
                with contextlib.suppress(ValueError):
                    stamp, millis = line[:23].split(",")
                    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        return None

    def count_log_lines(self, marker: str) -> int:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").count(marker)
        except FileNotFoundError:
            return 0

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


@dataclass
class StepSample:
    time: float  # time.time()
    global_step: int


class BenchCluster:
    """``num_ps`` ps, ``num_workers`` workers and (optionally) a chief, each a ``python -m psctl.runtime``."""

    def __init__(
        self,
        run_dir: Path,
        training: dict[str, Any],
        *,
        num_ps: int,
        num_workers: int,
        with_chief: bool = True,
        threads: int = 1,
        cluster_id: str = "",
        cpu_binding: bool = True,
    ) -> None:
        """``cpu_binding``: each role binds itself to a CPU when they outnumber this machine's, as under psctl's
        agents (psctl.launch.cpus)."""
        self.run_dir = Path(run_dir)
        self.cpu_binding = cpu_binding
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.training = dict(training)
        self.threads = threads
        self.cluster_id = cluster_id or f"bench-{uuid.uuid4().hex[:8]}"  # two benchmarks at once are two clusters
        self._cpus = ClusterCpus(self.cluster_id)
        self._reservations: dict[str, socket.socket] = {}
        self.jobs: dict[str, list[str]] = {}
        if with_chief:
            self.jobs["chief"] = [self._address()]
        if num_ps:
            self.jobs["ps"] = [self._address() for _ in range(num_ps)]
        if num_workers:
            self.jobs["worker"] = [self._address() for _ in range(num_workers)]
        self.roles: list[Role] = []

    def _address(self) -> str:
        sock = reserve_port()
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        self._reservations[address] = sock
        return address

    def env(self, task_type: str, index: int) -> dict[str, str]:
        config = {
            "cluster": self.jobs,
            "task": {"type": task_type, "index": index},
            "cluster_id": self.cluster_id,
            "incarnation": 1,
            "training": self.training,
            "run_dir": str(self.run_dir),
        }
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PSCTL_CLUSTER")}
        env.update(
            PSCTL_CLUSTER=json.dumps(config),
            PSCTL_CLUSTER_ID=self.cluster_id,  # (with PSCTL_ROLE: how other clusters' agents see its bound roles)
            PSCTL_ROLE=f"{task_type}-{index}",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
            **thread_env(self.threads),
        )
        return env

    def _cpu_env(self, task_type: str, index: int) -> dict[str, str]:
        """The role's CPU, as a host's agent names it (its slot among the cluster's roles); empty where it is
        not bound."""
        slots = host_slots((t, i) for t, addresses in self.jobs.items() for i in range(len(addresses)))
        cpus = self._cpus.for_slot(slots[(task_type, index)], len(slots))
        return {} if cpus is None else {CPUS_VARIABLE: cpu_list(cpus)}

    def command(self, task_type: str, index: int) -> list[str]:
        """What a role runs (its configuration comes in :meth:`env`)."""
        return [sys.executable, "-m", "psctl.runtime"]

    def start(self, task_type: str, index: int) -> Role:
        log_path = self.run_dir / f"{task_type}-{index}.log"
        reservation = self._reservations.pop(self.jobs[task_type][index], None)
        if reservation is not None:  # free the port for the role to bind
            reservation.close()
        started_at = time.time()
        env = self.env(task_type, index)
        if self.cpu_binding:  # the role binds itself to this CPU (a worker yields it), as under psctl's agents
            env.update(self._cpu_env(task_type, index))
        with log_path.open("wb") as out:
            popen = subprocess.Popen(
                self.command(task_type, index),
                env=env,
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, killed as a whole in close()
            )
        try:
            process: psutil.Process | None = psutil.Process(popen.pid)
        except psutil.NoSuchProcess:
            process = None
        role = Role(task_type, index, popen, process, log_path, started_at)
        self.roles.append(role)
        return role

    def start_all(self) -> float:
        """Start ps, then workers, then the chief; returns the wall time just before the first process started."""
        first = time.time()
        for task_type in ("ps", "worker", "chief"):
            for index in range(len(self.jobs.get(task_type, []))):
                self.start(task_type, index)
        return first

    def role(self, task_type: str, index: int = 0) -> Role:
        for role in self.roles:
            if (role.task_type, role.index) == (task_type, index):
                return role
        raise KeyError(f"{task_type}:{index}")

    def check_alive(self, *, except_types: Sequence[str] = ()) -> None:
        """Raise if a server role (or any role not in ``except_types``) has exited."""
        for role in self.roles:
            if role.task_type in except_types:
                continue
            rc = role.popen.poll()
            if rc is not None:
                raise RuntimeError(f"{role.task} exited early with code {rc}:\n{role.log_tail()}")

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(f"----- {r.task} (pid {r.popen.pid}) -----\n{r.log_tail(chars)}" for r in self.roles)

    def close(self) -> list[str]:
        """Stop every process ever started (SIGTERM, 5 s grace, SIGKILL of every group); returns survivors."""
        live = [r for r in reversed(self.roles) if r.popen.poll() is None]
        for role in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(role.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for role in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                role.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for role in self.roles:  # also groups whose leader exited: a child might linger in one
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(role.popen.pid, signal.SIGKILL)
        for role in self.roles:
            with contextlib.suppress(subprocess.TimeoutExpired):
                role.popen.wait(timeout=10)
        for sock in self._reservations.values():
            sock.close()
        self._reservations.clear()
        survivors = []
        for role in self.roles:
            if role.process is not None and role.process.is_running() and role.popen.poll() is None:
                survivors.append(f"{role.task} pid {role.popen.pid}")
        if survivors:
            log(f"processes survived teardown: {survivors}")
        return survivors


@contextlib.contextmanager
def bench_cluster(run_dir: Path, training: dict[str, Any], **kwargs: Any) -> Iterator[BenchCluster]:
    cluster = BenchCluster(run_dir, training, **kwargs)
    try:
        yield cluster
    finally:
        cluster.close()


@contextlib.contextmanager
def run_directory(keep: str | None) -> Iterator[Path]:
    """``keep`` names a directory to write logs and metrics into (kept); otherwise a temporary one."""
    if keep:
        path = Path(keep).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="psctl-bench-") as tmp:
        yield Path(tmp)


# -- monitoring -------------------------------------------------------------------------------------------
def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU seconds of one process so far."""
    times = process.cpu_times()
    return float(times.user + times.system)


def _tree_rss(process: psutil.Process) -> int:
    """RSS of a role: the process itself (roles start no children, but count any)."""
    rss = process.memory_info().rss
    with contextlib.suppress(psutil.Error):
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rss += child.memory_info().rss
    return rss


@dataclass
class Monitor:
    """A thread sampling every role's RSS and CPU time, and ps 0's global step (GetState, a tiny unary rpc).

    The step is polled every ``step_interval`` seconds until the first step is seen, then every
    ``steady_interval`` seconds; the (time, step) samples give the start-to-first-step time and the steady
    training rate without relying on the chief's once-a-second metrics records.
    """

    cluster: BenchCluster
    step_interval: float = 0.01
    steady_interval: float = 0.05
    rss_interval: float = 0.1
    #: False: sample memory only (a benchmark that must not send the PS any extra rpc).
    poll_steps: bool = True
    samples: list[StepSample] = field(default_factory=list)
    #: (time.time(), CPU seconds so far per role), one entry per memory sample.
    cpu_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    ps_initialized_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bench-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample_memory()

    def _sample_memory(self) -> None:
        for role in self.cluster.roles:
            if role.process is None:
                continue
            with contextlib.suppress(psutil.Error):
                role.peak_rss = max(role.peak_rss, _tree_rss(role.process))
                cpu = role.process.cpu_times()
                role.cpu_seconds = max(role.cpu_seconds, cpu.user + cpu.system)
        self.cpu_samples.append((time.time(), {r.task: r.cpu_seconds for r in self.cluster.roles}))

    def _run(self) -> None:
        ps = self.cluster.jobs.get("ps", []) if self.poll_steps else []
        channel = make_channel(ps[0]) if ps else None
        stub = pb_grpc.ParameterServerStub(channel) if channel is not None else None
        next_rss = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_rss:
                    self._sample_memory()
                    next_rss = now + self.rss_interval
                if stub is not None:
                    self._poll_step(stub)
                seen = bool(self.samples) and self.samples[-1].global_step > 0
                wait = self.steady_interval if seen else self.step_interval
                self._stop.wait(wait if stub is not None else self.rss_interval)
        finally:
            if channel is not None:
                channel.close()

    def _poll_step(self, stub: pb_grpc.ParameterServerStub) -> None:
        try:
            state = stub.GetState(pb.StateRequest(), timeout=1.0)
        except grpc.RpcError:
            return
        now = time.time()
        if state.initialized and self.ps_initialized_at is None:
            self.ps_initialized_at = now
        if state.initialized:
            self.samples.append(StepSample(now, int(state.global_step)))

    # -- figures ------------------------------------------------------------------------------------------
    def first_step_at(self) -> float | None:
        return next((s.time for s in self.samples if s.global_step > 0), None)

    def window(self, start_step: int, end_step: int) -> tuple[StepSample, StepSample] | None:
        """The first samples at or past ``start_step`` and ``end_step`` (or the last sample, if training never
        got that far); None without two distinct times."""
        start = next((s for s in self.samples if s.global_step >= start_step), None)
        end = next((s for s in self.samples if s.global_step >= end_step), self.samples[-1] if self.samples else None)
        if start is None or end is None or end.time <= start.time:
            return None
        return start, end

    def rate(self, start_step: int, end_step: int) -> tuple[float, int, float]:
        """(steps/s, steps counted, seconds) over :meth:`window`."""
        window = self.window(start_step, end_step)
        if window is None:
            return float("nan"), 0, 0.0
        start, end = window
        steps = end.global_step - start.global_step
        seconds = end.time - start.time
        return steps / seconds, steps, seconds

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds each role used between two wall times, from the samples nearest outside them (so at
        most one sampling interval more at each end)."""
        before = [s for s in self.cpu_samples if s[0] <= start] or self.cpu_samples[:1]
        after = [s for s in self.cpu_samples if s[0] >= end] or self.cpu_samples[-1:]
        if not before or not after:
            return {}
        first, last = before[-1][1], after[0][1]
        return {task: round(last[task] - first.get(task, 0.0), 3) for task in last}

    def peak_rss_mb(self) -> dict[str, float]:
        return {r.task: round(r.peak_rss / MIB, 1) for r in self.cluster.roles}

    def cpu_seconds(self) -> dict[str, float]:
        return {r.task: round(r.cpu_seconds, 2) for r in self.cluster.roles}


def emit_all(benchmark: str, run: Callable[[], Iterable[dict[str, Any]]]) -> int:
    """A benchmark's main: emit each JSON line ``run`` yields; on a failure, or Ctrl-C / SIGTERM (every process
    is already stopped by then), one line saying ``"ok": false`` and why. Returns the exit code."""
    try:
        for line in run():
            emit(line)
    except Exception as exc:  # any failure of the run is reported on the line; its traceback goes to stderr
        log(traceback.format_exc())
        first_line = (str(exc).splitlines() or [""])[0]
        emit({"benchmark": benchmark, "ok": False, "error": f"{type(exc).__name__}: {first_line}"})
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:
        emit({"benchmark": benchmark, "ok": False, "error": f"interrupted ({type(exc).__name__})"})
        return 130
    return 0

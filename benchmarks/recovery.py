"""Failure detection and recovery under the supervisor: one JSON line of figures per fault.

    python -m benchmarks.recovery [--fault worker|ps|chief|ps-sigterm|all] [--steps N]

For each fault kind a fresh cluster (1 chief, 2 ps, 2 workers; asynchronous training of an MLP with 32 hidden
units on scikit-learn's digits; a checkpoint every 200 steps; heartbeats every 0.5 s, lost after 3 s of
silence) is started through the real ``psctl up --detach`` with its own temporary ``PSCTL_HOME``. Once the
chief's step rate is steady (its ``run/metrics.jsonl`` progress records) and a checkpoint exists, the role
(``worker-0``, ``ps-1`` or ``chief-0``, its pid from ``state.json``) is SIGKILLed, and the benchmark reads:

- the supervisor's ``events.jsonl``: ``lost`` (detection), ``starting`` and ``running`` of attempt 2 (restart);
- the chief's progress records: the pre-fault rate, the first window back at >= 90 % of it (recovery), the
  global step before the kill and where training resumed (steps lost);
- the chief's log: ``restored PATH (global step N)`` (a ps fault), ``resuming at global step N``.

``--fault ps-sigterm`` sends ps-1 a preemption's SIGTERM instead: the ps tells the chief it is leaving, the chief
checkpoints every ps with nothing in flight and restores that checkpoint into its successor, so its
``steps_lost`` (steps recomputed) is 0, against up to a checkpoint interval for SIGKILL.

Then ``psctl down`` (and a psutil sweep by cluster id, killing anything left) ends the cluster, also when the
benchmark fails or is interrupted. Progress goes to stderr; see benchmarks/README.md for what each field means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from benchmarks.common import REPO_ROOT, emit, install_signal_handlers, log, machine, median, rounded
from psctl.runtime.checkpoint import list_checkpoints
from psctl.runtime.metrics import read_metrics

#: The role each fault kind kills.
FAULTS: dict[str, str] = {"worker": "worker-0", "ps": "ps-1", "chief": "chief-0", "ps-sigterm": "ps-1"}
#: Faults that are a preemption's warning (SIGTERM, within supervision.preemption_grace) instead of SIGKILL.
PREEMPTIONS = ("ps-sigterm",)
EVERY_STEPS = 200
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
#: Recovered: a whole metrics window after the kill at this fraction of the pre-fault rate or more.
RECOVERED_FRACTION = 0.9
#: The rate is steady when this many consecutive windows each lie within STEADY_TOLERANCE of their mean.
STEADY_WINDOWS = 6
STEADY_TOLERANCE = 0.25

T = TypeVar("T")


def spec_text(name: str, *, steps: int, log_every: float, backoff: float) -> str:
    return textwrap.dedent(
        f"""\
        name: {name}
        roles:
          chief: {{restart: {{backoff_seconds: {backoff}}}}}
          ps: {{replicas: 2, restart: {{backoff_seconds: {backoff}}}}}
          worker: {{replicas: 2, restart: {{backoff_seconds: {backoff}}}}}
        training:
          program: psctl.models.mlp
          args: {{hidden_units: 32}}
          data: {{name: digits}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.01}}
          mode: async
          steps: {steps}
          log_every_seconds: {log_every}s
          checkpoint: {{every_steps: {EVERY_STEPS}, every_seconds: 0, max_to_keep: 5}}
        supervision: {{heartbeat_interval: {HEARTBEAT_INTERVAL}s, heartbeat_timeout: {HEARTBEAT_TIMEOUT}s}}
        """
    )


def psctl_command() -> list[str]:
    found = shutil.which("psctl")
    return [found] if found else [sys.executable, "-m", "psctl"]


def wait_for(condition: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy, or raise TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


LOG_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3}) ")


def line_time(line: str) -> float | None:
    """Wall time of a runtime log line (``2026-01-31 12:00:00,123 INFO ...``, local time)."""
    found = LOG_STAMP.match(line)
    if found is None:
        return None
    return time.mktime(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")) + int(found.group(2)) / 1000


@dataclass
class Window:
    """One progress record of the chief: the window (start, end] and what it counted."""

    start: float
    end: float
    global_step: int
    steps_per_sec: float


class Cluster:
    """One cluster in a private PSCTL_HOME, driven through ``psctl`` and read through its files."""

    def __init__(self, base: Path, name: str, spec: str) -> None:
        self.name = name
        self.home = base / "home"
        self.root = self.home / name
        self.spec = base / f"{name}.yaml"
        self.spec.write_text(spec, encoding="utf-8")
        self.env = dict(os.environ, PSCTL_HOME=str(self.home), PYTHONUNBUFFERED="1")
        self.cluster_id: str | None = None

    def psctl(self, *args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*psctl_command(), *args], env=self.env, cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )

    def up(self) -> None:
        try:
            done = self.psctl("up", "--detach", str(self.spec))
        finally:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.cluster_id = str(self.state()["cluster_id"])  # known for the teardown, whatever happened
        if done.returncode != 0:
            raise RuntimeError(f"psctl up failed ({done.returncode}): {done.stdout}\n{done.stderr}")

    def down(self) -> list[str]:
        """``psctl down``, then SIGKILL anything still carrying the cluster's id; returns the problems."""
        problems = []
        if (self.root / "state.json").is_file():
            try:
                done = self.psctl("down", self.name, "--grace", "2", timeout=60)
                if done.returncode != 0:
                    problems.append(f"psctl down exited {done.returncode}: {done.stderr.strip()}")
            except subprocess.TimeoutExpired:
                problems.append("psctl down did not finish within 60s")
        left = self.processes()
        if left:
            problems.append(f"processes left after psctl down: {[p.pid for p in left]}")
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(left, timeout=10)
        return problems

    def processes(self) -> list[psutil.Process]:
        """Live processes of this cluster: by PSCTL_CLUSTER_ID, or PSCTL_HOME pointing at this home."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                env = proc.environ()
            except psutil.Error:
                continue
            if "PSCTL_CLUSTER_ID" not in env:
                continue
            if env["PSCTL_CLUSTER_ID"] == self.cluster_id or env.get("PSCTL_HOME") == str(self.home):
                found.append(proc)
        return found

    # -- files ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return json.loads((self.root / "state.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]

    def role(self, name: str) -> dict[str, Any]:
        return next(r for r in self.state()["roles"] if r["name"] == name)

    def check_running(self) -> None:
        state = self.state()
        if state["state"] in ("succeeded", "failed", "stopped"):
            raise RuntimeError(f"the cluster ended ({state['state']}: {state.get('reason', '')}) before the "
                               "measurement was done; raise --steps")

    def windows(self) -> list[Window]:
        records = [r for r in read_metrics(self.root / "run" / "metrics.jsonl") if r.get("event") == "progress"]
        out, previous = [], None
        for record in records:
            end = float(record["time"])
            if previous is not None:
                out.append(Window(previous, end, int(record["global_step"]), float(record["steps_per_sec"] or 0)))
            previous = end
        return out

    def events(self, role: str) -> list[dict[str, Any]]:
        try:
            lines = (self.root / "events.jsonl").read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        return [e for e in (json.loads(line) for line in lines if line.strip()) if e["role"] == role]

    def event(self, role: str, to: str, attempt: int, after: float) -> dict[str, Any] | None:
        return next((e for e in self.events(role) if e["to"] == to and e["attempt"] == attempt
                     and e["time"] >= after), None)

    def chief_lines(self) -> list[str]:
        logs = sorted(self.root.glob("logs/chief-0.*.log"), key=lambda p: int(p.name.split(".")[-2]))
        return [line for p in logs for line in p.read_text(encoding="utf-8", errors="replace").splitlines()]

    def checkpoints(self) -> int:
        return len(list_checkpoints(self.root / "checkpoints"))

    def live_process(self, role: str) -> psutil.Process:
        """``role``'s process: the pid in state.json, checked by creation time and environment."""
        record = self.role(role)
        proc = psutil.Process(record["pid"])
        if abs(proc.create_time() - record["create_time"]) > 0.05:
            raise RuntimeError(f"{role}: pid {record['pid']} was reused")
        env = proc.environ()
        if env.get("PSCTL_ROLE") != role or env.get("PSCTL_CLUSTER_ID") != self.cluster_id:
            raise RuntimeError(f"{role}: pid {record['pid']} is not that role")
        return proc


@contextlib.contextmanager
def cluster_base(keep: str | None, fault: str) -> Iterator[Path]:
    if keep:
        path = Path(keep).resolve() / fault
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=f"psctl-recovery-{fault}-") as tmp:
        yield Path(tmp)


def steady_rate(cluster: Cluster, timeout: float) -> tuple[float, bool, list[Window]]:
    """Wait until a checkpoint exists and the last STEADY_WINDOWS windows agree (each within the tolerance of
    their mean); the rate is their steps over their seconds. After ``timeout`` the last windows are taken as
    they are (``steady`` False)."""

    def candidate() -> list[Window] | None:
        cluster.check_running()
        if cluster.checkpoints() < 1:
            return None
        recent = [w for w in cluster.windows() if w.global_step > 0][-STEADY_WINDOWS - 1:]
        if len(recent) < STEADY_WINDOWS + 1:
            return None
        return recent

    def steady() -> list[Window] | None:
        recent = candidate()
        if recent is None:
            return None
        rates = [w.steps_per_sec for w in recent[1:]]
        mean = sum(rates) / len(rates)
        return recent if mean > 0 and all(abs(r - mean) <= STEADY_TOLERANCE * mean for r in rates) else None

    ok = True
    try:
        recent = wait_for(steady, timeout=timeout, what="a steady step rate", interval=0.1)
    except TimeoutError:
        ok = False
        recent = wait_for(candidate, timeout=60, what="training to start and checkpoint", interval=0.1)
    first, last = recent[0], recent[-1]
    return (last.global_step - first.global_step) / (last.end - first.end), ok, recent[1:]


def send(proc: psutil.Process, sig: int = signal.SIGKILL) -> float:
    """Signal ``proc`` (SIGKILL, or a preemption's SIGTERM); returns time.time() just before the signal, once
    the process is gone."""
    sent = time.time()
    proc.send_signal(sig)

    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, timeout=40, what=f"pid {proc.pid} to end", interval=0.01)
    return sent


RESTORED = re.compile(r"restored (\S+) \(global step (\d+)\)")
FRESH = "no checkpoint to restore"
KEPT = re.compile(r"every ps holds the variables: resuming at global step (\d+)")


@dataclass
class Resume:
    """Where the chief took training up again after the fault, from its log."""

    time: float  # the log line's time
    step: int
    checkpoint: str | None = None


def find_resume(lines: list[str], fault: str, killed: float) -> Resume | None:
    """A ps fault: the chief's restore (``restored PATH (global step N)``, or a restart from the initializers
    if there was no checkpoint). A chief fault: the new chief's ``every ps holds the variables: resuming at
    global step N`` (or a restore, had the ps lost their variables too)."""
    for line in lines:
        stamp = line_time(line)
        if stamp is None or stamp < killed - 0.001:  # log times are truncated to the millisecond
            continue
        if found := RESTORED.search(line):
            return Resume(stamp, int(found.group(2)), found.group(1))
        if FRESH in line:
            return Resume(stamp, 0)
        if fault == "chief" and (found := KEPT.search(line)):
            return Resume(stamp, int(found.group(1)))
    return None


def measure(cluster: Cluster, fault: str, args: argparse.Namespace) -> dict[str, Any]:
    role = FAULTS[fault]
    cluster.up()
    log(f"{fault}: cluster {cluster.cluster_id} up; waiting for a steady rate")
    pre_rate, steady, pre_windows = steady_rate(cluster, args.steady_timeout)
    before = cluster.windows()
    proc = cluster.live_process(role)
    log(f"{fault}: {pre_rate:.1f} steps/s (steady: {steady}) at step ~{before[-1].global_step}; "
        f"{'SIGTERM' if fault in PREEMPTIONS else 'SIGKILL'} {role} pid {proc.pid}")
    killed = send(proc, signal.SIGTERM if fault in PREEMPTIONS else signal.SIGKILL)
    threshold = RECOVERED_FRACTION * pre_rate

    def resume() -> Resume | None:
        return None if fault == "worker" else find_resume(cluster.chief_lines(), fault, killed)

    def counts(w: Window, resumed: Resume | None) -> bool:
        """Whether a window measures training after the fault. Worker: it began after the kill. Chief: a dead
        chief writes no more records, so every record after the kill is the new chief's, whose rate counts
        from its own start. Ps: it began after the chief restored the ps (the first window that can hold the
        rate of training on the restored model)."""
        if fault == "worker":
            return w.start >= killed
        if fault == "chief":
            return w.end > killed
        return resumed is not None and w.start >= resumed.time

    def recovered_window() -> Window | None:
        resumed = resume()
        return next((w for w in cluster.windows() if counts(w, resumed) and w.steps_per_sec >= threshold), None)

    def done() -> bool:
        cluster.check_running()
        if cluster.event(role, "running", 2, killed) is None or (fault != "worker" and resume() is None):
            return False
        return recovered_window() is not None

    wait_for(done, timeout=args.timeout, what=f"{role} to be restarted and the rate to recover", interval=0.1)

    lost = cluster.event(role, "lost", 1, killed)
    starting = cluster.event(role, "starting", 2, killed)
    running = cluster.event(role, "running", 2, killed)
    restarting = cluster.event(role, "restarting", 1, killed)
    recovered = recovered_window()
    resumed = resume()
    assert lost is not None and starting is not None and running is not None and recovered is not None
    windows = cluster.windows()
    # what the chief reported last before the kill (up to one window behind the true global step)
    reported = max((w.global_step for w in windows if w.end <= killed), default=0)
    after = [w for w in windows if w.end > killed and w.end <= recovered.end]
    if fault.startswith("ps"):
        assert resumed is not None
        # nothing is applied once a ps is gone, and the meter is reset only after the restore: the highest step
        # reported before the restore line is the global step at the kill (steps in flight at the kill included)
        at_kill = max(w.global_step for w in windows if w.end <= resumed.time)
        resumed_from = resumed.step
    elif fault == "chief":
        assert resumed is not None
        at_kill, resumed_from = reported, resumed.step
    else:  # a worker: the global step never goes back; the lowest it showed after the kill
        at_kill = reported
        resumed_from = min([reported] + [w.global_step for w in after])
    return {
        "benchmark": "recovery",
        "fault": fault,
        "role": role,
        "ok": True,
        "pre_fault_steps_per_s": rounded(pre_rate, 1),
        "steady": steady,
        "detection_s": rounded(lost["time"] - killed),
        "restart_starting_s": rounded(starting["time"] - killed),
        "restart_running_s": rounded(running["time"] - killed),
        "resumed_s": rounded(resumed.time - killed) if resumed else None,
        "recover_s": rounded(recovered.end - killed),
        "recovered_window_steps_per_s": rounded(recovered.steps_per_sec, 1),
        "min_window_steps_per_s_after_kill": rounded(min((w.steps_per_sec for w in after), default=float("nan")), 1),
        "steps_lost": max(0, at_kill - resumed_from),
        "global_step_at_kill": at_kill,
        "resumed_from_step": resumed_from,
        "restored_checkpoint": resumed.checkpoint if resumed else None,
        "lost_reason": lost["reason"].split(";")[0],
        "restart_backoff": restarting["reason"] if restarting else None,
        "checkpoint_every_steps": EVERY_STEPS,
        "pre_fault_windows_steps_per_s": [rounded(w.steps_per_sec, 1) for w in pre_windows],
        "windows_after_kill": [
            {"t": rounded(w.end - killed, 2), "global_step": w.global_step, "steps_per_s": rounded(w.steps_per_sec, 1)}
            for w in after
        ],
    }


def run_fault(fault: str, args: argparse.Namespace, run: str = "") -> dict[str, Any]:
    params = {"steps": args.steps, "log_every_s": args.log_every, "backoff_s": args.backoff,
              "heartbeat_interval_s": HEARTBEAT_INTERVAL, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT,
              "cluster": "1 chief, 2 ps, 2 workers; async MLP 64-32-10 on digits, batch 50"}
    started_machine = machine()
    record: dict[str, Any]
    with cluster_base(args.keep, fault + run) as base:
        cluster = Cluster(base, f"recovery-{fault}",
                          spec_text(f"recovery-{fault}", steps=args.steps, log_every=args.log_every,
                                    backoff=args.backoff))
        interrupted: BaseException | None = None
        try:
            record = measure(cluster, fault, args)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # SIGTERM / SIGHUP arrive as SystemExit
            interrupted = None if isinstance(exc, Exception) else exc
            record = {"benchmark": "recovery", "fault": fault, "role": FAULTS[fault], "ok": False,
                      "error": f"{type(exc).__name__}: {exc}"}
            if interrupted is None:
                with contextlib.suppress(OSError):
                    log((cluster.root / "supervisor.log").read_text(errors="replace")[-3000:])
                    log("\n".join(cluster.chief_lines()[-30:]))
        finally:
            problems = cluster.down()
        if problems:
            record["ok"] = False
            record["teardown_problems"] = problems
    record["params"] = params
    record["machine"] = started_machine
    if interrupted is not None:
        emit(record)
        raise interrupted
    return record


#: The figures a --repeats run reports as medians (each run's own values are kept under "runs").
HEADLINE = ("pre_fault_steps_per_s", "detection_s", "restart_starting_s", "restart_running_s", "recover_s",
            "steps_lost", "resumed_s")


def summarise(fault: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """One line for several runs of a fault: the median of each headline figure over the runs that worked."""
    good = [r for r in records if r["ok"]]
    out: dict[str, Any] = {"benchmark": "recovery", "fault": fault, "role": FAULTS[fault],
                           "ok": len(good) == len(records), "repeats": len(records)}
    for key in HEADLINE:
        values = [r[key] for r in good if r.get(key) is not None]
        if values:
            out[key] = rounded(median(values))
            out[f"{key}_range"] = [min(values), max(values)]
    keep = ("ok", "error", *HEADLINE, "global_step_at_kill", "resumed_from_step", "min_window_steps_per_s_after_kill",
            "restart_backoff", "steady")
    out["runs"] = [{k: r[k] for k in keep if k in r} for r in records]
    out["params"] = records[0]["params"]
    out["machine"] = records[0]["machine"]
    out["loadavg_1m_per_run"] = [r["machine"]["loadavg_1m"] for r in records]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=[*FAULTS, "all"], default="all")
    parser.add_argument("--steps", type=int, default=100_000,
                        help="training.steps: only has to outlast the measurement (the cluster is then taken down)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per fault (interleaved); above 1, one line per fault gives the medians")
    parser.add_argument("--log-every", type=float, default=0.5, help="the chief's metrics window, seconds")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="restart.backoff_seconds of every role (psctl's default is 1 s)")
    parser.add_argument("--steady-timeout", type=float, default=30.0)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds from the kill to recovery at most")
    parser.add_argument("--keep", metavar="DIR", help="keep each cluster's home (logs, events, metrics) under DIR")
    args = parser.parse_args(argv)
    install_signal_handlers()
    faults = list(FAULTS) if args.fault == "all" else [args.fault]
    records: dict[str, list[dict[str, Any]]] = {fault: [] for fault in faults}
    for repeat in range(args.repeats):
        for fault in faults:
            record = run_fault(fault, args, f"{repeat}" if args.repeats > 1 else "")
            records[fault].append(record)
            if args.repeats == 1:
                emit(record)
    if args.repeats > 1:
        for fault in faults:
            emit(summarise(fault, records[fault]))
    return 0 if all(r["ok"] for runs in records.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

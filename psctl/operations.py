"""What the CLI's commands do, without any rendering: bring a cluster up, find it, read it, tear it down."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from psctl.errors import ClusterNotFound, LaunchError, UsageError
from psctl.home import ClusterDir, list_clusters
from psctl.launch.base import ProcessHandle, stop_processes
from psctl.launch.local import LocalRunner
from psctl.pki import create_cluster_pki
from psctl.runtime.checkpoint import CheckpointError, Snapshot, latest_checkpoint, load_checkpoint
from psctl.spec import ClusterSpec, Plan, load_spec, make_plan
from psctl.supervisor.state import (
    ClusterRecord,
    ClusterState,
    RoleRecord,
    RoleState,
    load_state,
    save_state,
    write_json_atomic,
)


def plan_spec(path: str | Path) -> tuple[ClusterSpec, Plan]:
    spec = load_spec(path)
    return spec, make_plan(spec)


def supervisor_alive(record: ClusterRecord) -> bool:
    if not record.supervisor_pid:
        return False
    try:
        proc = psutil.Process(record.supervisor_pid)
        if record.supervisor_create_time and abs(proc.create_time() - record.supervisor_create_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_stale(record: ClusterRecord) -> bool:
    """The state file says the cluster runs, but its supervisor is gone: what it shows is the last known."""
    return not record.state.terminal and not supervisor_alive(record)


def resolve_cluster(name: str | None) -> ClusterDir:
    """The named cluster, or the only one (the only one not finished, if several exist)."""
    if name:
        cdir = ClusterDir.named(name)
        if not cdir.state_file.is_file():
            known = ", ".join(c.name for c in list_clusters()) or "none"
            raise ClusterNotFound(f"no cluster named {name!r} (known: {known}); start one with `psctl up SPEC`")
        return cdir
    clusters = list_clusters()
    if not clusters:
        raise ClusterNotFound("no cluster found; start one with `psctl up SPEC`")
    if len(clusters) == 1:
        return clusters[0]
    active = [c for c in clusters if not load_state(c.state_file).state.terminal]
    if len(active) == 1:
        return active[0]
    names = ", ".join(c.name for c in (active or clusters))
    raise UsageError(f"several clusters exist ({names}); name the one you mean")


def bring_up(spec: ClusterSpec, plan: Plan, *, wait_started: float = 30.0) -> ClusterDir:
    """Persist the plan and start the cluster's supervisor; returns once the supervisor is running."""
    if not spec.is_local:
        raise UsageError(
            f"{spec.path or spec.name}: hosts: launching on remote hosts over SSH is not available in this "
            "version of psctl; remove `hosts:` (and the roles' `host`/`hosts`) to run on this machine"
        )
    cdir = ClusterDir.named(spec.name)
    if cdir.state_file.is_file():
        old = load_state(cdir.state_file)
        if not old.state.terminal and (supervisor_alive(old) or LocalRunner().cluster_processes(old.cluster_id)):
            raise UsageError(
                f"cluster {spec.name!r} is already up ({old.state.value})",
                hint=f"see `psctl status {spec.name}`, or stop it with `psctl down {spec.name}`",
            )
        for stale in (cdir.logs, cdir.run_dir):
            shutil.rmtree(stale, ignore_errors=True)
        cdir.events_file.unlink(missing_ok=True)
        (cdir.root / "stop-request.json").unlink(missing_ok=True)
    cdir.create()
    record = ClusterRecord(
        name=spec.name,
        cluster_id=f"{spec.name}-{secrets.token_hex(4)}",
        spec_path=str(Path(spec.path).resolve()) if spec.path else "",
        steps=int(spec.training.get("steps", 0)),
        roles=[
            RoleRecord(name=i.name, role=i.role, index=i.index, host=i.host, address=i.address, port=i.port)
            for i in plan.instances
        ],
    )
    record.tls = spec.security.tls
    if record.tls:
        members = [(i.name, i.address) for i in plan.instances] + [("supervisor", "127.0.0.1")]
        create_cluster_pki(cdir.tls_dir, record.cluster_id, members)
    save_state(cdir.state_file, record)
    fd = os.open(cdir.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "psctl.supervisor", str(cdir.root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives this command; Ctrl-C here does not reach it
            env=dict(os.environ, PSCTL_CLUSTER_ID=record.cluster_id, PYTHONUNBUFFERED="1"),
        )
    deadline = time.monotonic() + wait_started
    while time.monotonic() < deadline:
        current = load_state(cdir.state_file)
        if current.supervisor_pid and current.roles and all(r.state != RoleState.PENDING for r in current.roles):
            return cdir
        if current.state.terminal:
            return cdir
        time.sleep(0.1)
    tear_down(cdir)
    raise LaunchError(
        f"the supervisor of {spec.name!r} did not start within {wait_started:.0f}s; "
        f"see {cdir.supervisor_log}"
    )


@dataclass(frozen=True)
class TeardownReport:
    stopped: int
    survivors: list[ProcessHandle]
    was_running: bool


def tear_down(cdir: ClusterDir, *, grace: float = 5.0, purge: bool = False) -> TeardownReport:
    """Stop the supervisor and every process of the cluster; verify none is left. Safe to repeat."""
    record = load_state(cdir.state_file)
    runner = LocalRunner()
    was_running = not record.state.terminal
    if supervisor_alive(record):
        assert record.supervisor_pid is not None
        write_json_atomic(cdir.root / "stop-request.json", {"grace": grace})
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10.0
        while supervisor_alive(record) and time.monotonic() < deadline:
            time.sleep(0.1)
    handles = [
        ProcessHandle(r.host, r.pid, r.create_time) for r in record.roles if r.pid is not None
    ] + runner.cluster_processes(record.cluster_id)
    handles = list({h.pid: h for h in handles}.values())  # state file and process scan overlap
    live = [h for h in handles if runner.poll(h) is None]
    survivors = stop_processes(runner, live, grace=grace)
    survivors += [h for h in runner.cluster_processes(record.cluster_id) if h not in survivors]
    record = load_state(cdir.state_file)
    if not record.state.terminal:
        record.state = ClusterState.STOPPED
        record.reason = "stopped by psctl down"
    for role in record.roles:
        if not role.state.terminal:
            role.state = RoleState.STOPPED
            role.reason = "stopped by psctl down"
    save_state(cdir.state_file, record)
    if survivors:
        pids = ", ".join(str(h.pid) for h in survivors)
        raise LaunchError(f"processes of cluster {cdir.name!r} survived SIGKILL: pids {pids}")
    if purge:  # logs and state go; checkpoints are training results and stay
        for path in cdir.root.iterdir():
            if path.name != "checkpoints":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if not any(cdir.root.iterdir()):
            cdir.root.rmdir()
    return TeardownReport(stopped=len({h.pid for h in live}), survivors=survivors, was_running=was_running)


def find_snapshot(name: str | None, checkpoint: str | None) -> tuple[Path, Snapshot]:
    """The checkpoint to export: a given folder (one checkpoint, or the newest valid one inside), or the
    newest valid checkpoint of the cluster."""
    if checkpoint is None:
        cdir = resolve_cluster(name)
        checkpoint = str(cdir.root / "checkpoints")
    path = Path(checkpoint).expanduser()
    try:
        if (path / "manifest.json").is_file():
            return path, load_checkpoint(path)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    found = latest_checkpoint(path)
    if found is None:
        raise ClusterNotFound(f"no valid checkpoint in {path}")
    return found


# -- logs ---------------------------------------------------------------------------------------------
def role_names(record: ClusterRecord) -> list[str]:
    return [r.name for r in record.roles]


def check_role(record: ClusterRecord, role: str) -> RoleRecord:
    try:
        return record.role(role)
    except KeyError:
        raise UsageError(
            f"no role {role!r} in cluster {record.name!r}; roles are: {', '.join(role_names(record))}"
        ) from None


def log_path(cdir: ClusterDir, record: ClusterRecord, role: str, attempt: int | None) -> Path:
    rec = check_role(record, role)
    if attempt is None:
        attempt = max(rec.attempt, 1)
    if not 1 <= attempt <= max(rec.attempt, 1):
        raise UsageError(f"{role} has attempts 1..{max(rec.attempt, 1)}; --attempt {attempt} does not exist")
    return cdir.role_log(role, attempt)


def tail_lines(path: Path, n: int) -> list[str]:
    return tail_lines_at(path, n)[0]


def tail_lines_at(path: Path, n: int) -> tuple[list[str], int]:
    """The last ``n`` lines (all if n <= 0) and the byte offset where reading stopped (for follow)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0
    lines = data.decode("utf-8", errors="replace").splitlines()
    return (lines[-n:] if n > 0 else lines), len(data)


def follow(
    cdir: ClusterDir, role: str, *, start_attempt: int, offset: int | None = None, poll: float = 0.2
) -> Iterator[str]:
    """Yield new log lines of ``role`` as they are written, from ``offset`` (default: the end), moving on to
    the next attempt's log when the role restarts; ends when the cluster has finished and all is read."""
    attempt = start_attempt
    path = cdir.role_log(role, attempt)
    if offset is None:
        offset = path.stat().st_size if path.exists() else 0
    pending = ""
    while True:
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                data = f.read()
                offset = f.tell()
            if data:
                pending += data
                *lines, pending = pending.split("\n")
                yield from lines
                continue
        record = load_state(cdir.state_file)
        nxt = cdir.role_log(role, attempt + 1)
        if nxt.exists():
            if pending:
                yield pending
                pending = ""
            attempt += 1
            path, offset = nxt, 0
            yield f"--- {role}: attempt {attempt} ---"
            continue
        if record.state.terminal or is_stale(record):
            if pending:
                yield pending
            return
        time.sleep(poll)

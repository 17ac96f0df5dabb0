"""Rich tables for plans and cluster status, and the dictionaries ``--json`` prints."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

import psctl
from psctl.home import ClusterDir
from psctl.launch.remote import HostReport
from psctl.runtime.metrics import CPU_METRIC, last_record, metric_text, metrics_text
from psctl.spec import Plan
from psctl.supervisor.state import ClusterRecord, RoleRecord, RoleState

STATE_STYLE = {
    RoleState.RUNNING: "green",
    RoleState.SUCCEEDED: "bold green",
    RoleState.STARTING: "cyan",
    RoleState.RESTARTING: "yellow",
    RoleState.LOST: "red",
    RoleState.STALLED: "yellow",
    RoleState.FAILED: "bold red",
    RoleState.STOPPED: "dim",
    RoleState.PENDING: "dim",
}


def plan_table(plan: Plan) -> Table:
    table = Table(title=f"plan for cluster {plan.spec.name!r}", title_justify="left")
    slurm = plan.spec.backend == "slurm"  # the job's nodes are known once it runs
    for col in ("role", "node" if slurm else "host", "address", "port"):
        table.add_column(col)
    for inst in plan.instances:
        table.add_row(inst.name, "(Slurm's)" if slurm else inst.host, "-" if slurm else inst.address, str(inst.port))
    return table


def host_table(reports: Mapping[str, HostReport]) -> Table:
    """What the preflight found on each host."""
    table = Table(title="hosts", title_justify="left")
    for col in ("host", "python", "psctl", "cpus", "free disk", "clock skew"):
        table.add_column(col)
    for name in sorted(reports):
        r = reports[name]
        found = r.psctl or "none"
        table.add_row(name, r.python, f"{found} (will copy {psctl.__version__})" if r.copy_psctl else found,
                      str(r.cpus), f"{r.free_bytes / (1 << 30):.1f} GiB", f"{r.clock_skew:+.3f}s")
    return table


def _age(since: float | None, now: float) -> str:
    if since is None:
        return "-"
    seconds = max(0.0, now - since)
    if seconds < 9.95:
        return f"{seconds:.1f}s"
    whole = round(seconds)  # (rounded before it is split: 119.6 s read "1m60s")
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m"


def progress(cdir: ClusterDir, record: ClusterRecord | None = None) -> dict[str, Any]:
    """The latest training figures the chief wrote (global step, loss, rates); for a program that writes none
    (a TensorFlow program), the chief's step as its log shows it; else {}."""
    found = last_record(cdir.run_dir / "metrics.jsonl", "progress")
    if found:
        return found
    chief = next((r for r in record.roles if r.role == "chief"), None) if record is not None else None
    return {"global_step": chief.global_step} if chief is not None and chief.global_step else {}


def result_of(cdir: ClusterDir, record: ClusterRecord) -> dict[str, Any] | None:
    """The cluster's result as its supervisor recorded it; where the supervisor died before it could (a stale
    cluster), as the chief left it on this machine (``run/result.json``: a new ``up`` clears the folder)."""
    if record.result is not None:
        return record.result
    try:
        found = json.loads((cdir.run_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def checkpoint_text(result: Mapping[str, Any]) -> str:
    """Where a finished run's model is: its latest checkpoint, and whether saves failed (then the latest may be
    older than the end of training, or there may be none)."""
    where = result.get("checkpoint")
    failures = result.get("checkpoint_failures")
    damaged = result.get("damaged_checkpoints") or []
    aside = f"; {len(damaged)} checkpoint(s) did not verify, the first {damaged[0]}" if damaged else ""
    if not isinstance(failures, Mapping) or not failures.get("count"):
        if not where:
            return aside[2:] if aside else "no checkpoint configured"
        return f"{where}{aside}"
    failed = f"{failures['count']} save(s) failed, the last at {failures.get('last')}"
    if not where:
        return f"none written ({failed}{aside})"
    if failures.get("final_failed"):
        return f"{where}, from before the end of training ({failed}{aside})"
    return f"{where} ({failed}{aside})"


def step_of_steps(step: int, record: ClusterRecord) -> str:
    """``1453/20000``; the step alone where the spec names no end (a TensorFlow program that counts its own)."""
    return f"{step}/{record.steps}" if record.steps else str(step)


def failing_checkpoints_text(failures: Mapping[str, Any]) -> str:
    """Checkpoint saves failing while training runs (a ps lost now would go back to the latest good one)."""
    latest = failures.get("latest")
    return (f"checkpoints failing: {failures.get('count')} save(s) failed, the last at {failures.get('last')}; the "
            f"latest written: {latest or 'none'} (the chief's log says more)")


def progress_line(cdir: ClusterDir, record: ClusterRecord) -> str:
    """One plain line of progress, for output that is not a terminal."""
    prog = progress(cdir, record)
    counts: dict[str, int] = {}
    for role in record.roles:
        counts[role.state.value] = counts.get(role.state.value, 0) + 1
    roles = ", ".join(f"{n} {state}" for state, n in counts.items())
    line = f"{record.name}: {record.state.value}; step {step_of_steps(newest_global_step(record, prog), record)}"
    if prog.get("loss") is not None:
        # the newest training batch's loss (the final line's is the test split's, not comparable)
        line += f", train loss {metric_text(prog['loss'])}, {prog.get('steps_per_sec', 0):.1f} steps/s"
    if not record.state.terminal and prog.get("checkpoint_failures"):
        line += f"; {failing_checkpoints_text(prog['checkpoint_failures'])}"
    line += f"; roles: {roles}"
    restarting = [r for r in record.roles if r.state == RoleState.RESTARTING]
    if restarting and not record.state.terminal:  # why (a role in a restart loop showed only its count for minutes)
        line += f" ({restarting[0].name}: {restarting[0].reason})"
    return line


def status_dict(cdir: ClusterDir, record: ClusterRecord, *, stale: bool) -> dict[str, Any]:
    data = record.to_dict()
    data["stale"] = stale
    if record.backend == "slurm":
        from psctl.slurm_cluster import job_id

        data["slurm"] = {**record.slurm, "job_id": job_id(record)}
    data["progress"] = progress(cdir, record)
    data["result"] = result_of(cdir, record)
    data["logs"] = str(cdir.logs)
    return data


def _role_row(role: RoleRecord, now: float, global_step: int, record: ClusterRecord) -> list[Any]:
    slurm = record.backend == "slurm"
    alive = not role.state.terminal and role.state != RoleState.RESTARTING
    return [
        role.name,
        role.node or ("-" if slurm else role.host),  # a Slurm job step's node (none before the job has nodes)
        str(role.pid) if role.pid and alive else "-",
        Text(role.state.value, style=STATE_STYLE.get(role.state, "")),
        f"{role.attempt}/{role.restarts}",
        _age(role.started_at, now) if alive else "-",
        _age(role.last_heartbeat, now) if alive else "-",
        _step_cell(role, global_step, watched=record.framework == "tensorflow"),
    ]


def _step_cell(role: RoleRecord, global_step: int, *, watched: bool = False) -> str:
    """A worker's own steps, the cluster's global step for the chief (as the header shows it), the global step
    of the checkpoint an evaluator is at; a ps runs no steps (``psctl top`` shows its requests per second).
    A TensorFlow program's roles (``watched``) other than the chief: the step they last printed, if any (a
    worker's own steps are TensorFlow's, unknown to psctl)."""
    if not role.last_heartbeat or role.role == "ps":
        return "-"
    if watched and role.role != "chief":
        return str(role.global_step) if role.global_step else "-"
    return str({"worker": role.local_step, "chief": global_step}.get(role.role, role.global_step))


def newest_global_step(record: ClusterRecord, prog: dict[str, Any]) -> int:
    """The newest global step known: the chief's metrics and its heartbeats are written at their own times, and
    either may be the later one."""
    chief = max((r.global_step for r in record.roles if r.role == "chief"), default=0)
    return max(int(prog.get("global_step", 0)), chief)


def status_view(cdir: ClusterDir, record: ClusterRecord, *, stale: bool, now: float | None = None) -> Group:
    now = time.time() if now is None else now
    prog = progress(cdir, record)
    step = newest_global_step(record, prog)
    header = Text()
    header.append(f"cluster {record.name} ", style="bold")
    header.append(record.state.value, style="bold red" if record.state.value == "failed" else "bold")
    if stale:
        header.append("  (stale: the supervisor is not running; this is the last known state)", style="yellow")
    if record.backend == "slurm":
        from psctl.slurm_cluster import job_id

        nodes = record.slurm.get("nodes")
        where = f" on {', '.join(nodes)}" if nodes else "" if record.state.terminal else " (waiting for its nodes)"
        again = f", requeued {record.slurm['restarts']}x" if record.slurm.get("restarts") else ""
        header.append(f"\nSlurm job {job_id(record) or '-'}{where}{again}")
    if record.spec_overrides:  # what tells the runs of a sweep over one file apart
        # as a shell would take it back (`psctl up` followed by this line runs the same spec)
        header.append("\nspec: " + shlex.join([record.spec_path or "-",
                                               *(a for o in record.spec_overrides for a in ("--set", o))]))
    header.append(f"\nglobal step {step_of_steps(step, record)}")
    if prog.get("loss") is not None:
        header.append(f"  train loss {metric_text(prog['loss'])}")
    if prog.get("steps_per_sec"):
        header.append(f"  {prog['steps_per_sec']:.1f} steps/s  {prog.get('examples_per_sec', 0):.0f} examples/s")
    if not record.state.terminal and prog.get("checkpoint_failures"):
        header.append(f"\n{failing_checkpoints_text(prog['checkpoint_failures'])}", style="yellow")
    for role in record.roles:
        if role.role == "evaluator" and role.metrics:
            shown = metrics_text(dict(sorted(role.metrics.items())), skip=(CPU_METRIC,))
            if shown:  # (its heartbeats carry its CPU before any evaluation)
                header.append(f"\nevaluator: global step {role.global_step}: {shown}")
    result = result_of(cdir, record)
    if result:
        shown = metrics_text(result.get("metrics", {}))
        header.append(f"\nresult (test split): {shown}")
        if result.get("checkpoint") or result.get("checkpoint_failures"):
            failed = bool(result.get("checkpoint_failures"))
            header.append(f"  checkpoint {checkpoint_text(result)}", style="yellow" if failed else "")
    if record.reason and record.state.terminal:
        header.append(f"\nreason: {record.reason}")
    if not record.state.terminal:
        for host, problem in sorted(record.host_problems.items()):
            named = problem.startswith(f"host {host} ")  # (an SSH error names the host and its address)
            header.append(f"\n{problem}" if named else f"\nhost {host}: {problem}", style="yellow")
    table = Table(box=None, pad_edge=False)
    where = "node" if record.backend == "slurm" else "host"
    rows = [_role_row(role, now, step, record) for role in record.roles]
    # What a reader acts on (``psctl logs worker-12``, ``ssh host``, a role's state and step) is never cut
    # short: a narrow console shortens the other columns; attempts and restarts head two lines (cells "1/0").
    kept = {"role", where, "state", "step"}
    for i, col in enumerate(("role", where, "pid", "state", "attempt/\nrestarts", "uptime", "heartbeat", "step")):
        if col in kept:
            table.add_column(col, no_wrap=True, min_width=max([len(col), *(len(str(cells[i])) for cells in rows)]))
        else:
            table.add_column(col)
    for cells in rows:
        table.add_row(*cells)
    return Group(header, table)

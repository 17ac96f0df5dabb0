"""``psctl top``: where a running cluster's time goes, per role, from what its heartbeats report.

Workers: steps/s, step time p50/p99, the share of wall time in input+pull, compute, push and waiting, bytes
moved per second, CPU and memory. PS: requests/s, bytes held, CPU and memory. Flags: a worker slower than
half the workers' median rate is a straggler; a PS with more than 1.5x the median requests/s or CPU of the
PS is hot. Everything comes from ``state.json`` (the supervisor writes every role's latest heartbeat metrics
there each second): ``top`` works from any terminal, and ``--json`` gives the same rows to scripts.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from psctl.runtime.metrics import CPU_METRIC
from psctl.supervisor.state import ClusterRecord, RoleRecord

STRAGGLER = 0.5  # a worker below this fraction of the workers' median steps/s
HOT = 1.5  # a PS above this multiple of the PS' median requests/s or CPU

WORKER_COLUMNS = ("role", "host", "state", "steps/s", "p50 ms", "p99 ms", "pull", "compute", "push", "wait",
                  "MB/s", "cpu", "rss MB", "flag")
PS_COLUMNS = ("role", "host", "state", "req/s", "held MB", "cpu", "rss MB", "flag")
OTHER_COLUMNS = ("role", "host", "state", "global step", "steps/s", "cpu", "rss MB")


def _row(role: RoleRecord) -> dict[str, Any]:
    m = role.metrics
    row: dict[str, Any] = {
        "role": role.name, "kind": role.role, "host": role.host, "state": role.state.value,
        "steps_per_s": role.steps_per_sec or 0.0, "global_step": role.global_step, "local_step": role.local_step,
        "cpu": m.get(CPU_METRIC), "rss_mb": role.rss_bytes / 1e6 if role.rss_bytes else None,
    }
    if role.role == "worker":
        row["steps_per_s"] = m.get("steps_per_s", row["steps_per_s"])
        row.update(step_ms_p50=m.get("step_ms_p50"), step_ms_p99=m.get("step_ms_p99"),
                   pull=m.get("pull_frac"), compute=m.get("compute_frac"), push=m.get("push_frac"),
                   wait=m.get("wait_frac"), mb_per_s=m["bytes_per_s"] / 1e6 if "bytes_per_s" in m else None)
    elif role.role == "ps":
        row.update(requests_per_s=m.get("requests_per_s"),
                   held_mb=m["bytes_held"] / 1e6 if "bytes_held" in m else None)
    row["flags"] = []
    return row


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def snapshot(record: ClusterRecord) -> dict[str, Any]:
    """The rows ``top`` shows, flags included (what ``top --json`` prints)."""
    rows = [_row(r) for r in record.roles]
    workers = [r for r in rows if r["kind"] == "worker" and r["state"] in ("running", "stalled")]
    rate = _median([r["steps_per_s"] for r in workers])
    for r in workers:
        if len(workers) > 1 and rate > 0 and r["steps_per_s"] < STRAGGLER * rate:
            r["flags"].append("straggler")
    ps = [r for r in rows if r["kind"] == "ps" and r["state"] == "running"]
    for key in ("requests_per_s", "cpu"):
        typical = _median([r[key] for r in ps if r[key] is not None])
        for r in ps:
            if len(ps) > 1 and typical > 0 and (r[key] or 0) > HOT * typical and "hot" not in r["flags"]:
                r["flags"].append("hot")
    return {"cluster": record.name, "state": record.state.value, "global_step": max(
        (r.global_step for r in record.roles if r.role == "chief"), default=0), "steps": record.steps,
        "roles": rows}


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def top_view(record: ClusterRecord) -> Group:
    snap = snapshot(record)
    head = Text(f"cluster {snap['cluster']} {snap['state']}   global step {snap['global_step']}/{snap['steps']}",
                style="bold")
    tables: list[Any] = [head]
    kinds = {"worker": ("workers", WORKER_COLUMNS), "ps": ("parameter servers", PS_COLUMNS)}
    for kind, (title, columns) in kinds.items():
        rows = [r for r in snap["roles"] if r["kind"] == kind]
        if not rows:
            continue
        table = Table(title=title, title_justify="left", expand=False)
        for col in columns:
            table.add_column(col, justify="left" if col in ("role", "host", "state", "flag") else "right")
        for r in rows:
            flag = Text(" ".join(r["flags"]), style="bold yellow") if r["flags"] else ""
            cells = [r["role"], r["host"], r["state"]]
            if kind == "worker":
                cells += [_num(r["steps_per_s"]), _num(r["step_ms_p50"]), _num(r["step_ms_p99"]), _pct(r["pull"]),
                          _pct(r["compute"]), _pct(r["push"]), _pct(r["wait"]), _num(r["mb_per_s"], "{:.2f}")]
            else:
                cells += [_num(r["requests_per_s"]), _num(r["held_mb"], "{:.2f}")]
            table.add_row(*cells, _pct(r["cpu"]), _num(r["rss_mb"], "{:.0f}"), flag)
        tables.append(table)
    others = [r for r in snap["roles"] if r["kind"] not in kinds]
    if others:
        table = Table(title="chief and evaluator", title_justify="left")
        for col in OTHER_COLUMNS:
            table.add_column(col, justify="left" if col in ("role", "host", "state") else "right")
        for r in others:
            table.add_row(r["role"], r["host"], r["state"], str(r["global_step"]), _num(r["steps_per_s"]),
                          _pct(r["cpu"]), _num(r["rss_mb"], "{:.0f}"))
        tables.append(table)
    return Group(*tables)

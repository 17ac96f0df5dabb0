"""``psctl top``: where a running cluster's time goes, per role, from what its heartbeats report.

Workers: steps/s, step time p50/p99, the share of wall time in input+pull, compute, push and waiting, bytes
moved per second, CPU and memory. PS: requests/s, bytes held, CPU and memory. Flags: a worker slower than
half the workers' median rate is a straggler; a PS with more than 1.5x the median requests/s or CPU of the
PS is hot. Everything comes from ``state.json`` (the supervisor writes every role's latest heartbeat metrics
there each second): ``top`` works from any terminal, and ``--json`` gives the same rows to scripts. A terminal
too narrow for every column (80 wide shows about half a worker's) loses the columns read least first, never a
role's name, state or flags, and a last line names the columns it left out.
"""

from __future__ import annotations

import statistics
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from psctl.runtime.metrics import CPU_METRIC
from psctl.supervisor.state import ClusterRecord, RoleRecord, RoleState

STRAGGLER = 0.5  # a worker below this fraction of the workers' median steps/s
HOT = 1.5  # a PS above this multiple of the PS' median requests/s or CPU

#: Each table's columns, and how long each stays as the terminal narrows: the lowest number goes first, and
#: what a reader acts on (``ALWAYS``: the role, its state, its flags) stays whatever the width.
ALWAYS = 100
WORKER_COLUMNS = {"role": ALWAYS, "host": 50, "state": ALWAYS, "steps/s": 90, "p50 ms": 80, "p99 ms": 35,
                  "pull": 30, "compute": 65, "push": 30, "wait": 70, "MB/s": 25, "cpu": 60, "rss MB": 40,
                  "flag": ALWAYS}
PS_COLUMNS = {"role": ALWAYS, "host": 50, "state": ALWAYS, "req/s": 90, "held MB": 40, "cpu": 80, "rss MB": 45,
              "flag": ALWAYS}
OTHER_COLUMNS = {"role": ALWAYS, "host": 50, "state": ALWAYS, "global step": 90, "steps/s": 80, "cpu": 60,
                 "rss MB": 40}
_LEFT = ("role", "host", "state", "flag")


#: The states whose heartbeat figures are current: a role stopped, lost or ended shows its steps, not the rates
#: and CPU of its last heartbeat as if it still ran.
_LIVE = frozenset({RoleState.RUNNING, RoleState.STALLED})


def _row(role: RoleRecord, counts_steps: bool) -> dict[str, Any]:
    """(``counts_steps``: the role runs psctl's runtime, or is a TensorFlow program's chief, which prints its
    steps; a TensorFlow server's steps are not known to psctl: none shown, not 0.)"""
    live = role.state in _LIVE
    m = role.metrics if live else {}
    row: dict[str, Any] = {
        "role": role.name, "kind": role.role, "host": role.host, "state": role.state.value,
        "steps_per_s": (role.steps_per_sec or 0.0) if live and counts_steps else None,
        "global_step": role.global_step,
        "local_step": role.local_step, "cpu": m.get(CPU_METRIC),
        "rss_mb": role.rss_bytes / 1e6 if live and role.rss_bytes else None,
    }
    if role.role == "worker":
        if counts_steps:
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
    tensorflow = record.framework == "tensorflow"
    rows = [_row(r, not tensorflow or r.role == "chief") for r in record.roles]
    workers = [r for r in rows if r["kind"] == "worker" and r["state"] in _LIVE and r["steps_per_s"] is not None]
    rate = _median([r["steps_per_s"] for r in workers])
    for r in workers:
        if len(workers) > 1 and rate > 0 and r["steps_per_s"] < STRAGGLER * rate:
            r["flags"].append("straggler")
    ps = [r for r in rows if r["kind"] == "ps" and r["state"] in _LIVE]
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


def _fitted(title: str, columns: dict[str, int], rows: list[dict[str, Any]], width: int | None,
            console: Console) -> tuple[Table, list[str]]:
    """The table of ``rows`` (header -> cell) with as many of ``columns`` as fit in ``width`` (all where None),
    and the headers left out."""
    shown = list(columns)
    while True:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      collapse_padding=True)
        for col in shown:
            table.add_column(col, justify="left" if col in _LEFT else "right", no_wrap=True)
        for row in rows:
            table.add_row(*(row[col] for col in shown))
        droppable = [col for col in shown if columns[col] < ALWAYS]
        if width is None or not droppable or Measurement.get(console, console.options, table).maximum <= width:
            # (measured on a console wider than any table: a measurement is clamped to its console's width)
            return table, [col for col in columns if col not in shown]
        shown.remove(min(reversed(droppable), key=columns.__getitem__))  # (of equals, the rightmost)


def _cells(r: dict[str, Any]) -> dict[str, Any]:
    """A snapshot row's cells, by column header."""
    cells: dict[str, Any] = {
        "role": r["role"], "host": r["host"], "state": r["state"], "steps/s": _num(r["steps_per_s"]),
        "global step": str(r["global_step"]), "cpu": _pct(r["cpu"]), "rss MB": _num(r["rss_mb"], "{:.0f}"),
        "flag": Text(" ".join(r["flags"]), style="bold yellow") if r["flags"] else "",
    }
    if r["kind"] == "worker":
        cells.update({"p50 ms": _num(r["step_ms_p50"]), "p99 ms": _num(r["step_ms_p99"]), "pull": _pct(r["pull"]),
                      "compute": _pct(r["compute"]), "push": _pct(r["push"]), "wait": _pct(r["wait"]),
                      "MB/s": _num(r["mb_per_s"], "{:.2f}")})
    elif r["kind"] == "ps":
        cells.update({"req/s": _num(r["requests_per_s"]), "held MB": _num(r["held_mb"], "{:.2f}")})
    return cells


def top_view(record: ClusterRecord, width: int | None = None) -> Group:
    """The view of ``record``'s roles, its tables no wider than ``width`` where given: the columns read least
    are left out first, and a last line names them."""
    snap = snapshot(record)
    head = Text(f"cluster {snap['cluster']} {snap['state']}   global step {snap['global_step']}/{snap['steps']}",
                style="bold")
    parts: list[Any] = [head]
    console = Console(width=10_000)
    hidden: list[str] = []  # "table: columns", for each table that left some out
    tables = {"worker": ("workers", WORKER_COLUMNS), "ps": ("parameter servers", PS_COLUMNS),
              "other": ("chief and evaluator", OTHER_COLUMNS)}
    for kind, (title, columns) in tables.items():
        rows = [_cells(r) for r in snap["roles"] if (r["kind"] if r["kind"] in tables else "other") == kind]
        if rows:
            table, left_out = _fitted(title, columns, rows, width, console)
            parts.append(table)
            if left_out:
                hidden.append(f"{title}: {', '.join(left_out)}")
    if hidden:
        parts.append(Text(f"hidden at this width: {'; '.join(hidden)}", style="dim"))
    return Group(*parts)

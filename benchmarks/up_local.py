"""How long ``psctl up`` takes on this machine, phase by phase, for a spec that trains to the end. One JSON line.

    python -m benchmarks.up_local [--spec cluster_examples/local.yaml] [--runs 3] [--psctl-root DIR]

Each run is ``psctl up SPEC`` (attached, as a user types it) with a private ``PSCTL_HOME``; the phases come from
the cluster's own event log (``events.jsonl``: the supervisor's clock, the same machine's) and this process's
clock around the command:

| field | from | to |
|---|---|---|
| `to_agent_s` | the command starts | the host's agent has attached to the supervisor (CLI, plan, TLS, supervisor) |
| `to_roles_up_s` | the agent attached | every role heartbeats (the roles' imports and data) |
| `training_s` | every role is up | the chief has succeeded |
| `to_cluster_end_s` | the chief has succeeded | the cluster has succeeded (every other role stopped) |
| `to_command_end_s` | the cluster has succeeded | the command has returned |
| `total_s` | the command starts | the command has returned |

Beside them, how long a command takes that only reads (medians of 10): `command_start_s`, ``psctl --help``
from start to exit (what every command pays before its work); `status_s` and `logs_s`, ``psctl status`` and
``psctl logs chief-0`` of the cluster just finished; and their ceiling, `python_start_s`, ``python -c pass``
with the same interpreter.
Figures are medians over ``--runs``; `runs` lists each run's. ``--psctl-root DIR`` runs another psctl tree (a
``git worktree`` of an older commit) with this Python, to compare two trees on the same machine in turn; the
tree is byte-compiled first (``compile_tree``), as the one in use already is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, emit_all, install_signal_handlers, log, machine, median, rounded

PHASES = ("to_agent_s", "to_roles_up_s", "training_s", "to_cluster_end_s", "to_command_end_s", "total_s")


def _psctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "psctl", *args]  # the tree on PYTHONPATH (_env) comes before the installed one


def _env(root: Path, home: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PSCTL_HOME": str(home), "PYTHONPATH": path}


def _first(events: list[dict[str, Any]], role: str, to: str) -> float:
    found = next((e["time"] for e in events if e.get("role") == role and e.get("to") == to), None)
    if found is None:
        raise RuntimeError(f"the cluster's events.jsonl has no {role} -> {to}")
    return float(found)


def one_run(root: Path, spec: Path, timeout: float, *, measure_reads: bool = False) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="psctl-up-bench-"))
    env = _env(root, home)
    try:
        started = time.time()
        done = subprocess.run(_psctl("up", str(spec)), env=env, cwd=root, capture_output=True, text=True,
                              timeout=timeout)
        ended = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"psctl up failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        (events_file,) = home.glob("*/events.jsonl")
        events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
        agent = _first(events, "host localhost", "reachable")
        roles_up = _first(events, "cluster", "running")
        chief_done = _first(events, "chief-0", "succeeded")
        cluster_done = _first(events, "cluster", "succeeded")
        return {"to_agent_s": agent - started, "to_roles_up_s": roles_up - agent, "training_s": chief_done - roles_up,
                "to_cluster_end_s": cluster_done - chief_done, "to_command_end_s": ended - cluster_done,
                "total_s": ended - started, **(read_commands(root, home) if measure_reads else {})}
    finally:
        subprocess.run(_psctl("down"), env=env, cwd=root, capture_output=True, timeout=120)
        shutil.rmtree(home, ignore_errors=True)


def command_time(command: list[str], env: dict[str, str], cwd: Path, repeats: int = 10) -> float:
    """Median seconds of ``command`` from start to exit (it must succeed)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, env=env, cwd=cwd, capture_output=True, check=True, timeout=60)
        times.append(time.perf_counter() - started)
    return median(times)


def read_commands(root: Path, home: Path) -> dict[str, float]:
    """The commands that only read, against the cluster under ``home``, and the interpreter's own start."""
    env = _env(root, home)
    return {
        "command_start_s": command_time(_psctl("--help"), env, root),
        "status_s": command_time(_psctl("status"), env, root),
        "logs_s": command_time(_psctl("logs", "chief-0"), env, root),
        "python_start_s": command_time([sys.executable, "-c", "pass"], env, root),
    }


def compile_tree(root: Path) -> None:
    """Byte-compile the tree's psctl first: where PYTHONDONTWRITEBYTECODE is set (CI images, this project's
    machines) a tree never run before compiles every module in every process it starts, ~0.1 s each, which
    would be timed as that tree's start (a fresh ``git worktree`` against this checkout, most of all)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(root / "psctl")], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="cluster_examples/local.yaml", help="a spec that trains to the end")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--psctl-root", type=Path, default=REPO_ROOT, help="run psctl from this tree instead")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one psctl up")
    args = parser.parse_args(argv)
    install_signal_handlers()
    root = args.psctl_root.resolve()
    spec = (REPO_ROOT / args.spec).resolve() if not Path(args.spec).is_absolute() else Path(args.spec)

    def run() -> list[dict[str, Any]]:
        compile_tree(root)
        runs = []
        for i in range(args.runs):
            log(f"run {i + 1}/{args.runs}: psctl up {spec} (psctl from {root})")
            runs.append(one_run(root, spec, args.timeout, measure_reads=i == 0))
        record: dict[str, Any] = {"benchmark": "up_local", "spec": str(args.spec), "psctl_root": str(root),
                                  "ok": True}
        record.update({phase: rounded(median([r[phase] for r in runs])) for phase in PHASES})
        record.update({k: rounded(v, 3) for k, v in runs[0].items() if k not in PHASES})
        record["runs"] = [{k: rounded(v) for k, v in r.items()} for r in runs]
        record["machine"] = machine()
        return [record]

    return emit_all("up_local", run)


if __name__ == "__main__":
    sys.exit(main())

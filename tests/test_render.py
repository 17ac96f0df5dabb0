"""``psctl status``'s table at the widths terminals have: what a reader acts on is never cut short."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rich.console import Console

from psctl.home import ClusterDir
from psctl.render import progress_line, status_view
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState

ROLES = [("chief", "chief", 0), ("ps-0", "ps", 0), ("worker-0", "worker", 0), ("worker-11", "worker", 11),
         ("evaluator", "evaluator", 0)]


def shown(tmp_path: Path, host: str, width: int, metrics_step: int | None = None) -> list[str]:
    """The status of a cluster whose roles' heartbeats say global step 12345 (and whose chief's metrics file says
    ``metrics_step``, where given)."""
    now = time.time()
    roles = [RoleRecord(name=name, role=role, index=index, host=host, address="127.0.0.1", port=1,
                        state=RoleState.RESTARTING if name == "worker-11" else RoleState.RUNNING, pid=4_194_301,
                        attempt=2, restarts=1, started_at=now - 75, last_heartbeat=now - 0.4, global_step=12345,
                        local_step=6100)
             for name, role, index in ROLES]
    record = ClusterRecord(name="mnist", cluster_id="c", state=ClusterState.RUNNING, steps=40000, roles=roles)
    cdir = ClusterDir(tmp_path / "mnist")
    if metrics_step is not None:
        cdir.run_dir.mkdir(parents=True)
        line = {"event": "progress", "global_step": metrics_step, "loss": 0.5, "steps_per_sec": 10.0}
        (cdir.run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    console = Console(width=width, record=True)
    console.print(status_view(cdir, record, stale=False, now=now))
    return console.export_text().splitlines()


def test_at_80_columns_a_local_cluster_shows_every_column_whole(tmp_path: Path) -> None:
    lines = shown(tmp_path, "localhost", 80)
    assert "…" not in "\n".join(lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("role"))
    assert "attempt/" in lines[header - 1] and "restarts" in lines[header]
    assert lines[header].split() == ["role", "host", "pid", "state", "restarts", "uptime", "heartbeat", "step"]
    assert "worker-0 localhost 4194301 running 2/1 1m15s 0.4s 6100" in [" ".join(line.split()) for line in lines]


@pytest.mark.parametrize(("width", "host"), [(80, "gpu-node-17.us-east1.example.internal"), (60, "node-17.example")])
def test_a_narrow_console_shortens_other_columns_never_names_states_or_steps(
        tmp_path: Path, width: int, host: str) -> None:
    lines = shown(tmp_path, host, width)
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in dict.fromkeys(
        name for name, _, _ in ROLES)}
    assert set(rows) == {name for name, _, _ in ROLES}
    for name, cells in rows.items():
        assert cells[1] == host
        assert ("restarting" if name == "worker-11" else "running") in cells
    assert rows["worker-0"][-1] == "6100" and rows["chief"][-1] == "12345" and rows["ps-0"][-1] == "-"


@pytest.mark.parametrize(("metrics_step", "newest"), [(12400, 12400), (12000, 12345)])
def test_the_header_and_the_chief_show_the_newest_global_step_of_its_metrics_and_heartbeat(
        tmp_path: Path, metrics_step: int, newest: int) -> None:
    lines = shown(tmp_path, "localhost", 100, metrics_step=metrics_step)
    assert any(line.startswith(f"global step {newest}/40000") for line in lines), lines
    chief = next(line.split() for line in lines if line.startswith("chief"))
    assert chief[-1] == str(newest) and "evaluator" not in chief
    assert next(line.split() for line in lines if line.startswith("evaluator"))[-1] == "12345"  # its checkpoint's


def test_a_host_problem_that_names_its_host_is_shown_once(tmp_path: Path) -> None:
    """An SSH error names the host and says it is unreachable itself: status does not say it twice."""
    record = ClusterRecord(name="mnist", cluster_id="c", state=ClusterState.RUNNING, steps=10, roles=[],
                           host_problems={"h3": "host h3 (10.0.0.3:22): unreachable: connection timed out after 5s",
                                          "h2": "unreachable: agent silent for 6.0s (host down or cut off)"})
    console = Console(width=200, record=True)
    console.print(status_view(ClusterDir(tmp_path / "mnist"), record, stale=False))
    lines = console.export_text().splitlines()
    assert "host h3 (10.0.0.3:22): unreachable: connection timed out after 5s" in lines, lines
    assert "host h2: unreachable: agent silent for 6.0s (host down or cut off)" in lines, lines


def test_a_slurm_cluster_s_roles_show_no_node_before_its_job_has_nodes(tmp_path: Path) -> None:
    roles = [RoleRecord("chief-0", "chief", 0, "localhost", "127.0.0.1", 7400),
             RoleRecord("ps-0", "ps", 0, "localhost", "127.0.0.1", 7410, node="n2")]
    record = ClusterRecord(name="sl", cluster_id="c", state=ClusterState.FAILED, steps=10, roles=roles,
                           backend="slurm")
    console = Console(width=120, record=True)
    console.print(status_view(ClusterDir(tmp_path / "sl"), record, stale=False))
    rows = {line.split()[0]: line.split() for line in console.export_text().splitlines() if line.split()}
    assert rows["chief-0"][1] == "-" and rows["ps-0"][1] == "n2", rows


def test_a_tensorflow_program_s_workers_show_the_step_they_printed_or_none(tmp_path: Path) -> None:
    """psctl reads a TensorFlow program's steps from what it prints: a worker that prints none (TF2's) shows
    "-", not a step 0 it never was at; one that prints the global step (TF1's hooks) shows that."""
    now = time.time()
    printed = {"chief-0": 300, "ps-0": 0, "worker-0": 0, "worker-1": 250}
    roles = [RoleRecord(name=name, role=name.split("-")[0], index=0, host="localhost", address="127.0.0.1", port=1,
                        state=RoleState.RUNNING, pid=4242, attempt=1, started_at=now - 30, last_heartbeat=now - 0.5,
                        global_step=step)
             for name, step in printed.items()]
    record = ClusterRecord(name="tf", cluster_id="c", state=ClusterState.RUNNING, steps=1000, roles=roles,
                           framework="tensorflow")
    console = Console(width=120, record=True)
    console.print(status_view(ClusterDir(tmp_path / "tf"), record, stale=False, now=now))
    steps = {line.split()[0]: line.split()[-1] for line in console.export_text().splitlines()
             if line.split() and line.split()[0] in printed}
    assert steps == {"chief-0": "300", "ps-0": "-", "worker-0": "-", "worker-1": "250"}, steps
    # a program that counts its own steps (no training.steps): its step alone, not "300/0"
    record.steps = 0
    console = Console(width=120, record=True)
    console.print(status_view(ClusterDir(tmp_path / "tf"), record, stale=False, now=now))
    assert console.export_text().splitlines()[1] == "global step 300"
    assert "step 300;" in progress_line(ClusterDir(tmp_path / "tf"), record)
    # a role in a restart loop: why, not only that (minutes of "roles: 2 restarting" before the failure said)
    roles[2].state, roles[2].reason = RoleState.RESTARTING, "exit code 1: RuntimeError: boom; restart 3 in 4.0s"
    assert progress_line(ClusterDir(tmp_path / "tf"), record).endswith(
        "roles: 3 running, 1 restarting (worker-0: exit code 1: RuntimeError: boom; restart 3 in 4.0s)")


@pytest.mark.parametrize(("seconds", "shown"), [
    (0.0, "0.0s"), (9.94, "9.9s"), (9.96, "10s"), (59.4, "59s"), (59.6, "1m00s"), (119.6, "2m00s"),
    (61.0, "1m01s"), (3599.6, "1h00m"), (3600 + 59 * 60 + 45, "2h00m"), (7384.0, "2h03m"),
])
def test_an_age_is_rounded_before_it_is_split(seconds: float, shown: str) -> None:
    """An uptime of 119.6 s read "1m60s" (the seconds rounded after the minutes were taken), 59.6 s "60s"."""
    from psctl.render import _age

    assert _age(1000.0, 1000.0 + seconds) == shown


def test_the_spec_line_of_a_run_with_set_values_is_taken_back_whole_by_a_shell(tmp_path: Path) -> None:
    """`spec: cluster.yaml --set training.optimizer={name: sgd}` could not be pasted back: the shell split it."""
    import shlex

    record = ClusterRecord(name="sweep-1", cluster_id="c", state=ClusterState.RUNNING, steps=10, roles=[],
                           spec_path="/runs/my spec.yaml",
                           spec_overrides=["training.optimizer={name: sgd, learning_rate: 0.1}", "name=sweep-1"])
    console = Console(width=200, record=True)
    console.print(status_view(ClusterDir(tmp_path / "sweep-1"), record, stale=False))
    line = next(x for x in console.export_text().splitlines() if x.startswith("spec: "))
    assert shlex.split(line.removeprefix("spec: ")) == [
        "/runs/my spec.yaml", "--set", "training.optimizer={name: sgd, learning_rate: 0.1}", "--set", "name=sweep-1"]

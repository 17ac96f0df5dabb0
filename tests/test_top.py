"""``psctl top``: its flags from given metrics, and the live view of a real cluster as a person sees it, in a
real terminal (tmux)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cluster_helpers import wait_until
from conftest import PsctlEnv, psctl_binary
from rich.console import Console
from supervised_cluster import SupervisedCluster

from psctl.cli import cli
from psctl.home import ClusterDir
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, save_state
from psctl.top import snapshot, top_view


def role(name: str, state: RoleState = RoleState.RUNNING, **metrics: float) -> RoleRecord:
    kind = name.split("-")[0]
    return RoleRecord(name, kind, int(name.split("-")[1]), "localhost", "127.0.0.1", 1, state=state,
                      metrics=metrics, rss_bytes=100_000_000, local_step=7)


def test_stragglers_and_hot_parameter_servers_are_flagged(tmp_path: Path) -> None:
    cdir = ClusterDir(tmp_path / "home" / "flags")
    cdir.create()
    record = ClusterRecord(name="flags", cluster_id="flags-1", state=ClusterState.RUNNING, steps=100, roles=[
        role("chief-0", cpu=0.1),
        role("ps-0", requests_per_s=100, bytes_held=4e6, cpu=0.2),
        role("ps-1", requests_per_s=110, bytes_held=4e6, cpu=0.2),
        role("ps-2", requests_per_s=400, bytes_held=40e6, cpu=0.9),  # the hot shard
        *(role(f"worker-{i}", steps_per_s=50, step_ms_p50=10, step_ms_p99=30, pull_frac=0.2, compute_frac=0.5,
               push_frac=0.2, wait_frac=0.1, bytes_per_s=2e6, cpu=0.8) for i in range(3)),
        role("worker-3", steps_per_s=10, step_ms_p50=90, step_ms_p99=200, pull_frac=0.1, compute_frac=0.85,
             push_frac=0.05, wait_frac=0.0, bytes_per_s=0.4e6, cpu=1.0),  # the straggler
        # scaled away: its last heartbeat's figures are not shown as if it ran (nor is it a straggler)
        role("worker-4", RoleState.STOPPED, steps_per_s=1, step_ms_p50=900, cpu=0.7, bytes_per_s=1e6),
        role("ps-3", RoleState.LOST, requests_per_s=999, bytes_held=4e6, cpu=0.9),
    ])
    save_state(cdir.state_file, record)
    result = CliRunner().invoke(cli, ["top", "flags", "--json"], env={"PSCTL_HOME": str(tmp_path / "home")})
    assert result.exit_code == 0, result.output
    rows = {r["role"]: r for r in json.loads(result.output)["roles"]}
    assert {name for name, r in rows.items() if r["flags"]} == {"ps-2", "worker-3"}
    assert rows["ps-2"]["flags"] == ["hot"] and rows["worker-3"]["flags"] == ["straggler"]
    assert (rows["worker-3"]["steps_per_s"], rows["worker-3"]["compute"], rows["ps-2"]["held_mb"]) == (10, 0.85, 40)
    gone = (rows["worker-4"], rows["ps-3"])
    assert all(r[k] is None for r in gone for k in ("steps_per_s", "cpu", "rss_mb")), gone
    assert (rows["worker-4"]["step_ms_p50"], rows["worker-4"]["local_step"], rows["ps-3"]["requests_per_s"]) == (
        None, 7, None)
    shown = CliRunner().invoke(cli, ["top", "flags"], env={"PSCTL_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    straggler = next(line for line in shown.output.splitlines() if "worker-3" in line)
    assert "straggler" in straggler and "85%" in straggler and "90.0" in straggler
    stopped = next(line for line in shown.output.splitlines() if "worker-4" in line)
    assert "stopped" in stopped and "900" not in stopped and "70%" not in stopped, stopped


def test_a_tensorflow_program_s_servers_show_no_rate_rather_than_zero(tmp_path: Path) -> None:
    """psctl does not know the steps of TensorFlow's servers (ps, workers): `top` showed 0.0 steps/s for each
    worker of a training that ran at hundreds; its chief prints its steps, so its rate is shown."""
    chief = role("chief-0", cpu=0.5)
    chief.steps_per_sec = 250.0
    record = ClusterRecord(name="tf", cluster_id="tf-1", state=ClusterState.RUNNING, steps=1000,
                           framework="tensorflow", roles=[chief, role("ps-0", cpu=0.2),
                                                          role("worker-0", cpu=0.9), role("worker-1", cpu=0.9)])
    rows = {r["role"]: r for r in snapshot(record)["roles"]}
    assert rows["chief-0"]["steps_per_s"] == 250.0
    assert [rows[r]["steps_per_s"] for r in ("ps-0", "worker-0", "worker-1")] == [None, None, None]
    console = Console(width=200, record=True)
    console.print(top_view(record, 200))
    worker = next(line for line in console.export_text().splitlines() if "worker-0" in line)
    assert worker.split()[3] == "-" and "0.0" not in worker, worker  # (role, host, state, steps/s)
    record.framework = "psctl"  # psctl's own workers that have not stepped yet: 0
    assert snapshot(record)["roles"][2]["steps_per_s"] == 0.0


def test_a_narrow_terminal_hides_the_columns_read_least_and_says_which(tmp_path: Path) -> None:
    record = ClusterRecord(name="narrow", cluster_id="narrow-1", state=ClusterState.RUNNING, steps=100, roles=[
        role("chief-0", cpu=0.1), role("ps-0", requests_per_s=100, bytes_held=4e6, cpu=0.2),
        *(role(f"worker-{i}", steps_per_s=50 if i < 11 else 10, step_ms_p50=10, step_ms_p99=30, pull_frac=0.2,
               compute_frac=0.5, push_frac=0.2, wait_frac=0.1, bytes_per_s=2e6, cpu=0.8) for i in (0, 1, 11)),
    ])

    def shown(width: int) -> list[str]:
        console = Console(width=width, record=True)
        console.print(top_view(record, width))
        return console.export_text().splitlines()

    wide = shown(200)
    assert not any(line.startswith("hidden") for line in wide) and "…" not in "\n".join(wide)
    header = next(line for line in wide if line.startswith("role") and "p50 ms" in line)
    assert header.split()[0] == "role" and "pull" in header and "MB/s" in header
    for width in (80, 60):
        lines = shown(width)
        assert all(len(line) <= width for line in lines) and "…" not in "\n".join(lines)
        header = next(line for line in lines if line.startswith("role") and "steps/s" in line).split()
        assert header[:2] == ["role", "host"] or header[:2] == ["role", "state"]
        assert {"state", "steps/s", "flag"} <= set(header) and "pull" not in header and "MB/s" not in header
        straggler = next(line for line in lines if line.startswith("worker-11")).split()
        assert straggler[-1] == "straggler" and "running" in straggler and "10.0" in straggler
        hidden = " ".join(lines[lines.index(next(line for line in lines if line.startswith("hidden"))):])
        assert "pull" in hidden and "MB/s" in hidden and "steps/s" not in hidden
        # each table's own: a column the workers' table left out and the ps' shows is not called hidden there
        said = dict(part.split(": ", 1) for part in hidden.removeprefix("hidden at this width: ").split("; "))
        assert "rss MB" in said["workers"] and "parameter servers" not in said, hidden
        assert "rss MB" in next(line for line in lines if line.startswith("role") and "req/s" in line)


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    # os.environ given as is: GNU readline, once imported in this process, sets COLUMNS and LINES (80 x 24 without
    # a terminal) in its C environment, which a child would otherwise inherit; tmux's server keeps them for the
    # programs it runs, and top then draws itself 80 wide in the 200 x 50 window
    return subprocess.run(["tmux", "-L", "psctl-test", *args], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ))


@pytest.mark.slow
def test_top_in_a_real_terminal_shows_every_role_s_time(psctl_env: PsctlEnv) -> None:
    if shutil.which("tmux") is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is missing: CI installs it (.ci/run)")
        pytest.skip("tmux is not installed")
    spec = textwrap.dedent("""\
        name: toptest
        roles:
          chief: {}
          ps: {replicas: 2}
          worker: {replicas: 2}
        training: {program: psctl.models.mlp, args: {hidden_units: 32}, data: {name: digits}, batch_size: 50,
                   steps: 1000000}
        supervision: {heartbeat_interval: 0.5s, heartbeat_timeout: 5s}
        """)
    cluster = SupervisedCluster(psctl_env, "toptest", spec)
    cluster.up()
    env = " ".join(f"{k}={v}" for k, v in (("PSCTL_HOME", psctl_env.home), ("TERM", "xterm-256color")))
    started = tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "50",
                   f"env {env} {psctl_binary()} top toptest --interval 0.5")
    assert started.returncode == 0, started.stderr
    try:
        def screen() -> str | None:
            shown = tmux("capture-pane", "-p", "-t", "top").stdout
            rows = [line for line in shown.splitlines() if line.lstrip("│┃ ").startswith("worker-")]
            # every worker has its step time and phase shares once it has trained a little
            ready = len(rows) == 2 and all("%" in row and row.split()[4] != "-" for row in rows)  # p50 ms
            return shown if ready else None

        shown = wait_until(screen, timeout=90, interval=0.5, what="top to show both workers' step times",
                           detail=lambda: tmux("capture-pane", "-p", "-t", "top").stdout)
        header = next(line for line in shown.splitlines() if "p50 ms" in line)
        for column in ("role", "host", "state", "steps/s", "p50 ms", "p99 ms", "pull", "compute", "push", "wait",
                       "MB/s", "cpu", "rss MB", "flag"):
            assert column in header, (column, header)
        assert "req/s" in shown and "held MB" in shown  # the parameter servers' table
        for name in ("ps-0", "ps-1", "chief-0"):
            assert name in shown, shown
        assert "cluster toptest running" in shown
        if importlib.util.find_spec("tensorboard") is not None:  # the chief's scalars, for TensorBoard
            # (written once per log_every_seconds: top may show the workers' step times before the first)
            def tags() -> set[str]:
                return {v.tag for e in read_events(cluster.root / "run" / "tensorboard" / "train")
                        for v in e.summary.value}

            wanted = {"loss", "steps_per_sec", "workers/worker-0/steps_per_sec"}
            wait_until(lambda: wanted <= tags(), timeout=30, interval=0.2, what="the chief's TensorBoard scalars",
                       detail=lambda: str(sorted(tags())))
    finally:
        tmux("kill-server")


def test_plot_writes_a_png_of_the_curves_the_metrics_hold(tmp_path: Path) -> None:
    import struct

    from psctl.plot import curves

    home = tmp_path / "home"
    cdir = ClusterDir(home / "curves")
    cdir.create()
    save_state(cdir.state_file, ClusterRecord(name="curves", cluster_id="curves-1", roles=[role("chief-0")]))
    progress = [{"event": "progress", "global_step": s, "loss": 1.0 / s, "steps_per_sec": 100.0 + s, "time": s}
                for s in (100, 200, 300)]
    (cdir.run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in progress) + "\n")
    evals = [{"global_step": 150, "accuracy": 0.9, "loss": 0.3}, {"global_step": 300, "accuracy": 0.95, "loss": 0.2}]
    (cdir.run_dir / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in evals) + "\n")
    assert curves(cdir.run_dir) == {
        "loss": ([100, 200, 300], [0.01, 0.005, 1 / 300]),
        "steps_per_sec": ([100, 200, 300], [200.0, 300.0, 400.0]),
        "accuracy": ([150, 300], [0.9, 0.95]),
        "eval_loss": ([150, 300], [0.3, 0.2]),
    }
    out = tmp_path / "plots" / "curves.png"  # (its folder made)
    result = CliRunner().invoke(cli, ["plot", "curves", "-o", str(out)], env={"PSCTL_HOME": str(home)})
    assert result.exit_code == 0, result.output
    assert "loss (3 points)" in result.output and "accuracy (2 points)" in result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 600  # three panels
    empty = ClusterDir(home / "empty")
    empty.create()
    save_state(empty.state_file, ClusterRecord(name="empty", cluster_id="empty-1", roles=[role("chief-0")]))
    nothing = CliRunner().invoke(cli, ["plot", "empty", "-o", str(tmp_path / "x.png")], env={"PSCTL_HOME": str(home)})
    assert nothing.exit_code == 2 and "no training metrics to plot yet for 'empty'" in nothing.output

    # two runs of a sweep: each panel holds both clusters' curves, labelled by cluster
    other = ClusterDir(home / "lr-2")
    other.create()
    save_state(other.state_file, ClusterRecord(name="lr-2", cluster_id="lr-2-1", roles=[role("chief-0")]))
    (other.run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in progress[:2]) + "\n")
    both = CliRunner().invoke(cli, ["plot", "curves", "lr-2", "-o", str(out)], env={"PSCTL_HOME": str(home)})
    assert both.exit_code == 0, both.output
    assert " ".join(both.output.split()) == (
        f"wrote {out}: curves: loss (3 points), curves: eval loss (2 points), lr-2: loss (2 points), curves: "
        "accuracy (2 points), curves: steps per sec (3 points), lr-2: steps per sec (2 points)")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = CliRunner().invoke(cli, ["plot", "curves", "empty", "-o", str(out)], env={"PSCTL_HOME": str(home)})
    assert refused.exit_code == 2 and "no training metrics to plot yet for 'empty'" in refused.output
    under_a_file = CliRunner().invoke(cli, ["plot", "curves", "-o", str(out / "x.png")], env={"PSCTL_HOME": str(home)})
    assert under_a_file.exit_code == 2 and under_a_file.output.startswith(
        f"error: --output {out / 'x.png'}: {out} is a file, not a folder")
    assert "Traceback" not in under_a_file.output


def test_plot_counts_one_point_in_the_singular(tmp_path: Path) -> None:
    """A short run's curves have one point each: `psctl plot` said "accuracy (1 points)"."""
    cdir = ClusterDir(tmp_path / "home" / "short")
    cdir.create()
    save_state(cdir.state_file, ClusterRecord(name="short", cluster_id="short-1", roles=[role("chief-0")]))
    records = [{"event": "progress", "global_step": 10, "loss": 0.5, "steps_per_sec": 90.0, "time": 1},
               {"event": "final", "global_step": 10, "metrics": {"accuracy": 0.8}, "time": 2}]
    (cdir.run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "short.png"
    result = CliRunner().invoke(cli, ["plot", "short", "-o", str(out)], env={"PSCTL_HOME": str(tmp_path / "home")})
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()) == (
        f"wrote {out}: loss (1 point), accuracy (1 point), steps per sec (1 point)")


def read_events(folder: Path) -> list[Any]:
    """The events of TensorBoard's files in ``folder`` (TFRecord framing: length, crc, data, crc)."""
    import struct

    from tensorboard.compat.proto import event_pb2

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            if at + 12 + length + 4 > len(data):
                break  # a record still being written
            events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return events


def test_tensorboard_scalars_are_written_without_importing_tensorflow(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    script = textwrap.dedent(f"""\
        import sys
        from psctl.runtime.tensorboard import ScalarWriter
        writer = ScalarWriter({str(tmp_path / 'tb')!r})
        for step in (10, 20, 30):
            writer.add(step, {{"loss": 1.0 / step, "steps_per_sec": 50.0, "bad": float("nan")}})
        writer.close()
        print("tensorflow" in sys.modules)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # a chief must not pay TensorFlow's start-up for its scalars
    points = [(e.step, v.tag, round(v.simple_value, 4)) for e in read_events(tmp_path / "tb") for v in e.summary.value]
    assert points == [(s, tag, round(value, 4)) for s in (10, 20, 30) for tag, value in
                      (("loss", 1.0 / s), ("steps_per_sec", 50.0))]


def test_plot_of_a_resumed_cluster_continues_the_curves_of_its_earlier_runs(tmp_path: Path) -> None:
    """`up` again keeps the run before under history/N: plot joins them (it drew the last run's points only, one
    point where that run had nothing left to train)."""
    from psctl.plot import resumed_curves

    home = tmp_path / "home"
    cdir = ClusterDir(home / "long")
    cdir.create()
    save_state(cdir.state_file, ClusterRecord(name="long", cluster_id="long-1", roles=[role("chief-0")]))

    def run(folder: Path, steps: Sequence[int]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"event": "progress", "global_step": s, "loss": 1.0 / s, "steps_per_sec": 10.0})
                 for s in steps]
        (folder / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines))

    run(cdir.history / "1" / "run", [100, 200, 300, 350])  # stopped at 350; its checkpoint at 300
    (cdir.history / "2" / "run").mkdir(parents=True)  # an `up` that failed at once: no metrics
    run(cdir.run_dir, [300, 400, 500])  # resumed from the checkpoint at 300
    joined = resumed_curves([*(p / "run" for p in cdir.kept_runs()), cdir.run_dir])
    assert joined["loss"][0] == [100, 200, 300, 400, 500]
    assert joined["loss"][1] == [0.01, 0.005, 1 / 300, 1 / 400, 1 / 500]
    out = tmp_path / "long.png"
    drawn = CliRunner().invoke(cli, ["plot", "long", "-o", str(out)], env={"PSCTL_HOME": str(home)})
    assert drawn.exit_code == 0 and "loss (5 points)" in drawn.output, drawn.output
    run(cdir.run_dir, [50, 100])  # a run started afresh (another checkpoint folder): the earlier ones are hidden
    assert resumed_curves([*(p / "run" for p in cdir.kept_runs()), cdir.run_dir])["loss"][0] == [50, 100]


def test_a_worker_s_step_summary_is_also_its_heartbeat_s_own_rate() -> None:
    """`status --json` showed steps_per_sec 0.0 for every worker (only the chief's was set) while top showed
    their rate from the same summary."""
    from psctl.runtime.heartbeat import Progress
    from psctl.runtime.stepstats import StepStats

    now = [0.0]
    progress = Progress()
    stats = StepStats(progress=progress, get_time=lambda: now[0])
    for _ in range(40):  # 40 steps/s, 25 ms each
        now[0] += 0.025
        stats.record(pull=0.005, compute=0.015, push=0.005, nbytes=1000)
    assert progress.steps_per_second == pytest.approx(40.0) == progress.metrics["steps_per_s"]

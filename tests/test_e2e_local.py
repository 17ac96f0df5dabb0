"""End to end on this machine: the installed ``psctl`` binary, run as a user would (subprocess, repository root as
the working directory), starting real supervisors and real training roles.

Every test gets its own ``PSCTL_HOME`` (the ``psctl_env`` fixture); whatever it starts is taken down by the
fixture even when the test fails, and the fixture fails the test if any process of its clusters survives.
Clusters are small (1 chief, 1 ps, 1-2 workers, an MLP with 32 hidden units on digits) so the file runs in about
a minute on two cores. Clusters that are only watched and then stopped get many steps, so that they are still
training whenever the test looks at them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_helpers import REPO_ROOT, wait_until
from conftest import Hold, misbehaving_program, psctl_binary, readme_files

from psctl.launch.cpus import allowed_cpus, cpus_for_slot, host_slots
from psctl.runtime.checkpoint import list_checkpoints, step_of

pytestmark = pytest.mark.slow

TERMINAL_ROLE_STATES = {"succeeded", "failed", "stopped"}
TERMINAL_CLUSTER_STATES = {"succeeded", "failed", "stopped"}
#: Enough steps that a cluster is still training whenever a test inspects it before stopping it.
LONG = 200_000


def flat(text: str) -> str:
    """Output with every run of whitespace made one space (rich wraps long lines at 80 columns in a pipe)."""
    return " ".join(text.split())


def cluster_logs(psctl_env: Any, name: str, chars: int = 1500) -> str:
    """The end of the supervisor's and every role's log, for assertion messages."""
    root = psctl_env.home / name
    parts = []
    for path in [root / "supervisor.log", *sorted((root / "logs").glob("*.log"))]:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(f"----- {path.name} -----\n{text[-chars:]}")
    return "\n".join(parts)


def read_log(psctl_env: Any, name: str, filename: str) -> list[str]:
    return (psctl_env.home / name / "logs" / filename).read_text(encoding="utf-8").splitlines()


def check(done: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert done.returncode == code, (
        f"`{' '.join(done.args[1:])}` exited {done.returncode}, expected {code}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done


def up_detached(psctl_env: Any, name: str, **spec: Any) -> dict[str, Any]:
    path = psctl_env.write_spec(name, **spec)
    done = check(psctl_env.run("up", "--detach", str(path)))
    assert f"cluster {name!r} is starting" in done.stdout
    return psctl_env.state(name)  # type: ignore[no-any-return]


def status_json(psctl_env: Any, name: str) -> dict[str, Any]:
    done = check(psctl_env.run("status", name, "--json"))
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def wait_cluster(psctl_env: Any, name: str, pred: Any, *, timeout: float, what: str) -> dict[str, Any]:
    """Poll the cluster's state.json until ``pred(state)`` holds; the logs go into the failure message."""
    found: dict[str, Any] = {}

    def cond() -> bool:
        found.update(psctl_env.state(name))
        return bool(pred(found))

    wait_until(cond, timeout=timeout, interval=0.1, what=what,
               detail=lambda: json.dumps(found, indent=1)[-3000:] + "\n" + cluster_logs(psctl_env, name))
    return found


def role_of(state: dict[str, Any], role: str) -> dict[str, Any]:
    return next(r for r in state["roles"] if r["name"] == role)


def same_process(pid: int, create_time: float | None) -> psutil.Process:
    """The live process ``pid`` started at ``create_time`` (never a stranger that reused the pid)."""
    proc = psutil.Process(pid)
    assert create_time is None or abs(proc.create_time() - create_time) < 0.02, f"pid {pid} was reused"
    return proc


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- (a) ----------------------------------------------------------------------------------------------------
def test_a_failed_setup_command_stops_up_in_one_line_before_anything_starts(psctl_env) -> None:
    spec = psctl_env.write_spec("setupfail", ps=1, workers=1)
    spec.write_text(spec.read_text()
                    + "setup: ['echo first >> ran', 'echo no such wheel >&2; exit 3', 'echo x >> ran']\n")
    failed = psctl_env.run("up", str(spec), "--detach")
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    log = psctl_env.home / "setupfail" / "logs" / "setup.log"
    line = len(spec.read_text().splitlines())  # (where it is written: the spec's last line)
    assert failed.stderr.strip() == (f"error: {spec}:{line}: setup[1] `echo no such wheel >&2; exit 3` failed "
                                     f"(exit 3): no such wheel; fix the command under setup: (its output: {log})"), \
        failed.stderr
    assert (spec.parent / "ran").read_text() == "first\n"  # the commands after it did not run
    assert psctl_env.processes() == []  # nothing started: no supervisor, agent or role
    # the failed run is the cluster's record: status says why, and down --purge finds the name ("no cluster")
    status = check(psctl_env.run("status", "setupfail"))
    assert "cluster setupfail failed" in status.stdout and "setup[1]" in flat(status.stdout), status.stdout
    # a run before it of the same name is not what status shows once a later run's setup failed
    spec.write_text(spec.read_text().replace("exit 3", "exit 0"))
    check(psctl_env.run("up", str(spec)))
    spec.write_text(spec.read_text().replace("exit 0", "exit 4"))
    check(psctl_env.run("up", str(spec), "--detach"), 1)
    assert psctl_env.state("setupfail")["state"] == "failed"
    assert (psctl_env.home / "setupfail" / "history" / "2" / "run" / "result.json").is_file()  # (the run before)
    purged = check(psctl_env.run("down", "--purge", "setupfail"))
    assert "logs and state deleted" in flat(purged.stdout)
    assert not (psctl_env.home / "setupfail" / "state.json").exists()


# in-process, the supervisor is this process's child, whose Popen `up` drops as it returns (psctl's own process
# exits then): Python warns of a child still running, which here is the point
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_before_the_cluster_runs_stops_what_had_started(psctl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during an attached `up`'s start (here: just as it returns, the supervisor running and every role
    started) abandons the start: nothing is left running, and it says so (it printed "Aborted!" and left the
    cluster training). Once the cluster runs, Ctrl-C detaches instead."""
    from click.testing import CliRunner

    from psctl import operations
    from psctl.cli import cli

    spec = psctl_env.write_spec("intr", steps=100000, ps=1, workers=1)
    started = operations.bring_up

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        started(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(operations, "bring_up", interrupted)
    result = CliRunner().invoke(cli, ["up", str(spec)], prog_name="psctl")
    assert result.exit_code == 130, (result.stdout, result.stderr, result.exception)
    assert flat(result.stderr) == "interrupted while starting: cluster 'intr' stopped; nothing of it is left running"
    assert psctl_env.processes() == []
    assert psctl_env.state("intr")["state"] == "stopped"


def test_ctrl_c_in_setup_leaves_this_run_s_record_not_the_last_one_s(psctl_env,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while `setup:` ran (the last run's logs and events moved to history/ already): status showed the last
    run's `succeeded`, with its result, events said "no events recorded" and logs named a missing log."""
    from click.testing import CliRunner

    from psctl import operations
    from psctl.cli import cli

    spec = psctl_env.write_spec("setupintr", steps=50, ps=1, workers=1)
    check(psctl_env.run("up", str(spec)))

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(operations, "run_setup_here", interrupted)
    result = CliRunner().invoke(cli, ["up", str(spec)], prog_name="psctl")
    assert result.exit_code == 130, (result.stdout, result.stderr, result.exception)
    state = psctl_env.state("setupintr")
    assert (state["state"], state["reason"]) == ("stopped", "interrupted while starting, before any role ran")
    assert state["result"] is None and not any(r["pid"] for r in state["roles"])
    assert (psctl_env.home / "setupintr" / "history" / "1" / "run" / "result.json").is_file()  # (the last run's)


def test_up_attached_trains_to_the_end(psctl_env) -> None:
    steps = 300
    spec = psctl_env.write_spec("att", steps=steps, ps=1, workers=2)
    # setup: runs here too, once, in the spec's folder, before anything starts
    spec.write_text(spec.read_text() + "setup: ['echo ready > setup-marker', 'test -s setup-marker']\n")
    done = psctl_env.run("up", str(spec), timeout=180)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "att"))
    assert "Traceback" not in done.stdout + done.stderr
    assert (spec.parent / "setup-marker").read_text() == "ready\n"
    assert (psctl_env.home / "att" / "logs" / "setup.log").read_text().splitlines() == [
        "$ echo ready > setup-marker", "$ test -s setup-marker"]

    status = status_json(psctl_env, "att")
    psctl_env.cluster_ids.add(status["cluster_id"])
    assert status["state"] == "succeeded", status
    assert status["stale"] is False
    assert {r["name"] for r in status["roles"]} == {"chief-0", "ps-0", "worker-0", "worker-1"}
    for role in status["roles"]:
        assert role["state"] in TERMINAL_ROLE_STATES, role
    assert role_of(status, "chief-0")["state"] == "succeeded"
    assert status["result"]["global_step"] == steps
    assert 0.5 < status["result"]["metrics"]["accuracy"] <= 1.0, status["result"]

    listed = check(psctl_env.run("ls")).stdout
    assert ["att", "succeeded", "4", f"{steps}/{steps}"] in [line.split()[:4] for line in listed.splitlines()], listed

    chief_log = check(psctl_env.run("logs", "chief-0")).stdout
    assert "training done" in chief_log
    unknown = check(psctl_env.run("logs", "worker-9"), 2)
    assert "no role 'worker-9' in cluster 'att'; roles are: chief-0, ps-0, worker-0, worker-1" in flat(unknown.stderr)
    assert chief_log.splitlines() == read_log(psctl_env, "att", "chief-0.1.log")
    worker_lines = read_log(psctl_env, "att", "worker-1.1.log")
    assert worker_lines, "worker-1 wrote no log"
    tail = check(psctl_env.run("logs", "worker-1", "att", "--tail", "3")).stdout.splitlines()
    assert 1 <= len(tail) <= 3
    assert tail == worker_lines[-3:]
    # the chief told the ps and workers that training was over: stopped, they went at once, not after a grace
    assert "ps:0 stopping: training is over" in "\n".join(read_log(psctl_env, "att", "ps-0.1.log"))
    assert "worker:1 stopping: training is over" in "\n".join(worker_lines)

    down = check(psctl_env.run("down"))
    assert "cluster 'att': nothing was running; no process of it is left" in flat(down.stdout)
    assert psctl_env.processes(status["cluster_id"]) == []

    # Last, so that the checks above run even while it fails: the summary is one line, the last one.
    last = done.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"training finished: {steps} steps in "), done.stdout
    # the final metrics are the test split's, said so; the progress lines before it, the training batches'
    assert re.search(r"; test split: loss [0-9.]+, accuracy [0-9.]+; checkpoint: ", last), done.stdout
    assert re.search(r"step \d+/\d+, train loss [0-9.e-]+, [0-9.]+ steps/s", done.stdout), done.stdout


def test_up_with_set_trains_the_overridden_spec_and_the_cluster_remembers_it(psctl_env) -> None:
    """`psctl up SPEC --set training.steps=N`: the roles get the overridden value (the chief stops at N, not at
    the file's step count), and the cluster's record keeps the override for a supervisor started again."""
    spec = psctl_env.write_spec("setx", steps=LONG, ps=1, workers=1)
    done = psctl_env.run("up", str(spec), "--set", "training.steps=150", "--set", "roles.worker.replicas=2",
                         timeout=180)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "setx"))
    assert done.stdout.rstrip("\n").splitlines()[-1].startswith("training finished: 150 steps in "), done.stdout
    status = status_json(psctl_env, "setx")
    assert status["spec_overrides"] == ["training.steps=150", "roles.worker.replicas=2"]
    shown = flat(check(psctl_env.run("status", "setx")).stdout)
    assert "spec: " in shown and "--set training.steps=150 --set roles.worker.replicas=2" in shown, shown
    assert sorted(r["name"] for r in status["roles"]) == ["chief-0", "ps-0", "worker-0", "worker-1"]
    refused = psctl_env.run("up", str(spec), "--set", "training.steps=0")
    assert refused.returncode == 2 and refused.stdout == "", (refused.stdout, refused.stderr)
    assert flat(refused.stderr) == ("error: --set training.steps=0: training.steps: expected an integer >= 1, got 0; "
                                    "write a whole number such as 1000")


def test_the_readme_example_trains_and_status_shows_the_evaluation_of_its_last_checkpoint(psctl_env) -> None:
    # the README's first command; the evaluator's last evaluation comes after its last periodic heartbeat, and
    # psctl status once showed the one before it
    spec = REPO_ROOT / "cluster_examples" / "local.yaml"
    done = psctl_env.run("up", str(spec), timeout=180)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "digits"))
    assert done.stdout.rstrip("\n").splitlines()[-1].startswith("training finished: 1000 steps in ")
    status = status_json(psctl_env, "digits")
    psctl_env.cluster_ids.add(status["cluster_id"])
    evaluations = (psctl_env.home / "digits" / "run" / "eval.jsonl").read_text().splitlines()
    last = json.loads(evaluations[-1])
    assert last["global_step"] == 1000  # the evaluator evaluated the final checkpoint...
    evaluator = role_of(status, "evaluator-0")
    assert evaluator["state"] == "succeeded" and evaluator["global_step"] == 1000  # ...and status says so
    assert evaluator["metrics"]["accuracy"] == pytest.approx(last["accuracy"])
    assert evaluator["metrics"]["loss"] == pytest.approx(last["loss"])
    # every worker's last beat, sent as it was stopped, counts: their steps add up to the training's
    assert sum(r["local_step"] for r in status["roles"] if r["role"] == "worker") == 1000, status["roles"]
    # the same spec again: its checkpoint is restored, at the last step already, and the line says so
    again = psctl_env.run("up", str(spec), timeout=180)
    assert again.returncode == 0, (again.stdout, again.stderr, cluster_logs(psctl_env, "digits"))
    line = again.stdout.rstrip("\n").splitlines()[-1]
    # (its logs with it: once in a full suite run the last run's supervisor, still ending, saved its record over
    # the new run's, and this line was the last run's; `up` now waits for it)
    assert line.startswith("training finished: nothing to train: an earlier run's checkpoint in "), (
        line, cluster_logs(psctl_env, "digits"))
    assert "is at global step 1000, at or past training.steps 1000" in line, line
    check(psctl_env.run("down"))


def test_the_readme_s_own_program_trains_as_its_spec_says(psctl_env) -> None:
    """README, "Your own program": its program and spec, written out as a user would, train (test_examples checks
    the program's gradients, in-process)."""
    for name, text in readme_files("Your own program").items():
        (psctl_env.tmp_path / name).write_text(text, encoding="utf-8")
    spec = psctl_env.tmp_path / "spec.yaml"
    done = check(psctl_env.run("up", str(spec), "--set", "training.steps=40", timeout=180))
    assert re.match(r"training finished: 40 steps in .*; test split: loss \d\.\d{4}, accuracy \d\.\d{4}; checkpoint: ",
                    done.stdout.rstrip("\n").splitlines()[-1]), done.stdout
    psctl_env.state("mine")  # (its id, for the fixture's hunt)
    check(psctl_env.run("down", "mine", "--purge"))


def test_resuming_a_checkpoint_that_does_not_fit_the_spec_fails_at_once_and_trains_nothing(psctl_env) -> None:
    """Another model (hidden units), or the data split in other shards than the checkpoint's (another worker
    count): the chief says why in one line and is not restarted (it used to be, and its successor trained from
    step 0 over the checkpoint; fewer workers failed a step on a shard out of range, more split the data anew
    under the old shards' positions)."""
    spec = psctl_env.write_spec("fit", steps=150, workers=3)
    spec.write_text(spec.read_text().replace("  mode: async\n", "  mode: async\n  checkpoint: {every_steps: 50}\n"))
    check(psctl_env.run("up", str(spec), timeout=180))
    newest = psctl_env.home / "fit" / "checkpoints" / "ckpt-000000000150"
    cases = {
        ("--set", "training.args.hidden_units=50"): f"checkpoint {newest} does not fit this spec: 'hid/kernel' is "
                                                     "(64, 32) in the checkpoint, the program says (64, 50)",
        **{("--set", f"roles.worker.replicas={n}"): f"checkpoint {newest} does not fit this spec: it read its data "
           f"in 3 shards, this run would split it in {n} (training.data_shards, or one per worker): set "
           "training.data_shards: 3 to resume it" for n in (2, 4)},
    }
    history = psctl_env.home / "fit" / "history"
    for run, (sets, message) in enumerate(cases.items(), start=1):
        failed = check(psctl_env.run("up", str(spec), "--set", "training.steps=300", *sets, timeout=180), 3)
        assert message in flat(failed.stderr), failed.stderr
        chief = psctl_env.role("fit", "chief-0")
        assert (chief["attempt"], chief["restarts"]) == (1, 0), chief  # permanent: not restarted
        # the run before is kept whole: its logs, metrics and result (the first: the 150 steps that trained)
        assert f"the last run's logs, metrics, events and result are kept in {history / str(run)}" in \
            flat(failed.stdout), failed.stdout
    assert list_checkpoints(psctl_env.home / "fit" / "checkpoints")[-1] == newest  # none written over it
    first = history / "1"
    assert json.loads((first / "run" / "result.json").read_text())["global_step"] == 150
    assert (first / "logs" / "chief-0.1.log").is_file() and (first / "events.jsonl").is_file()
    assert json.loads((first / "state.json").read_text())["state"] == "succeeded"
    assert sorted(p.name for p in history.iterdir()) == ["1", "2", "3"]


def test_a_run_over_damaged_checkpoints_sets_them_aside_says_so_and_keeps_its_own(psctl_env) -> None:
    """An earlier run's newer checkpoints damaged (a disk that failed, a copy cut short): `up` goes on from the
    newest that verifies. Before, it said nothing of them; wrote none of its own where a damaged one stood at the
    same step (and reported that one as its checkpoint); and pruning by step deleted what it did write: `export`
    then found no valid checkpoint, the run's training lost."""
    spec = psctl_env.write_spec("dmg", steps=300, workers=1)
    spec.write_text(spec.read_text().replace(
        "  mode: async\n", "  mode: async\n  checkpoint: {every_steps: 100, max_to_keep: 2}\n"))
    check(psctl_env.run("up", str(spec), timeout=180))
    folder = psctl_env.home / "dmg" / "checkpoints"
    kept = list_checkpoints(folder)
    assert len(kept) == 2 and step_of(kept[-1]) == 300, kept
    for path in kept[1:]:  # the newest damaged; the one before it still verifies
        (path / "arrays.npz").write_bytes((path / "arrays.npz").read_bytes()[:1000])
    again = check(psctl_env.run("up", str(spec), "--set", "training.steps=500", timeout=180))
    warning = ("warning: 1 checkpoint(s) of 'dmg' did not verify, and training went on from an older one (or its "
               "initializers): ckpt-000000000300: arrays.npz is missing or truncated (now damaged-ckpt-000000000300)")
    assert warning in flat(again.stderr), again.stderr
    assert f"from an earlier run's checkpoint at global step {step_of(kept[0])}" in flat(again.stdout), again.stdout
    newest = folder / "ckpt-000000000500"
    assert f"checkpoint: {newest}; 1 checkpoint(s) did not verify" in flat(again.stdout), again.stdout
    assert [step_of(p) for p in list_checkpoints(folder)][-1] == 500  # the run's own, kept by pruning
    assert (folder / "damaged-ckpt-000000000300" / "manifest.json").is_file()
    out = psctl_env.tmp_path / "model.npz"
    assert check(psctl_env.run("export", "dmg", "-o", str(out))).stdout.startswith(
        f"exported {newest} (global step 500)")


def test_export_writes_the_newest_checkpoints_variables(psctl_env) -> None:
    import numpy as np

    spec = psctl_env.write_spec("exp", steps=200, workers=1)
    text = spec.read_text()
    assert "  mode: async\n" in text  # the line the checkpoint settings go after
    spec.write_text(text.replace("  mode: async\n", "  mode: async\n  checkpoint: {every_steps: 50}\n"))
    check(psctl_env.run("up", str(spec), timeout=180))
    psctl_env.state("exp")
    out = psctl_env.tmp_path / "model.npz"
    done = check(psctl_env.run("export", "exp", "-o", str(out)))
    newest = psctl_env.home / "exp" / "checkpoints" / "ckpt-000000000200"
    assert done.stdout.startswith(f"exported {newest} (global step 200) to {out}: "), done.stdout
    with np.load(out) as arrays:
        shapes = {k: arrays[k].shape for k in arrays.files}
    assert shapes == {"hid/kernel": (64, 32), "hid/bias": (32,), "sm/kernel": (32, 10), "sm/bias": (10,)}
    # this machine's folder named as `psctl status` names the host
    here = check(psctl_env.run("export", "exp", "--checkpoint", f"localhost:{newest}", "-o", str(out)))
    assert here.stdout.startswith(f"exported {newest} (global step 200)"), here.stdout
    missing = check(psctl_env.run("export", "exp", "--checkpoint", str(psctl_env.tmp_path), "-o", str(out)), 4)
    assert f"no valid checkpoint in {psctl_env.tmp_path}" in flat(missing.stderr)
    assert "name one with --checkpoint PATH" in flat(missing.stderr), missing.stderr
    typo = check(psctl_env.run("export", "exp", "--checkpoint", "h9:/ckpts", "-o", str(out)), 2)
    assert ("--checkpoint h9:/ckpts: 'h9' is not a host of cluster 'exp' (its hosts: none: it runs on this "
            "machine); give HOST:PATH with one of them, or a local folder") in flat(typo.stderr), typo.stderr
    damaged = psctl_env.tmp_path / "damaged" / newest.name  # a checkpoint named, its arrays not what it wrote
    shutil.copytree(newest, damaged)
    with open(damaged / "arrays.npz", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    broken = check(psctl_env.run("export", "exp", "--checkpoint", str(damaged), "-o", str(out)), 1)
    assert flat(broken.stderr) == (f"error: {damaged}: arrays.npz does not match its checksum (name another "
                                   "checkpoint, or their folder: the newest that verifies is taken)"), broken.stderr
    older = sorted(newest.parent.glob("ckpt-*"))[-2]  # (async: a checkpoint lands once the steps in flight are done)
    shutil.copytree(older, damaged.parent / older.name)  # a folder of checkpoints: the damaged newest passed over
    passed = check(psctl_env.run("export", "exp", "--checkpoint", str(damaged.parent), "-o", str(out)))
    assert passed.stdout.startswith(f"exported {damaged.parent / older.name} (global step {step_of(older)})"), \
        passed.stdout
    # (its cause once, the checkpoint named once: it said "skipping checkpoint X: X: arrays.npz ...")
    assert flat(passed.stderr).startswith(f"warning: skipping checkpoint {damaged}: arrays.npz does not match its "
                                          "checksum"), passed.stderr
    nowhere = check(psctl_env.run("export", "exp", "--checkpoint", str(psctl_env.tmp_path / "nope"), "-o", str(out)),
                    4)
    assert f"no checkpoint folder {psctl_env.tmp_path / 'nope'}" in flat(nowhere.stderr), nowhere.stderr
    a_file = psctl_env.tmp_path / "a-file"
    a_file.write_text("")
    unwritable = check(psctl_env.run("export", "exp", "-o", str(a_file / "model.npz")), 2)
    assert flat(unwritable.stderr) == (f"error: --out {a_file}/model.npz: {a_file} is a file, not a folder (give a "
                                       "path in a folder)"), unwritable.stderr
    # a link is written through (it stays a link); a pipe is written into, not replaced by a file
    link = psctl_env.tmp_path / "latest.npz"
    link.symlink_to(out)
    check(psctl_env.run("export", "exp", "-o", str(link)))
    assert link.is_symlink() and np.load(out)["sm/bias"].shape == (10,)
    pipe = psctl_env.tmp_path / "pipe.npz"
    os.mkfifo(pipe)
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        read = reader.submit(pipe.read_bytes)
        try:
            check(psctl_env.run("export", "exp", "-o", str(pipe)))
            through = read.result(timeout=60)
        finally:
            if not read.done():  # the reader waits for a writer: one that writes nothing lets it go
                os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)  # (it became a regular file)
    with np.load(io.BytesIO(through)) as arrays:
        assert sorted(arrays.files) == ["hid/bias", "hid/kernel", "sm/bias", "sm/kernel"]
    # standard output into a pipe (`export -o /dev/stdout | consumer`): the arrays alone, the line on stderr
    piped = subprocess.run([psctl_binary(), "export", "exp", "-o", "/dev/stdout"], env=psctl_env.env,
                           capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr.decode().startswith(f"exported {newest} (global step 200) to /dev/stdout")
    with np.load(io.BytesIO(piped.stdout)) as arrays:
        assert arrays["sm/kernel"].shape == (32, 10)


def test_export_while_training_reads_the_spec_checkpoint_folder(psctl_env) -> None:
    """Before the chief's result names a checkpoint, export looks where the chief was told to write them
    (training.checkpoint.dir here), not in the cluster's default folder."""
    folder = psctl_env.tmp_path / "my-checkpoints"
    spec = psctl_env.write_spec("ckd", steps=LONG, workers=1)
    text = spec.read_text()
    assert "  mode: async\n" in text
    checkpoint = f"  checkpoint: {{dir: {folder}, every_steps: 50}}\n"
    spec.write_text(text.replace("  mode: async\n", "  mode: async\n" + checkpoint))
    check(psctl_env.run("up", "--detach", str(spec)))
    psctl_env.state("ckd")
    try:
        wait_until(lambda: any(folder.glob("ckpt-*/manifest.json")), timeout=60, interval=0.1,
                   what="a checkpoint in training.checkpoint.dir")  # fmt: skip
        out = psctl_env.tmp_path / "model.npz"
        done = check(psctl_env.run("export", "ckd", "-o", str(out)))
        assert done.stdout.startswith(f"exported {folder}/ckpt-"), done.stdout
        assert not (psctl_env.home / "ckd" / "checkpoints").exists()
    finally:
        check(psctl_env.run("down", "ckd"))


# -- (b) ----------------------------------------------------------------------------------------------------
def test_detached_cluster_outlives_its_supervisor_and_down_stops_everything(psctl_env) -> None:
    roles = ("chief-0", "ps-0", "worker-0", "worker-1")
    first = up_detached(psctl_env, "det", steps=LONG, ps=1, workers=2)
    cluster_id = first["cluster_id"]

    wait_cluster(psctl_env, "det", lambda s: all(r["state"] == "running" for r in s["roles"]),
                 timeout=60, what="every role of 'det' running")
    shown = check(psctl_env.run("status")).stdout
    assert "cluster det running" in shown
    for role in roles:
        row = next((line for line in shown.splitlines() if line.startswith(role)), None)
        assert row is not None and " running " in row, shown

    worker_log = check(psctl_env.run("logs", "worker-0")).stdout
    assert "worker:0 starting" in worker_log

    state = psctl_env.state("det")
    role_procs = [same_process(r["pid"], r["create_time"]) for r in state["roles"]]
    # cpu_binding: auto: where the four roles outnumber this machine's CPUs, each is bound to one CPU, round-robin
    # from the ps (ps-0, worker-0, worker-1, chief-0); with a CPU for each, none is bound
    allowed = allowed_cpus()
    slots = host_slots((r["role"], r["index"]) for r in state["roles"])
    for r, proc in zip(state["roles"], role_procs, strict=True):
        expected = cpus_for_slot(slots[(r["role"], r["index"])], len(slots), allowed) or allowed
        wait_until(lambda proc=proc, expected=expected: sorted(proc.cpu_affinity()) == expected, timeout=10,
                   what=f"{r['name']} on CPU(s) {expected} of {allowed}")  # it binds itself as it starts
    supervisor = same_process(state["supervisor_pid"], state["supervisor_create_time"])
    supervisor.send_signal(signal.SIGKILL)
    wait_until(lambda: gone(supervisor), timeout=10, what="the supervisor to die")

    stale = check(psctl_env.run("status"))
    assert "stale" in stale.stdout
    assert "psctl down det" in flat(stale.stderr)
    # Roles never depend on their supervisor: they keep running without it.
    assert not any(gone(p) for p in role_procs)

    down = check(psctl_env.run("down"))
    # the roles and this machine's agent
    assert f"cluster 'det': stopped {len(roles) + 1} process(es); no process of it is left" in flat(down.stdout)
    left = psctl_env.processes(cluster_id)
    assert left == [], psctl_env.describe(left)
    assert all(gone(p) for p in role_procs)
    after = psctl_env.state("det")
    assert after["state"] == "stopped"
    assert {r["state"] for r in after["roles"]} == {"stopped"}

    again = check(psctl_env.run("down"))
    assert "nothing was running" in flat(again.stdout)
    assert psctl_env.processes(cluster_id) == []


# -- (c) ----------------------------------------------------------------------------------------------------
def test_up_refuses_a_cluster_that_is_already_up(psctl_env) -> None:
    first = up_detached(psctl_env, "dup", steps=LONG, ps=1, workers=1)
    spec = psctl_env.tmp_path / "dup.yaml"
    refused = check(psctl_env.run("up", str(spec)), 2)
    assert refused.stdout == ""
    line = flat(refused.stderr)
    assert "cluster 'dup' is already up" in line
    assert "psctl down dup" in line
    assert "Traceback" not in refused.stderr
    # The running cluster was left alone: same id, same supervisor and roles, all alive.
    now = psctl_env.state("dup")
    assert now["cluster_id"] == first["cluster_id"]
    assert now["supervisor_pid"] == first["supervisor_pid"]
    procs = [same_process(r["pid"], r["create_time"]) for r in first["roles"]]
    assert not any(gone(p) for p in procs)
    # Once it is down, the same name can be brought up again, as a new cluster.
    check(psctl_env.run("down", "dup"))
    second = up_detached(psctl_env, "dup", steps=LONG, ps=1, workers=1)
    assert second["cluster_id"] != first["cluster_id"]


# -- (d) ----------------------------------------------------------------------------------------------------
def write_boom(tmp_path: Path) -> Path:
    program = tmp_path / "boom_program.py"
    program.write_text('raise RuntimeError("boom")\n\n\ndef build(args, data, seed):  # (its import raises first)\n'
                       '    pass\n', encoding="utf-8")
    return program


def test_failed_start_names_the_role_and_leaves_nothing(psctl_env) -> None:
    program = write_boom(psctl_env.tmp_path)
    never = "restart: {policy: never}"
    spec = psctl_env.write_spec("bad", program=str(program), workers=1, chief_extra=never, worker_extra=never)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr, cluster_logs(psctl_env, "bad"))
    assert "Traceback" not in done.stderr
    status = status_json(psctl_env, "bad")
    assert status["state"] == "failed", status
    failed = [r["name"] for r in status["roles"] if r["state"] == "failed"]
    assert failed, status
    error = flat(done.stderr)
    assert error.startswith("error: cluster 'bad' failed: "), done.stderr
    assert any(f"{name} failed" in error for name in failed), (failed, done.stderr)
    assert "exit code 2: " in error and "RuntimeError: boom" in error, error  # the cause its log ends with
    # psctl up itself leaves nothing behind: the supervisor stopped every role and exited.
    wait_until(lambda: not psctl_env.processes(status["cluster_id"]), timeout=15,
               what="every process of 'bad' to exit",
               detail=lambda: psctl_env.describe(psctl_env.processes(status["cluster_id"])))


def test_a_program_error_in_a_step_fails_the_cluster_saying_which_worker_and_what(psctl_env) -> None:
    """A program that raises while it trains (its own bug): the step is not retried elsewhere (it would fail
    there too), and `psctl up` ends saying which worker raised what, once, without gRPC's status code."""
    program = psctl_env.tmp_path / "buggy_program.py"
    line = misbehaving_program(program, "calls[0] > 5",
                               "raise ValueError(\"shapes (50,32) and (64,10) not aligned: my model's bug\")")
    spec = psctl_env.write_spec("buggy", program=str(program), workers=2, steps=LONG)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr, cluster_logs(psctl_env, "buggy"))
    error = flat(done.stderr)
    said = re.search(r"chief-0 failed: exit code 3: training failed: worker:(\d): program error: ValueError: "
                     r"shapes \(50,32\) and \(64,10\) not aligned: my model's bug \(traceback in worker-(\d)'s "
                     r"log\); not restarted", error)
    assert said is not None and said[1] == said[2] and "INTERNAL" not in error, error
    # the log it names shows where in the program: the file and line that raised
    log = psctl_env.run("logs", f"worker-{said[1]}", "buggy").stdout
    assert "Traceback (most recent call last)" in log and f'File "{program}", line {line}, in loss_and_grads' in log \
        and "ValueError: shapes (50,32)" in log, log[-3000:]
    # the agent ended cleanly with its roles (its watch thread once read a descriptor closed at the exit)
    agent_log = (psctl_env.home / "buggy" / "logs" / "agent-localhost.log").read_text()
    assert "Traceback" not in agent_log, agent_log[-3000:]
    status = status_json(psctl_env, "buggy")
    assert not any(r["restarts"] for r in status["roles"])
    # where training stood when it failed (each worker pushed 5 steps): status showed 0 for a run that failed
    # within its first progress report, however far it had gone
    chief = next(r for r in status["roles"] if r["name"] == "chief-0")
    assert chief["global_step"] >= 5, chief


def test_a_variable_no_ps_can_hold_fails_the_cluster_at_once_saying_which(psctl_env) -> None:
    """A table of 12 GB uncut: the ps refused it in one clear line, which the chief took for a crash (exit 1, an
    RpcError's first line as the reason) and was restarted ten times over minutes."""
    program = psctl_env.tmp_path / "big_program.py"
    program.write_text(textwrap.dedent("""\
        from psctl.models import mlp
        from psctl.runtime.program import VariableDef


        def build(args, data, seed):
            model = mlp.build(args, data, seed)
            declared = model.variables

            def variables():
                return [*declared(), VariableDef("table", (3_000_000, 1024), initializer="zeros", embedding=True)]

            model.variables = variables
            return model
        """), encoding="utf-8")
    spec = psctl_env.write_spec("big", program=str(program), workers=1, steps=10)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr, cluster_logs(psctl_env, "big"))
    error = flat(done.stderr)
    assert ("chief-0 failed: exit code 2: the ps refused the model's variables: variable 'table' of shape "
            "[3000000, 1024] is not one a PS holds") in error and "partition it over more shards" in error, error
    assert "exit code 2 is permanent" in error and psctl_env.role("big", "chief-0")["restarts"] == 0, error


def test_a_step_hung_in_the_program_goes_to_another_worker_and_its_worker_is_restarted(psctl_env) -> None:
    """A step that hangs in the program (its worker's heartbeats go on, from a thread of their own): the chief's
    checkpoints and end waited for it, and held the whole cluster at one step forever. Past its deadline the step
    goes to another worker, and the worker, its step still running, leaves and is restarted."""
    program = psctl_env.tmp_path / "hanging_program.py"
    hung = str(psctl_env.tmp_path / "hung-once")  # (its second attempt does not hang)
    back = str(psctl_env.tmp_path / "back")  # worker-1's second attempt has computed a step
    # worker-0 goes slowly until worker-1 is back: on a fast machine it finished the run alone before the
    # supervisor had restarted worker-1, and nothing was left to restart it for
    misbehaving_program(program, "True",
                        f"if ROLE == 'worker-1' and os.path.exists({hung!r}): open({back!r}, 'w').close()",
                        f"elif ROLE == 'worker-1' and calls[0] > 30: open({hung!r}, 'w').close(); time.sleep(10**6)",
                        f"elif ROLE == 'worker-0' and not os.path.exists({back!r}): time.sleep(0.01)")
    steps = 4000
    spec = psctl_env.write_spec("hang", program=str(program), workers=2, steps=steps)
    text = spec.read_text().replace("  mode: async\n", "  mode: async\n  step_timeout: 3s\n  steps_per_execution: 1\n"
                                     "  log_every_seconds: 0.2s\n")
    spec.write_text(text)
    done = psctl_env.run("up", str(spec), timeout=150)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "hang"))
    assert f"training finished: {steps} steps" in flat(done.stdout), done.stdout
    chief_log = psctl_env.run("logs", "chief-0", "hang").stdout
    assert re.search(r"worker:1: step \d+ ran past its deadline of 3s \(hung, or training.step_timeout shorter "
                     r"than its steps\?\); it goes back on the queue",
                     chief_log), chief_log[-3000:]
    lost = [e for e in map(json.loads, (psctl_env.home / "hang" / "events.jsonl").read_text().splitlines())
            if e["role"] == "worker-1" and e["to"] == "lost"]
    assert lost and "past the chief's deadline for it" in lost[0]["reason"], lost
    assert psctl_env.role("hang", "worker-1")["attempt"] == 2
    assert psctl_env.role("hang", "worker-0")["attempt"] == 1


def test_a_program_that_calls_sys_exit_in_a_step_fails_the_cluster_saying_so(psctl_env) -> None:
    """sys.exit in a step raised SystemExit in the worker's server thread, where nothing caught it: the call was
    never answered, and the whole cluster waited for it forever, the worker still beating."""
    program = psctl_env.tmp_path / "exiting_program.py"
    misbehaving_program(program, "calls[0] > 5", "sys.exit(0)")
    spec = psctl_env.write_spec("exits", program=str(program), workers=1, steps=LONG)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr, cluster_logs(psctl_env, "exits"))
    assert "training failed: worker:0: program error: SystemExit: 0 (traceback in worker-0's log)" in \
        flat(done.stderr), done.stderr


def test_a_daemon_a_program_left_is_stopped_when_training_ends(psctl_env) -> None:
    """A program that starts a daemon (forks twice, its parent gone: no signal to the role's group or tree reaches
    it) left it running after `up` had ended, until a `psctl down`: the agent stops it as the cluster ends."""
    pid_file = psctl_env.tmp_path / "daemon.pid"
    program = psctl_env.tmp_path / "daemon_program.py"
    program.write_text(textwrap.dedent(f"""\
        import os
        from psctl.models import mlp

        def build(args, data, seed):
            if os.environ.get("PSCTL_ROLE") == "worker-0" and os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    with open({str(pid_file)!r}, "w") as f:
                        f.write(str(os.getpid()))
                    os.execvp("sleep", ["sleep", "300"])
                os._exit(0)
            return mlp.build(args, data, seed)
        """), encoding="utf-8")
    spec = psctl_env.write_spec("daemon", program=str(program), workers=2, steps=300)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "daemon"))
    pid = int(pid_file.read_text())

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        wait_until(ended, timeout=15, what="the daemon to be stopped")
    finally:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    agent_log = (psctl_env.home / "daemon" / "logs" / "agent-localhost.log").read_text()
    assert f"stopped 1 process(es) its roles left running (daemons?): pid(s) {pid}" in agent_log, agent_log


def test_a_chief_whose_program_left_a_thread_running_ends_with_its_training(psctl_env) -> None:
    """A thread of the program that never ends (not a daemon) held the chief at its exit once training was done,
    its heartbeat stopped: it was taken for hung and restarted, again and again, and `up` never returned."""
    program = psctl_env.tmp_path / "thread_program.py"
    program.write_text(textwrap.dedent("""\
        import os, threading, time
        from psctl.models import mlp

        def build(args, data, seed):
            if os.environ.get("PSCTL_ROLE") == "chief-0":
                threading.Thread(target=time.sleep, args=(10**6,), name="my-uploader").start()
            return mlp.build(args, data, seed)
        """), encoding="utf-8")
    spec = psctl_env.write_spec("thread", program=str(program), workers=1, steps=200)
    done = psctl_env.run("up", str(spec), timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "thread"))
    chief = next(r for r in status_json(psctl_env, "thread")["roles"] if r["name"] == "chief-0")
    assert (chief["attempt"], chief["state"]) == (1, "succeeded"), chief
    log = psctl_env.run("logs", "chief-0", "thread").stdout
    assert "exiting with 1 thread(s) still running (not daemons" in log and "my-uploader" in log, log
    # the roles without such threads exit as they did, saying nothing of threads
    assert "thread(s) still running" not in psctl_env.run("logs", "worker-0", "thread").stdout


def test_a_worker_out_of_memory_is_restarted_and_its_step_run_by_another(psctl_env) -> None:
    """Out of memory is the worker process's (a host short of memory, a leak), not the program's bug: the step
    goes to another worker, the worker leaves as failed and is restarted by its policy, and training ends exactly.
    It was taken for a program error: the whole cluster failed at once (exit 3), a healthy worker beside it."""
    program = psctl_env.tmp_path / "hungry_program.py"
    program.write_text(textwrap.dedent("""\
        import os
        from pathlib import Path

        from psctl.models import mlp

        def build(args, data, seed):
            model = mlp.build(args, data, seed)
            train = model.loss_and_grads
            once = Path(__file__).with_name("ran-out-once")
            calls = [0]

            def loss_and_grads(params, batch):
                calls[0] += 1
                if os.environ["PSCTL_ROLE"] == "worker-1" and calls[0] == 20 and not once.exists():
                    once.touch()
                    raise MemoryError("Unable to allocate 586. KiB for an array")
                return train(params, batch)

            model.loss_and_grads = loss_and_grads
            return model
        """), encoding="utf-8")
    spec = psctl_env.write_spec("oom", program=str(program), workers=2, steps=2000)  # (seconds after the loss)
    done = psctl_env.run("up", str(spec), timeout=180)
    assert done.returncode == 0, (done.stdout, done.stderr, cluster_logs(psctl_env, "oom"))
    assert (psctl_env.tmp_path / "ran-out-once").exists()
    state = status_json(psctl_env, "oom")
    assert state["result"]["global_step"] == 2000
    assert sum(p + 1 for p in state["result"]["shard_positions"]) == 2000
    roles = {r["name"]: r for r in state["roles"]}
    assert roles["worker-1"]["restarts"] == 1, roles["worker-1"]  # (its new attempt may start as training ends)
    assert (roles["worker-0"]["attempt"], roles["chief-0"]["attempt"]) == (1, 1)
    events = psctl_env.run("events", "oom").stdout
    assert "worker-1" in events and "exit code 1" in events, events
    log = psctl_env.run("logs", "worker-1", "oom", "--attempt", "1").stdout
    assert "worker:1 ran out of memory in a train step (Unable to allocate 586. KiB for an array): it leaves, " \
        "to be restarted" in log, log[-3000:]


def test_up_says_at_once_why_its_supervisor_ended_as_it_started(psctl_env) -> None:
    """A supervisor that cannot run (here a broken install, as too many open files or too little memory would
    be): `up` waited its whole 30 s and said only that it did not start. It sees the supervisor end, says how
    (its exit code, its log's last line), and leaves nothing running."""
    site = psctl_env.tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""\
        import os, sys
        if sys.orig_argv[1:3] == ["-m", "psctl.supervisor"]:
            sys.stderr.write("ImportError: this test broke the supervisor's install\\n")
            sys.stderr.flush()
            os._exit(7)
        """))
    spec = psctl_env.write_spec("broken", steps=LONG)
    env = dict(psctl_env.env, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([psctl_binary(), "up", str(spec)], env=env, cwd=psctl_env.tmp_path, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    log = psctl_env.home / "broken" / "supervisor.log"
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert flat(done.stderr) == (
        "error: the supervisor of 'broken' ended as it started (exit code 7): ImportError: this test broke the "
        f"supervisor's install (the whole of it is in {log})"), done.stderr


def test_two_ups_of_one_name_at_once_start_one_cluster_and_refuse_the_other(psctl_env) -> None:
    """Each `up` checked that none ran, then made the cluster's keys: at once, the second made them again under
    the first's agent (TLS failed, both waited 30 s and failed). One holds the name while it starts; the other is
    refused at once (exit 2), whichever it is, and the cluster trains."""
    from psctl.home import ClusterDir, exclusive_lock, release

    spec = psctl_env.write_spec("twice", steps=LONG)
    psctl_env.home.mkdir()
    held = exclusive_lock(ClusterDir(psctl_env.home / "twice").up_lock)  # an `up` of it starting now
    try:
        refused = check(psctl_env.run("up", str(spec), "--detach"), 2)
        assert flat(refused.stderr) == ("error: another `psctl up` of cluster 'twice' is starting it now (watch it "
                                        "with `psctl status twice`)"), refused.stderr
        assert not (psctl_env.home / "twice" / "state.json").exists()
    finally:
        release(held)
    both = [psctl_env.popen("up", str(spec), "--detach") for _ in range(2)]
    outcomes = sorted((p.wait(timeout=120), p.communicate()[1]) for p in both)
    assert [code for code, _ in outcomes] == [0, 2], outcomes
    assert "another `psctl up` of cluster 'twice' is starting it now" in outcomes[1][1] or \
        "cluster 'twice' is already up" in outcomes[1][1], outcomes
    wait_cluster(psctl_env, "twice", lambda s: s["roles"][0].get("global_step", 0) >= 50, timeout=60,
                 what="the one cluster to train")


def test_a_relative_psctl_home_is_taken_from_the_folder_psctl_runs_in(psctl_env) -> None:
    """`PSCTL_HOME=runs psctl up ../spec.yaml`: the agent, started in the spec's folder, looked for its keys under
    a `runs` there; `up` waited 30 s and said the supervisor did not start."""
    elsewhere = psctl_env.tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = psctl_env.write_spec("rel", steps=100)
    env = dict(psctl_env.env, PSCTL_HOME="runs")
    done = subprocess.run([psctl_binary(), "up", os.path.relpath(spec, elsewhere)], env=env, cwd=elsewhere,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    state = elsewhere / "runs" / "rel" / "state.json"
    if state.is_file():
        psctl_env.cluster_ids.add(json.loads(state.read_text())["cluster_id"])
    # (its supervisor may still be ending: the teardown's `down` knows only the test's own PSCTL_HOME)
    subprocess.run([psctl_binary(), "down", "rel"], env=env, cwd=elsewhere, capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"checkpoint: {elsewhere}/runs/rel/checkpoints/ckpt-000000000100" in flat(done.stdout), done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_full_disk_under_psctl_home_is_one_line_and_down_purge_still_frees_it(psctl_env) -> None:
    """PSCTL_HOME's disk full: `down`'s save of the record failed with a traceback, and so did `down --purge` (it
    saved before it purged): psctl could not free its own space. Now `down` says what and where in one line
    (exit 1), `--purge` removes the cluster, and the failed save leaves no temporary file behind."""
    home = psctl_env.tmp_path / "small-disk"
    home.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(home)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    env = dict(psctl_env.env, PSCTL_HOME=str(home))
    try:
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([psctl_binary(), *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=60, stdin=subprocess.DEVNULL)

        check(run("up", str(psctl_env.write_spec("full", steps=LONG)), "--detach"))
        record = json.loads((home / "full" / "state.json").read_text())
        psctl_env.cluster_ids.add(record["cluster_id"])
        wait_until(lambda: len(psctl_env.processes()) >= 5, timeout=60, what="the supervisor, agent and roles")
        # all killed outright (a machine that rebooted): none frees what it wrote as it ends, and down must save
        for proc in psctl_env.processes():
            proc.kill()
        wait_until(lambda: not psctl_env.processes(), timeout=30, what="every process of it gone")
        with open(home / "filler", "wb", buffering=0) as filler:
            for size in (1 << 16, 1 << 12, 1):  # to the last byte
                with contextlib.suppress(OSError):
                    while True:
                        filler.write(b"\0" * size)
        down = run("down", "full")
        assert down.returncode == 1 and "Traceback" not in down.stderr, down.stderr
        assert flat(down.stderr) == (f"error: {home}/full/state.json: No space left on device (free space there; "
                                     "`psctl --debug` shows where)"), down.stderr
        assert not list((home / "full").glob(".*.tmp"))  # (what the failed save took, given back)
        check(run("down", "full", "--purge"))
        assert not (home / "full" / "state.json").exists()
    finally:
        subprocess.run(["umount", "-l", str(home)], check=False)


def test_program_that_fails_at_import_is_not_restarted(psctl_env) -> None:
    """An exception while importing the program is a program error: restarting cannot help, so the default
    restart policy must not restart it (the runtime's exit code 2), and the cluster fails at once."""
    program = write_boom(psctl_env.tmp_path)
    up_detached(psctl_env, "imp", program=str(program), workers=1)
    state = wait_cluster(
        psctl_env, "imp",
        lambda s: s["state"] in TERMINAL_CLUSTER_STATES or any(r["restarts"] for r in s["roles"]),
        timeout=60, what="'imp' to fail or restart a role",
    )
    restarted = {r["name"]: r["restarts"] for r in state["roles"] if r["restarts"]}
    assert restarted == {}, f"restarted a program that cannot import: {restarted}; events:\n" + (
        (psctl_env.home / "imp" / "events.jsonl").read_text())
    assert state["state"] == "failed"
    assert "boom" in state["reason"]


# -- (e) ----------------------------------------------------------------------------------------------------
def test_logs_follow_prints_new_lines_until_the_cluster_ends(psctl_env) -> None:
    up_detached(psctl_env, "fol", steps=LONG, ps=1, workers=1)
    follower = psctl_env.popen("logs", "chief-0", "fol", "--follow", "--tail", "1")
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        def two_step_lines() -> bool:
            # --tail 1 prints at most one old line: a second "step" line can only come from following.
            while not lines.empty():
                line = lines.get()
                assert line is not None, f"`psctl logs -f` ended while the cluster runs; it printed {seen}"
                seen.append(line)
            return sum(" step " in line for line in seen) >= 2

        wait_until(two_step_lines, timeout=30, interval=0.1, what="two 'step' lines from `psctl logs -f`",
                   detail=lambda: f"seen: {seen}\n{cluster_logs(psctl_env, 'fol')}")
        assert follower.poll() is None, "logs -f exited while the cluster runs"
        written = (psctl_env.home / "fol" / "logs" / "chief-0.1.log").read_text(encoding="utf-8").splitlines()
        assert all(line in written for line in seen), (seen, written)
        # Its supervisor killed (the cluster stale), the chief trains on: -f follows while the chief's process runs.
        supervisor = psutil.Process(psctl_env.state("fol")["supervisor_pid"])
        supervisor.kill()
        supervisor.wait(timeout=10)
        seen.clear()
        wait_until(two_step_lines, timeout=30, interval=0.1, what="two more 'step' lines without a supervisor",
                   detail=lambda: f"seen: {seen}\n{cluster_logs(psctl_env, 'fol')}")
        # When the cluster ends, -f prints what is left and exits by itself.
        check(psctl_env.run("down", "fol", "--grace", "2"))
        follower.wait(timeout=15)
        assert follower.returncode == 0
    finally:
        if follower.poll() is None:
            follower.terminate()
            try:
                follower.wait(timeout=10)
            except subprocess.TimeoutExpired:
                follower.kill()
                follower.wait(timeout=10)
        reader.join(timeout=10)
        for pipe in (follower.stdout, follower.stderr):
            if pipe is not None:
                pipe.close()


# -- (f) ----------------------------------------------------------------------------------------------------
def test_killed_worker_is_restarted_and_training_finishes(psctl_env) -> None:
    # One worker: while it is down no step can run, so training cannot finish before the restart; its steps
    # held (10 ms each) until the kill, so that it lands before the end, whenever the test sees training start.
    steps = 2000
    hold = Hold(psctl_env.tmp_path / "hold")
    hold.start()
    up_detached(psctl_env, "rst", steps=steps, ps=1, workers=1, program=str(hold.program))
    before = wait_cluster(
        psctl_env, "rst",
        lambda s: role_of(s, "chief-0")["global_step"] > 0 and role_of(s, "worker-0")["state"] == "running",
        timeout=60, what="training to start",
    )
    assert before["state"] == "running", before
    worker = role_of(before, "worker-0")
    assert worker["attempt"] == 1
    first_pid = worker["pid"]
    same_process(first_pid, worker["create_time"]).send_signal(signal.SIGKILL)
    hold.release()

    restarted = wait_cluster(psctl_env, "rst", lambda s: role_of(s, "worker-0")["attempt"] == 2,
                             timeout=30, what="worker-0 to be restarted (attempt 2)")
    assert role_of(restarted, "worker-0")["pid"] != first_pid
    assert role_of(restarted, "worker-0")["restarts"] == 1
    final = wait_cluster(psctl_env, "rst", lambda s: s["state"] in TERMINAL_CLUSTER_STATES,
                         timeout=90, what="training to finish")
    assert final["state"] == "succeeded", final
    assert final["result"]["global_step"] == steps

    events = [json.loads(line) for line in (psctl_env.home / "rst" / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["role"] == "worker-0" and e["to"] == "lost"]
    assert len(lost) == 1 and "killed by SIGKILL" in lost[0]["reason"], lost

    first_log = check(psctl_env.run("logs", "worker-0", "--attempt", "1")).stdout
    assert f"worker:0 starting (pid {first_pid})" in first_log
    current = check(psctl_env.run("logs", "worker-0")).stdout
    assert f"worker:0 starting (pid {role_of(final, 'worker-0')['pid']})" in current
    assert f"(pid {first_pid})" not in current
    check(psctl_env.run("logs", "worker-0", "--attempt", "3"), 2)

    check(psctl_env.run("down"))
    assert psctl_env.processes(final["cluster_id"]) == []


def test_sigterm_to_the_supervisor_stops_the_cluster_and_says_so(psctl_env) -> None:
    """Someone's `kill` of the supervisor stops the cluster cleanly; its reason says so (it said `psctl down`)."""
    up_detached(psctl_env, "termsup", steps=100000, ps=1, workers=1)
    state = wait_cluster(psctl_env, "termsup", lambda s: s["state"] == "running", timeout=60, what="running")
    pid = state["supervisor_pid"]
    psutil.Process(pid).terminate()
    stopped = wait_cluster(psctl_env, "termsup", lambda s: s["state"] == "stopped", timeout=60, what="stopped")
    reason = f"stopped by SIGTERM to the supervisor (pid {pid})"
    assert stopped["reason"] == reason, stopped
    assert {r["reason"] for r in stopped["roles"]} == {reason}, stopped["roles"]
    wait_until(lambda: psctl_env.processes() == [], timeout=20, what="the supervisor and the agent to exit")


def test_an_attached_up_whose_cluster_is_stopped_elsewhere_exits_1_saying_so(psctl_env) -> None:
    """`psctl up x.yaml && psctl export ...`: a cluster stopped by `psctl down` from another shell before training
    finished is not a success (`up` exited 0)."""
    spec = psctl_env.write_spec("stopme", steps=LONG, ps=1, workers=1)
    spec.write_text(spec.read_text().replace("  mode: async\n", "  mode: async\n  checkpoint: {every_steps: 50}\n"))
    attached = psctl_env.popen("up", str(spec))
    try:
        wait_until(lambda: psctl_env.state_file("stopme").is_file(), timeout=30, what="'stopme' to be written")
        wait_cluster(psctl_env, "stopme", lambda s: max(r["global_step"] for r in s["roles"]) > 0, timeout=60,
                     what="'stopme' to train")
        check(psctl_env.run("down", "stopme"))
        out, err = attached.communicate(timeout=60)
    finally:
        if attached.poll() is None:
            attached.kill()
            attached.communicate()
    assert attached.returncode == 1, (attached.returncode, out, err)
    said = re.search(r"error: cluster 'stopme' was stopped at global step (\d+) of (\d+), before training finished: "
                     r"stopped by psctl down \(`psctl up` of its spec resumes it from its last checkpoint\)",
                     flat(err))
    assert said is not None and int(said[2]) == LONG and 0 < int(said[1]) < LONG, err
    assert "Traceback" not in out + err
    # the step it says (and status) is where it stopped: at or past its last checkpoint (it showed the step of
    # the chief's last report before, behind the checkpoint the stop took)
    newest = list_checkpoints(psctl_env.home / "stopme" / "checkpoints")[-1]
    assert int(said[1]) >= int(newest.name.removeprefix("ckpt-")), (said[0], newest)

"""The command line in-process (click's CliRunner): plans, one-line errors with exit codes, and the commands that
read a cluster's state. These tests start no training: where a cluster must exist, its state file and logs are
written as a supervisor writes them (test_e2e_local.py runs the same commands against real clusters)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from psctl import __version__
from psctl.cli import cli
from psctl.errors import EXIT_NOT_FOUND, EXIT_USAGE
from psctl.home import KEPT_RUNS, ClusterDir, release, take_supervision
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, load_state, save_state

ROLES_2X2 = ("chief-0", "ps-0", "ps-1", "worker-0", "worker-1")


def flat(text: str) -> str:
    """Output with every run of whitespace made one space (rich wraps long lines at the console width)."""
    return " ".join(text.split())


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), prog_name="psctl")


def check_ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result


def assert_one_line_error(result: Result, code: int, expected: str) -> str:
    """Exit ``code``, nothing on stdout, exactly one ``error:`` line on stderr containing ``expected``, and no
    traceback anywhere."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"
    return lines[0]


def test_validate_prints_the_plan(psctl_env) -> None:
    spec = psctl_env.write_spec("plan", ps=2, workers=2)
    result = invoke("validate", str(spec))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stderr == ""
    for role in ROLES_2X2:
        assert re.search(rf"\b{role}\b", result.stdout), f"{role} missing from the plan:\n{result.stdout}"
    assert "plan for cluster 'plan'" in result.stdout
    assert f"{spec}: valid (5 roles)" in flat(result.stdout)
    # Every role gets its own free local port.
    ports = re.findall(r"127\.0\.0\.1\s*\S\s*(\d+)", result.stdout)
    assert len(ports) == 5 and len(set(ports)) == 5, result.stdout
    assert not psctl_env.home.exists(), "validate must not create any cluster state"


def test_up_dry_run_starts_nothing(psctl_env) -> None:
    spec = psctl_env.write_spec("dry", ps=2, workers=2)
    result = invoke("up", "--dry-run", str(spec))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    for role in ROLES_2X2:
        assert role in result.stdout
    assert "dry run: nothing started (5 roles planned)" in flat(result.stdout)
    assert not (psctl_env.home / "dry").exists(), "a dry run must not create the cluster's state folder"
    assert psctl_env.processes() == []


GOOD = """\
name: mistakes
roles:
  chief: {}
  ps: {replicas: 1}
  worker: {replicas: 2}
training:
  program: psctl.models.mlp
  data: {name: digits}
  steps: 100
"""

# (id, file content (str or bytes; None: no file at all), what the one error line must contain)
SPEC_MISTAKES = [
    (
        "unknown key with did-you-mean",
        GOOD.replace("{replicas: 2}", "{replicas: 2, restrat: {policy: never}}"),
        "cluster.yaml:5: roles.worker.restrat: unknown key; did you mean 'restart'?",
    ),
    (
        "wrong type",
        GOOD.replace("{replicas: 1}", "{replicas: two}"),
        "cluster.yaml:4: roles.ps.replicas: expected an integer >= 1, got 'two'",
    ),
    (
        "missing role",
        GOOD.replace("  chief: {}\n", ""),
        "cluster.yaml:2: roles.chief: required role missing",
    ),
    (
        "invalid YAML",
        GOOD.replace("{replicas: 1}", "{replicas: 1"),
        "cluster.yaml:5: invalid YAML",
    ),
    (
        "not UTF-8",
        GOOD.encode() + b"# \xff\xfe\n",
        "cluster.yaml: cannot read the spec: not UTF-8 text",
    ),
    (
        "no such file",
        None,
        "cluster.yaml: cannot read the spec: No such file or directory",
    ),
]


@pytest.mark.parametrize("command", [["validate"], ["up"], ["up", "--dry-run"]], ids=" ".join)
@pytest.mark.parametrize(
    ("content", "expected"), [m[1:] for m in SPEC_MISTAKES], ids=[m[0] for m in SPEC_MISTAKES]
)
def test_spec_mistake_is_one_line_with_exit_code_2(
    psctl_env, monkeypatch: pytest.MonkeyPatch, command: list[str], content: str | bytes | None, expected: str
) -> None:
    monkeypatch.chdir(psctl_env.tmp_path)
    path = Path("cluster.yaml")
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    result = invoke(*command, str(path))
    assert_one_line_error(result, EXIT_USAGE, expected)
    assert not psctl_env.home.exists(), "a bad spec must start nothing and write no state"


def test_debug_shows_the_traceback(psctl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(psctl_env.tmp_path)
    Path("cluster.yaml").write_text(GOOD.replace("{replicas: 1}", "{replicas: two}"), encoding="utf-8")
    plain = invoke("validate", "cluster.yaml")
    assert "Traceback" not in plain.stderr
    result = invoke("--debug", "validate", "cluster.yaml")
    assert result.exit_code == EXIT_USAGE, (result.stdout, result.stderr)
    assert "Traceback (most recent call last)" in result.stderr
    assert "SpecError" in result.stderr
    # The one-line message still ends the output, as without --debug.
    assert result.stderr.strip().splitlines()[-1] == plain.stderr.strip()


@pytest.mark.parametrize(
    ("spec_path", "content", "expected"),
    [
        # A folder whose name looks like rich markup must be printed as written, not eaten as a style tag.
        ("specs[red]/cluster.yaml", GOOD.replace("{replicas: 1}", "{replicas: two}"),
         "specs[red]/cluster.yaml:4: roles.ps.replicas"),
        # A key that is a closing tag matching nothing: rich raises MarkupError unless the message is escaped.
        ("cluster.yaml", GOOD + '"[/x]": 1\n', "cluster.yaml:10: '[/x]': unknown key"),
    ],
    ids=["path with [red]", "key [/x]"],
)
def test_error_message_is_printed_verbatim(
    psctl_env, monkeypatch: pytest.MonkeyPatch, spec_path: str, content: str, expected: str
) -> None:
    monkeypatch.chdir(psctl_env.tmp_path)
    path = Path(spec_path)
    path.parent.mkdir(exist_ok=True)
    path.write_text(content, encoding="utf-8")
    result = invoke("validate", spec_path)
    assert_one_line_error(result, EXIT_USAGE, expected)


@pytest.mark.parametrize("spec_path", ["specs[red]/cluster.yaml", "x[/b]/cluster.yaml"])
def test_valid_spec_path_is_printed_verbatim(psctl_env, monkeypatch: pytest.MonkeyPatch, spec_path: str) -> None:
    monkeypatch.chdir(psctl_env.tmp_path)
    path = Path(spec_path)
    path.parent.mkdir(parents=True)
    path.write_text(GOOD, encoding="utf-8")
    result = invoke("validate", spec_path)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert f"{spec_path}: valid (4 roles)" in flat(result.stdout)


@pytest.mark.parametrize(
    "args",
    [["status"], ["status", "--json"], ["logs", "chief-0"], ["down"], ["events"]],
    ids=" ".join,
)
def test_no_cluster_is_exit_4_with_a_hint(psctl_env, args: list[str]) -> None:
    result = invoke(*args)
    line = assert_one_line_error(result, EXIT_NOT_FOUND, "no cluster found")
    assert "psctl up" in line


def test_unknown_cluster_name_is_exit_4(psctl_env) -> None:
    result = invoke("status", "ghost")
    line = assert_one_line_error(result, EXIT_NOT_FOUND, "no cluster named 'ghost'")
    assert "psctl up" in line


@pytest.mark.parametrize("args", [["down", "--purge", "{}"], ["status", "{}"], ["logs", "chief", "{}"],
                                  ["export", "{}", "-o", "m.npz"]], ids=lambda a: a[0])
def test_a_cluster_name_that_is_a_path_is_refused_and_nothing_outside_psctl_home_is_touched(
    psctl_env, tmp_path: Path, args: list[str]
) -> None:
    """`psctl down --purge ../victim` deleted a folder beside PSCTL_HOME that held a copied state.json."""
    victim = tmp_path / "victim"
    recorded_cluster("victim", {"chief-0": 1}).root.rename(victim)  # a cluster's files, outside PSCTL_HOME
    for name in ("../victim", str(victim)):
        result = invoke(*(a.format(name) for a in args))
        line = assert_one_line_error(result, EXIT_USAGE, f"{name!r} is not a cluster name")
        assert "psctl ls" in line
    assert sorted(p.name for p in victim.iterdir()) == ["logs", "run", "state.json"]
    copied = ClusterDir.named("victim").root.with_name("victim.bak")  # a hand-made copy in PSCTL_HOME: no
    shutil.copytree(victim, copied)  # command could name it, so ls does not list it either
    assert "victim.bak" not in invoke("ls").stdout and json.loads(invoke("ls", "--json").stdout) == []
    shutil.rmtree(copied)
    gone = invoke("status", "missing.yaml")  # a spec path that is not there: said so, as not found
    assert_one_line_error(gone, EXIT_NOT_FOUND, "no cluster named 'missing.yaml', and no spec file there")


def recorded_cluster(name: str, roles: dict[str, int], *, state: ClusterState = ClusterState.SUCCEEDED,
                     steps: int = 50) -> ClusterDir:
    """A cluster as a supervisor leaves it on disk: state.json (``roles``: name -> attempts) and each attempt's
    log. The e2e tests do the same against clusters a real supervisor ran."""
    cdir = ClusterDir.named(name)
    cdir.create()
    records = []
    for role_name, attempts in roles.items():
        role, _, index = role_name.rpartition("-")
        records.append(RoleRecord(name=role_name, role=role, index=int(index), host="localhost",
                                  address="127.0.0.1", port=7000 + len(records), state=RoleState.STOPPED,
                                  attempt=attempts, restarts=max(0, attempts - 1)))
        for attempt in range(1, attempts + 1):
            cdir.role_log(role_name, attempt).write_text(
                "".join(f"{role_name} attempt {attempt} line {i}\n" for i in range(1, 6)), encoding="utf-8")
    save_state(cdir.state_file, ClusterRecord(name=name, cluster_id=f"{name}-0000", state=state, steps=steps,
                                              roles=records, supervisor_pid=None))
    return cdir


def test_supervise_of_a_finished_cluster_says_how_to_start_it_again_with_its_overrides(psctl_env) -> None:
    """(It named the spec alone: without the run's --set training.steps=..., that `up` had nothing to train.)"""
    cdir = recorded_cluster("done", {"chief-0": 1})
    record = load_state(cdir.state_file)
    record.spec_path, record.spec_overrides = "/specs/my spec.yaml", ["training.steps=14500"]
    save_state(cdir.state_file, record)
    assert_one_line_error(invoke("supervise", "done"), EXIT_USAGE,
                          "cluster 'done' has succeeded; nothing to supervise (start it again with `psctl up "
                          "'/specs/my spec.yaml' --set training.steps=14500` (raise training.steps to train further))")


def test_logs_unknown_role_lists_the_valid_roles(psctl_env) -> None:
    recorded_cluster("lg", {"chief-0": 1, "ps-0": 1, "worker-0": 2, "worker-1": 1})
    result = invoke("logs", "worker-7")
    line = assert_one_line_error(result, EXIT_USAGE, "no role 'worker-7' in cluster 'lg'")
    assert "roles are: chief-0, ps-0, worker-0, worker-1" in line
    named = invoke("logs", "worker-7", "lg")
    assert_one_line_error(named, EXIT_USAGE, "roles are: chief-0, ps-0, worker-0, worker-1")
    swapped = invoke("logs", "lg", "worker-0")
    assert_one_line_error(swapped, EXIT_USAGE, "'lg' is a cluster and 'worker-0' is not: the role comes first "
                                               "(psctl logs worker-0 lg)")
    attempt = invoke("logs", "worker-0", "lg", "--attempt", "3")
    assert_one_line_error(attempt, EXIT_USAGE, "worker-0 has attempts 1..2; --attempt 3 does not exist")


def test_logs_prints_the_current_or_an_earlier_attempt(psctl_env) -> None:
    recorded_cluster("lg", {"chief-0": 1, "ps-0": 1, "worker-0": 2})
    current = invoke("logs", "worker-0")
    assert current.exit_code == 0, (current.stdout, current.stderr)
    assert current.stdout.splitlines() == [f"worker-0 attempt 2 line {i}" for i in range(1, 6)]
    first = invoke("logs", "worker-0", "lg", "--attempt", "1")
    assert first.stdout.splitlines() == [f"worker-0 attempt 1 line {i}" for i in range(1, 6)]
    tail = invoke("logs", "worker-0", "--tail", "2")
    assert tail.stdout.splitlines() == ["worker-0 attempt 2 line 4", "worker-0 attempt 2 line 5"]
    # --follow on a finished cluster prints the log and returns instead of waiting forever.
    follow = invoke("logs", "chief-0", "-f")
    assert follow.exit_code == 0, (follow.stdout, follow.stderr)
    assert follow.stdout.splitlines() == [f"chief-0 attempt 1 line {i}" for i in range(1, 6)]


def test_logs_of_a_deleted_log_file_names_it_and_exits_not_found(psctl_env) -> None:
    """`psctl logs chief` of a role whose log file was deleted printed nothing and exited 0, as if the role had
    logged nothing; a role still starting (its agent creates the log) has none yet, which is no error."""
    cdir = recorded_cluster("lg", {"chief-0": 1, "worker-0": 2})
    cdir.role_log("chief-0", 1).unlink()
    cdir.role_log("worker-0", 1).unlink()
    for args in (["chief"], ["chief-0", "-f"], ["chief", "lg", "-n", "5"]):
        assert_one_line_error(invoke("logs", *args), EXIT_NOT_FOUND,
                              f"error: the log of chief-0's attempt 1 is missing: {cdir.role_log('chief-0', 1)} "
                              "(deleted or moved, or the attempt never started; `psctl events`")
    line = assert_one_line_error(invoke("logs", "worker-0", "--attempt", "1"), EXIT_NOT_FOUND, "worker-0's attempt 1")
    assert "--attempt 1..2 reads another attempt's" in line
    assert check_ok(invoke("logs", "worker-0")).stdout.splitlines()[0] == "worker-0 attempt 2 line 1"
    record = load_state(cdir.state_file)
    record.roles[0].attempt, record.roles[0].state = 2, RoleState.STARTING
    save_state(cdir.state_file, record)
    assert check_ok(invoke("logs", "chief")).stdout == ""


def test_ls_lists_clusters(psctl_env) -> None:
    empty = invoke("ls")
    assert empty.exit_code == 0, (empty.stdout, empty.stderr)
    header = ["name", "state", "roles", "step", "updated", "result", "(test", "split)"]
    assert [line.split() for line in empty.stdout.splitlines() if line.strip()] == [header]
    # One cluster that finished (with the test split's metrics: a sweep's runs compare by them), and one that says
    # it runs although it has no supervisor (so it is stale). (test_e2e_local lists a cluster a real supervisor ran.)
    done = recorded_cluster("done", {"chief-0": 1, "ps-0": 1, "worker-0": 1})
    record = load_state(done.state_file)
    record.result, record.spec_overrides = {"metrics": {"loss": 0.0633, "accuracy": 0.9889}}, ["training.steps=50"]
    save_state(done.state_file, record)
    recorded_cluster("orphan", {"chief-0": 1}, state=ClusterState.RUNNING, steps=7)
    # stale too, but its chief finished after the supervisor died: the result it left is shown all the same
    gone = recorded_cluster("gone", {"chief-0": 1}, state=ClusterState.RUNNING, steps=9)
    gone.run_dir.mkdir(parents=True, exist_ok=True)
    (gone.run_dir / "result.json").write_text(json.dumps({"global_step": 9, "metrics": {"accuracy": 0.75}}))
    # the step it was at, as its chief's metrics last said (not the steps it trains to)
    (gone.run_dir / "metrics.jsonl").write_text(json.dumps({"event": "progress", "global_step": 4}) + "\n")
    result = invoke("ls")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.split()[:len(header)] == header, result.stdout
    rows = " ".join(result.stdout.split()[len(header):])  # (a narrow terminal wraps the result cell)
    when = r"\d\d-\d\d \d\d:\d\d"
    assert re.fullmatch(rf"done succeeded 3 0/50 {when} loss 0\.0633, accuracy 0\.9889 "
                        rf"gone running\* 1 4/9 {when} accuracy 0\.7500 "
                        rf"orphan running\* 1 0/7 {when} - \* stale: its supervisor is not running; `psctl "
                        r"supervise NAME` takes it up again", rows), result.stdout
    assert all(len(line) <= 80 for line in result.stdout.splitlines()), result.stdout
    listed = json.loads(check_ok(invoke("ls", "--json")).stdout)
    assert [c["global_step"] for c in listed] == [0, 4, 0]
    assert [(c["name"], c["state"], c["stale"], c["steps"], c["spec_overrides"], c["result"]) for c in listed] == [
        ("done", "succeeded", False, 50, ["training.steps=50"], {"metrics": {"loss": 0.0633, "accuracy": 0.9889}}),
        ("gone", "running", True, 9, [], {"global_step": 9, "metrics": {"accuracy": 0.75}}),
        ("orphan", "running", True, 7, [], None)]
    status = check_ok(invoke("status", "gone"))
    assert "result (test split): accuracy 0.7500" in status.stdout, status.stdout
    assert "training finished, but the supervisor of 'gone' died before it stopped the other roles" in " ".join(
        status.stderr.split()), status.stderr
    # `down` of a cluster that had finished changes nothing of it: ls showed the down's time as when it ended
    check_ok(invoke("down", "done"))
    assert load_state(done.state_file).updated_at == record.updated_at
    check_ok(invoke("down", "orphan"))
    assert load_state(ClusterDir.named("orphan").state_file).state == ClusterState.STOPPED


def test_a_cluster_whose_supervisor_holds_its_lock_is_not_stale_before_it_records_its_pid(psctl_env) -> None:
    """A supervisor takes the cluster's lock first and records its pid after (the imports, the state read): until
    then the record names no supervisor, yet one runs. `status`, `ls` and `supervise` ask the lock."""
    cdir = recorded_cluster("starting", {"chief-0": 1}, state=ClusterState.STARTING)
    held = take_supervision(cdir)  # as the starting supervisor does
    assert held is not None and held >= 0
    try:
        assert json.loads(check_ok(invoke("status", "starting", "--json")).stdout)["stale"] is False
        assert [c["stale"] for c in json.loads(check_ok(invoke("ls", "--json")).stdout)] == [False]
        again = invoke("supervise", "starting")
        assert_one_line_error(again, EXIT_USAGE, "cluster 'starting' is supervised already")
    finally:
        release(held)
    # the lock free (the supervisor ended, however it ended): stale, whatever the record says
    assert json.loads(check_ok(invoke("status", "starting", "--json")).stdout)["stale"] is True


def test_psctl_alone_prints_its_help() -> None:
    """click 8.2 made a group without a command a usage error: psctl printed its help headed "error: Usage:"."""
    result = invoke()
    assert result.exit_code == 0, (result.stdout, result.stderr)
    assert result.stdout.startswith("Usage: ") and "Commands:" in result.stdout and result.stderr == ""


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"psctl, version {__version__}"


def test_help_lists_every_command() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("validate", "up", "status", "ls", "logs", "down", "events"):
        assert re.search(rf"^\s+{command}\b", result.stdout, re.MULTILINE), command


def test_status_shows_the_evaluators_latest_result(psctl_env) -> None:
    cdir = recorded_cluster("ev", {"chief-0": 1, "ps-0": 1, "worker-0": 1, "evaluator-0": 1})
    record = load_state(cdir.state_file)
    evaluator = record.role("evaluator-0")
    evaluator.metrics = {"cpu": 0.01}  # before its first evaluation: no line that ends at a colon
    save_state(cdir.state_file, record)
    assert "evaluator:" not in check_ok(invoke("status", "ev")).stdout
    # (its heartbeat adds the CPU it used, for psctl top: not an evaluation metric)
    evaluator.global_step, evaluator.metrics = 300, {"accuracy": 0.9721, "loss": 0.0912, "cpu": 0.1186}
    save_state(cdir.state_file, record)
    result = invoke("status", "ev")
    assert result.exit_code == 0, result.stderr
    assert "evaluator: global step 300: accuracy 0.9721, loss 0.0912\n" in " ".join(result.stdout.split(" "))
    as_json = json.loads(invoke("status", "ev", "--json").stdout)
    assert {r["name"]: r["metrics"] for r in as_json["roles"]}["evaluator-0"] == {
        "accuracy": 0.9721, "loss": 0.0912, "cpu": 0.1186}


def test_status_shows_each_workers_steps_no_step_for_a_ps_and_a_tiny_loss_as_it_is(psctl_env) -> None:
    cdir = recorded_cluster("rows", {"chief-0": 1, "ps-0": 1, "worker-0": 1}, state=ClusterState.RUNNING, steps=9000)
    record = load_state(cdir.state_file)
    for role in record.roles:
        role.last_heartbeat, role.global_step, role.local_step = time.time(), 8000, 4321
    save_state(cdir.state_file, record)
    with open(cdir.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": "progress", "global_step": 8000, "loss": 3.2154e-05, "steps_per_sec": 900.0})
                + "\n")
    result = invoke("status", "rows")
    assert result.exit_code == 0, result.stderr
    step_column = {line.split()[0]: line.split()[-1] for line in result.stdout.splitlines()
                   if line.split() and line.split()[0] in ("chief-0", "ps-0", "worker-0")}
    # a ps runs no steps (it showed 0); a worker its own; the chief the global step
    assert step_column == {"chief-0": "8000", "ps-0": "-", "worker-0": "4321"}, result.stdout
    # the newest training batch's loss, said so (the result's is the test split's: the two differ)
    assert "train loss 3.215e-05" in result.stdout  # it showed 0.0000


def test_a_specs_path_names_its_cluster(psctl_env, tmp_path: Path) -> None:
    recorded_cluster("named", {"chief-0": 1, "worker-0": 1})
    recorded_cluster("stem", {"chief-0": 1, "worker-0": 1})
    (tmp_path / "cluster.yaml").write_text("name: named\nroles: {chief: {}}\n", encoding="utf-8")
    (tmp_path / "stem.yml").write_text("roles: {chief: {}}\n", encoding="utf-8")  # no name: its stem
    for spec, name in ((tmp_path / "cluster.yaml", "named"), (tmp_path / "stem.yml", "stem")):
        result = invoke("status", str(spec), "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout)["name"] == name
        assert invoke("events", str(spec)).exit_code == 0
    gone = invoke("status", str(tmp_path / "other.yaml"))  # no such file: taken as a name, which is unknown
    assert_one_line_error(gone, EXIT_NOT_FOUND, "no cluster named")


def test_the_finish_line_says_where_training_resumed() -> None:
    from psctl.cli import _steps_text

    record = ClusterRecord(name="r", cluster_id="r-0", steps=1500, roles=[
        RoleRecord(name="chief-0", role="chief", index=0, host="localhost", address="127.0.0.1", port=7000)])
    result = {"global_step": 1500, "steps_this_run": 1500, "seconds": 2.04, "checkpoint": "/c/ckpt-000000001500"}
    assert _steps_text(record, result) == "1500 steps in 2.0s"
    result["steps_this_run"] = 500  # `psctl up` of a name whose checkpoints are there: restored, then trained on
    assert _steps_text(record, result) == (
        "1500 steps; 500 in 2.0s from an earlier run's checkpoint at global step 1000 in /c")
    record.roles[0].attempt = 2  # a restarted chief resumes where the ps are
    assert _steps_text(record, result) == "1500 steps; 500 in 2.0s since the chief resumed at global step 1000"
    result["recomputed_steps"] = 120  # a ps lost: every ps restored to a checkpoint 120 steps behind
    assert _steps_text(record, result) == ("1500 steps; 500 in 2.0s since the chief resumed at global step 1000; "
                                           "120 of them trained again after a ps was lost")


def test_the_finish_line_and_status_say_that_checkpoints_failed(psctl_env) -> None:
    """A run whose every save failed said "checkpoint: no checkpoint configured" and exited 0 silently."""
    cdir = recorded_cluster("ck", {"chief-0": 1})
    record = load_state(cdir.state_file)
    record.result = {"global_step": 50, "steps_this_run": 50, "seconds": 1.0, "metrics": {}, "checkpoint": None,
                     "checkpoint_failures": {"count": 3, "last": "step 50: [Errno 17] File exists: '/x'",
                                             "final_failed": True}}
    save_state(cdir.state_file, record)
    from psctl.cli import _finish_line

    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        _finish_line(cdir, record)
    line = " ".join(out.getvalue().decode().split())
    assert "checkpoint: none written (3 save(s) failed, the last at step 50: [Errno 17] File exists: '/x')" in line
    assert "checkpoints of 'ck' failed" in err.getvalue().decode() and "psctl logs chief ck" in err.getvalue().decode()
    record.result["checkpoint"] = "/c/ckpt-000000000040"
    save_state(cdir.state_file, record)
    assert "/c/ckpt-000000000040, from before the end of training (3 save(s)" in flat(invoke("status", "ck").stdout)
    record.result["checkpoint_failures"]["final_failed"] = False
    save_state(cdir.state_file, record)
    assert "/c/ckpt-000000000040 (3 save(s) failed" in flat(invoke("status", "ck").stdout)


def test_status_says_while_training_runs_that_checkpoints_are_failing(psctl_env) -> None:
    """Saves failing (a full disk) showed only once training had ended: a ps lost meanwhile went back thousands of
    steps, to the last save that worked, with no word anywhere but the chief's log."""
    cdir = recorded_cluster("ckr", {"chief-0": 1}, state=ClusterState.RUNNING, steps=8000)
    failing = {"count": 24, "last": "step 7900: [Errno 28] No space left on device", "latest": "/c/ckpt-000000000506"}
    (cdir.run_dir / "metrics.jsonl").write_text(json.dumps(
        {"time": 1.0, "event": "progress", "global_step": 7900, "loss": 0.5, "steps_per_sec": 100.0,
         "checkpoint_failures": failing}) + "\n")
    said = ("checkpoints failing: 24 save(s) failed, the last at step 7900: [Errno 28] No space left on device; the "
            "latest written: /c/ckpt-000000000506 (the chief's log says more)")
    assert said in flat(invoke("status", "ckr").stdout)
    from psctl.render import progress_line
    assert progress_line(cdir, load_state(cdir.state_file)).endswith(f"; {said}; roles: 1 stopped")
    record = load_state(cdir.state_file)
    record.state = ClusterState.SUCCEEDED  # ended: the result says it (checkpoint_text), not the last progress
    save_state(cdir.state_file, record)
    assert "checkpoints failing" not in flat(invoke("status", "ckr").stdout)


def test_the_commands_and_the_supervisor_import_no_ssh_library_for_a_cluster_on_this_machine() -> None:
    """paramiko is a third of what `psctl` imports (~0.15 s a start): only clusters with remote hosts load it."""
    script = ("import sys, psctl.cli, psctl.supervisor.__main__, psctl.agent.__main__; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'paramiko'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_a_host_s_agent_starts_without_numpy() -> None:
    """An agent only starts, watches and reports processes: numpy (~45 ms of its start, on every host of an
    ``up``) is for the roles."""
    script = "import sys, psctl.agent.__main__; print('numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", (done.stdout, done.stderr)


def test_the_commands_that_read_a_cluster_import_none_of_the_launch_machinery() -> None:
    """`psctl status`, `logs`, `top`, `events`, `ls` and `--help` read state files and logs: numpy (spec
    validation, checkpoints), cryptography (certificates) and gRPC (the agents' endpoint) are for the commands
    that start or stop something, which import them when they run (`psctl status` 0.31 -> 0.14 s)."""
    heavy = ("numpy", "cryptography", "grpc", "paramiko", "psctl.operations", "psctl.spec.schema")
    script = f"import sys, psctl.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_a_spec_read_back_from_a_cluster_s_state_needs_no_validation_imports() -> None:
    """The supervisor's state holds the spec and plan already validated: reading them back (psctl.supervisor.state)
    must not load the validation's optimizers and partitioners."""
    script = "import sys, psctl.supervisor.state; print('psctl.spec.schema' in sys.modules, 'numpy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False False", (done.stdout, done.stderr)


def _running_record(cdir: ClusterDir, supervisor_pid: int, create_time: float) -> ClusterRecord:
    record = ClusterRecord(name=cdir.name, cluster_id=f"{cdir.name}-1", state=ClusterState.RUNNING,
                           supervisor_pid=supervisor_pid, supervisor_create_time=create_time)
    save_state(cdir.state_file, record)
    return record


def test_up_s_watch_ends_with_the_outcome_and_asks_whether_the_supervisor_runs_once_a_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state file is looked at every 50 ms, but the supervisor's liveness (for a Slurm cluster a query of
    Slurm's) once a second at most."""
    import dataclasses
    import threading
    import time

    import psutil

    from psctl import cli as cli_module
    from psctl import observe

    cdir = ClusterDir(tmp_path / "home" / "watched")
    cdir.create()
    me = psutil.Process()
    record = _running_record(cdir, me.pid, me.create_time())
    checks: list[float] = []
    real = observe.is_stale
    monkeypatch.setattr(observe, "is_stale", lambda c, r: checks.append(time.monotonic()) or real(c, r))
    done = threading.Timer(0.3, lambda: save_state(cdir.state_file,
                                                   dataclasses.replace(record, state=ClusterState.SUCCEEDED)))
    done.start()
    try:
        ended = cli_module._watch(cdir)
    finally:
        done.cancel()
    assert ended.state == ClusterState.SUCCEEDED
    # ~6 polls of the file before the outcome, and a liveness check at most once a second (one, unless the
    # timer or the watch ran late on a loaded machine)
    assert 1 <= len(checks) <= 2 and all(b - a >= 0.9 for a, b in itertools.pairwise(checks)), checks


def test_up_s_watch_says_when_the_supervisor_died(tmp_path: Path) -> None:
    import psutil

    from psctl import cli as cli_module
    from psctl.errors import PsctlError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(gone.pid).create_time()
    gone.wait(timeout=30)
    cdir = ClusterDir(tmp_path / "home" / "orphaned")
    cdir.create()
    _running_record(cdir, gone.pid, created)
    with pytest.raises(PsctlError, match="the supervisor of 'orphaned' died; roles may still run"):
        cli_module._watch(cdir)


def test_down_of_several_clusters_stops_each_ones_processes_and_a_misspelt_name_stops_nothing(psctl_env) -> None:
    """`psctl down sweep-a sweep-b`: the runs of a sweep brought down at once, each verified empty; every name
    is looked up first, so a misspelt one stops nothing."""
    names = ("sweep-a", "sweep-b")
    for name in names:
        recorded_cluster(name, {"chief-0": 1}, state=ClusterState.RUNNING)
    roles = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                                    env={"PSCTL_CLUSTER_ID": f"{name}-0000", "PATH": "/usr/bin:/bin"})
             for name in names}  # a process of each cluster, as its roles carry its id
    try:
        assert_one_line_error(invoke("down", "sweep-a", "sweep-c"), EXIT_NOT_FOUND, "sweep-c")
        assert all(p.poll() is None for p in roles.values())  # nothing stopped
        done = invoke("down", "sweep-a", "sweep-b", "sweep-a", "--grace", "2")
        assert done.exit_code == 0, (done.stdout, done.stderr)
        said = " ".join(done.stdout.split())
        assert [said.count(f"cluster '{n}': stopped 1 process(es); no process of it is left") for n in names] == [1, 1]
        for process in roles.values():
            assert process.wait(timeout=10) is not None

        # one that cannot be brought down (its SSH host does not answer) is named; the others still go down
        unreachable = recorded_cluster("sweep-c", {"chief-0": 1}, state=ClusterState.RUNNING)
        record = load_state(unreachable.state_file)
        with socket.socket() as probe:  # a loopback port nothing listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        record.hosts = {"gone": {"spec": {"name": "gone", "address": "127.0.0.1", "port": port}, "root": "~/x"}}
        record.roles[0].host = "gone"  # its chief ran there
        save_state(unreachable.state_file, record)
        mixed = invoke("down", "sweep-c", "sweep-a")
        assert mixed.exit_code == 1, (mixed.stdout, mixed.stderr)
        errors = [" ".join(line.split()) for line in mixed.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 2 and errors[0].startswith("error: cluster 'sweep-c': cannot verify"), errors
        assert "gone" in mixed.stderr
        assert errors[1] == ("error: 1 of 2 clusters are not down: sweep-c (see the errors above; run psctl down "
                             "again for them)"), errors
        assert "cluster 'sweep-a': nothing was running; no process of it is left" in " ".join(mixed.stdout.split())
    finally:
        shutil.rmtree(ClusterDir.named("sweep-c").root, ignore_errors=True)  # its host never answers
        for process in roles.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize(("record", "why"), [
    ({"name": "c", "cluster_id": "c-1", "result": "oops"}, "'result' is a JSON str"),
    ({"name": "c", "cluster_id": "c-1", "roles": [[1]]}, "a role is a JSON list"),
    ({"name": "c"}, "the record has no 'cluster_id'"),
    ({"name": "c", "cluster_id": "c-1", "state": "weird"}, "unknown state 'weird'"),
    ({"name": "c", "cluster_id": "c-1", "roles": [{"name": "ps-0"}]}, "a role has no 'role'"),
])
def test_a_state_file_whose_fields_are_not_psctl_s_says_which_field(tmp_path: Path, record: dict[str, Any],
                                                                    why: str) -> None:
    """(A result that was text broke `ls` for every cluster with an AttributeError.)"""
    from psctl.supervisor.state import DamagedState, load_state

    path = tmp_path / "c" / "state.json"
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    with pytest.raises(DamagedState) as info:
        load_state(path)
    assert f"the state of cluster 'c' cannot be read ({why})" in str(info.value)


@pytest.mark.parametrize("damage", ["{not json", "[]", '{"roles": [{"name": 3}]}', "\udcff",
                                    '{"name": "broken", "cluster_id": "broken-1", "result": "oops"}'])
def test_a_damaged_state_file_is_named_in_one_line_listed_and_purged_with_what_of_it_runs(
    psctl_env, damage: str
) -> None:
    """A state file cut short (a full disk) or edited by hand: every command that reads it says which file and
    how to clear it, in one line; `ls` and a bare `status` still work for the other clusters; `down` stops the
    processes here that hold files in its folder (its record, with their pids, is lost), keeping its logs and
    saying what it could not know (it stopped nothing before: they ran on); `--purge` removes it too, its
    checkpoints kept."""
    recorded_cluster("good", {"chief-0": 1})
    broken = ClusterDir.named("broken")
    broken.logs.mkdir(parents=True)
    broken.checkpoints.mkdir()
    (broken.checkpoints / "ckpt-1.npz").write_bytes(b"kept")
    broken.state_file.write_bytes(damage.encode("utf-8", errors="surrogateescape"))
    for args in (["status", "broken"], ["logs", "chief-0", "broken"], ["top", "broken"]):
        line = assert_one_line_error(invoke(*args), 1, f"{broken.state_file}: the state of cluster 'broken' "
                                                       "cannot be read (")
        assert line.endswith("(`psctl down --purge broken` stops what of it runs on this machine and removes "
                             "it)"), line
    listed = check_ok(invoke("ls"))
    assert [line.split()[:2] for line in listed.stdout.splitlines()[1:]] == [["good", "succeeded"],
                                                                             ["broken", "damaged"]]
    assert listed.stderr.startswith(f"warning: {broken.state_file}: the state"), listed.stderr
    assert [(c["name"], c["state"]) for c in json.loads(check_ok(invoke("ls", "--json")).stdout)] == [
        ("good", "succeeded"), ("broken", "damaged")]
    # a bare command: the damaged cluster may be running, so it is not passed over for the finished one
    assert_one_line_error(invoke("status"), 1, f"{broken.state_file}: the state of cluster 'broken'")

    roles: list[subprocess.Popen[Any]] = []

    def a_role() -> subprocess.Popen[bytes]:  # a role of it, still writing its log
        with open(broken.logs / "chief-0.1.log", "ab") as log:
            roles.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=log,
                                          start_new_session=True))
        return roles[-1]

    try:
        role = a_role()
        # someone reading its log (`tail -f`): no process of it, not to be stopped
        reader = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print('open', "
                                   "flush=True); time.sleep(120)", str(broken.logs / "chief-0.1.log")],
                                  stdout=subprocess.PIPE, text=True)
        roles.append(reader)  # (stopped by the finally)
        assert reader.stdout is not None and reader.stdout.readline() == "open\n"
        stopped = invoke("down", "broken", "--grace", "2")
        assert stopped.exit_code == 0, (stopped.stdout, stopped.stderr)
        assert f"cluster 'broken': stopped 1 process(es); no process of it is left; logs kept in {broken.logs}" \
            in flat(stopped.stdout)
        assert flat(stopped.stderr).startswith(f"warning: {broken.state_file}: the state of cluster 'broken' cannot "
                                               "be read (") and flat(stopped.stderr).endswith(
            "only this machine was looked at; `psctl down --purge broken` removes it"), stopped.stderr
        assert role.wait(timeout=10) is not None and (broken.logs / "chief-0.1.log").is_file()
        assert reader.poll() is None, "down stopped a process that only read the cluster's log"
        role = a_role()
        done = check_ok(invoke("down", "broken", "--purge", "--grace", "2"))
        assert "cluster 'broken': stopped 1 process(es); no process of it is left" in flat(done.stdout)
        assert f"checkpoints kept in {broken.checkpoints} (a later `up` of 'broken'" in flat(done.stdout)
        assert role.wait(timeout=10) is not None
        assert sorted(p.name for p in broken.root.rglob("*")) == ["checkpoints", "ckpt-1.npz"]
        assert check_ok(invoke("status", "good"))
    finally:
        for role in roles:
            if role.poll() is None:
                role.kill()
                role.wait()
            if role.stdout is not None:  # (the reader's pipe: left open, a later test would hear of it)
                role.stdout.close()


def test_down_purge_says_where_it_kept_the_checkpoints_a_later_up_resumes_from(psctl_env) -> None:
    """`down --purge` said "logs and state deleted" and nothing of the checkpoints it keeps, from which a later `up`
    of the name resumes ("nothing to train"); it names their folder, and says nothing of one that holds none."""
    kept = recorded_cluster("kept", {"chief-0": 1})
    kept.checkpoints.mkdir()
    (kept.checkpoints / "ckpt-50").mkdir()
    said = flat(check_ok(invoke("down", "kept", "--purge")).stdout)
    assert said == (f"cluster 'kept': nothing was running; no process of it is left; logs and state deleted; "
                    f"checkpoints kept in {kept.checkpoints} (a later `up` of 'kept' resumes from them; delete that "
                    "folder to start afresh)"), said
    assert [p.name for p in kept.root.iterdir()] == ["checkpoints"]
    recorded_cluster("none", {"chief-0": 1}).checkpoints.mkdir()  # (an empty folder: no checkpoint to resume)
    said = flat(check_ok(invoke("down", "none", "--purge")).stdout)
    assert said.endswith("logs and state deleted") and "checkpoints" not in said, said


# in-process, the supervisor is this process's child, whose Popen `up` drops as it returns: Python warns of a child
# still running, which here is the point
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_new_run_of_a_name_waits_for_the_last_run_s_supervisor_to_end(
    psctl_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last run's supervisor, still ending as `up` of the same name began, saved its record over the new
    run's: the new `up` printed the last run's result and exited 0 (and the new supervisor found the lock held)."""
    from psctl import operations

    spec = psctl_env.write_spec("again", ps=1, workers=1)
    cdir = recorded_cluster("again", {"chief-0": 1})  # a run that finished...
    held: list[int | None] = [take_supervision(cdir)]  # ...whose supervisor still runs

    def end() -> None:
        if held:
            release(held.pop())

    ended = threading.Timer(0.5, end)  # it ends while the second `up` below waits
    try:
        monkeypatch.setattr(operations, "LAST_SUPERVISOR_WAIT", 0.5, raising=False)
        line = assert_one_line_error(invoke("up", str(spec), "--detach"), EXIT_USAGE,
                                     "the supervisor of cluster 'again''s last run still runs (waited 0.5s")
        assert "psctl down again" in line
        assert load_state(cdir.state_file).state == ClusterState.SUCCEEDED and not cdir.history.exists()
        monkeypatch.setattr(operations, "LAST_SUPERVISOR_WAIT", 30.0, raising=False)
        ended.start()
        started = invoke("up", str(spec), "--detach")
    finally:
        ended.cancel()
        if ended.ident is not None:
            ended.join()
        end()

    assert started.exit_code == 0, (started.stdout, started.stderr)
    assert load_state(cdir.state_file).cluster_id != "again-0000"  # the new run's record, kept as it saved it
    assert [run.name for run in cdir.kept_runs()] == ["1"]


def test_up_says_in_one_line_that_psctl_home_cannot_hold_a_cluster(psctl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = psctl_env.write_spec("homeless", ps=1, workers=1)
    home = psctl_env.tmp_path / "a-file"
    home.write_text("")
    monkeypatch.setenv("PSCTL_HOME", str(home))
    line = assert_one_line_error(invoke("up", str(spec), "--detach"), EXIT_USAGE, f"cannot create {home}/homeless")
    assert line.endswith(f"(set PSCTL_HOME (now {home}) to a folder you can write)"), line


@pytest.mark.parametrize(("args", "expected"), [
    (["logs", "chief-0", "--tail", "-1"], "Invalid value for '--tail' / '-n': -1 is not in the range x>=0 "
                                          "(see `psctl logs --help`)"),
    (["logs", "chief-0", "--attempt", "0"], "Invalid value for '--attempt': 0 is not in the range x>=1"),
    (["events", "-n", "-1"], "Invalid value for '--tail' / '-n': -1 is not in the range x>=0"),
    (["down", "--grace", "-5"], "Invalid value for '--grace': -5.0 is not in the range x>=0 "
                                "(see `psctl down --help`)"),
    (["top", "--interval", "0"], "Invalid value for '--interval': 0.0 is not in the range x>0"),
    (["up", "--bogus", "x.yaml"], "No such option '--bogus' (see `psctl up --help`)"),
    (["export", "-o"], "Option '-o' requires an argument (see `psctl export --help`)"),  # (it named `psctl`)
    (["validate"], "Missing argument 'SPEC' (see `psctl validate --help`)"),
    (["nosuch"], "No such command 'nosuch' (see `psctl --help`)"),
    (["--bogus", "ls"], "No such option '--bogus' (see `psctl --help`)"),
    (["validate", "x.yaml", "--debug"], "--debug is psctl's option: give it before the command (psctl --debug "
                                        "validate ...)"),
])
def test_a_usage_error_is_one_line_with_exit_code_2(psctl_env, args: list[str], expected: str) -> None:
    """Click's own form is four lines (usage, a hint, a blank line, the error); psctl's is one, like its others."""
    assert_one_line_error(invoke(*args), EXIT_USAGE, expected)


def test_a_new_run_of_a_name_keeps_the_last_ones_files_and_drops_its_requests(tmp_path: Path) -> None:
    """Each `up` of a name keeps the run before under history/N (the KEPT_RUNS newest), where it used to delete
    its logs, metrics, events and result; its checkpoints stay for the new run, its requests go."""
    cdir = ClusterDir(tmp_path / "digits")
    (cdir.root / "checkpoints" / "ckpt-000000000100").mkdir(parents=True)
    for run in range(1, KEPT_RUNS + 3):
        cdir.create()
        (cdir.logs / "chief-0.1.log").write_text(f"run {run}\n")
        (cdir.run_dir / "result.json").write_text(json.dumps({"run": run}))
        for path in (cdir.events_file, cdir.supervisor_log, cdir.state_file, cdir.spec_file, cdir.stop_request):
            path.write_text(f"{run}\n")
        kept = cdir.keep_last_run()
        assert kept == cdir.history / str(run)
        assert json.loads((kept / "run" / "result.json").read_text()) == {"run": run}
        assert (kept / "logs" / "chief-0.1.log").read_text() == f"run {run}\n"
        assert all((kept / p.name).read_text() == f"{run}\n" for p in (cdir.events_file, cdir.state_file))
        assert not cdir.logs.exists() and not cdir.run_dir.exists() and not cdir.stop_request.exists()
        assert cdir.state_file.is_file()  # (copied: it stands for the cluster until the new run's replaces it)
    assert [p.name for p in cdir.kept_runs()] == [str(n) for n in range(3, KEPT_RUNS + 3)]
    assert (cdir.history.stat().st_mode & 0o777) == 0o700
    assert (cdir.root / "checkpoints" / "ckpt-000000000100").is_dir()
    # an `up` that found nothing to train takes no place: it pushed out a run that trained (and its lone metrics
    # record cut the curves `psctl plot` continues)
    def chief_attempts(attempts: int) -> None:
        role = RoleRecord("chief-0", "chief", 0, "localhost", "127.0.0.1", 7000, attempt=attempts)
        save_state(cdir.state_file, ClusterRecord(name="digits", cluster_id="digits-1", roles=[role]))

    for _ in range(KEPT_RUNS + 1):
        cdir.create()
        (cdir.logs / "chief-0.1.log").write_text("nothing to train\n")
        (cdir.run_dir / "result.json").write_text(json.dumps({"global_step": 100, "steps_this_run": 0}))
        cdir.events_file.write_text("{}\n")
        chief_attempts(1)
        assert cdir.keep_last_run() is None
        assert not cdir.logs.exists() and not cdir.run_dir.exists() and not cdir.events_file.exists()
    assert [p.name for p in cdir.kept_runs()] == [str(n) for n in range(3, KEPT_RUNS + 3)]
    # a run whose chief, restarted at its end, trained nothing itself is a run that trained: kept
    cdir.create()
    (cdir.run_dir / "result.json").write_text(json.dumps({"global_step": 100, "steps_this_run": 0}))
    chief_attempts(2)
    assert cdir.keep_last_run() == cdir.history / str(KEPT_RUNS + 3)


def test_an_empty_psctl_home_is_the_default_not_the_current_folder(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`PSCTL_HOME= psctl up ...` ran the cluster in ./NAME of whatever folder it was started from."""
    from psctl.home import psctl_home

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    monkeypatch.setenv("PSCTL_HOME", "")
    assert psctl_home() == tmp_path / ".psctl"

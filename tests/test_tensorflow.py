"""Real TensorFlow programs under psctl (training.framework: tensorflow): the examples of cluster_examples/,
unmodified, run by the installed ``psctl``; faults injected with SIGKILL. TensorFlow comes with the
``tensorflow`` extra; without it these tests skip, except in CI, where they fail."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import wait_until
from conftest import PsctlEnv
from supervised_cluster import SupervisedCluster, sigkill

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "cluster_examples"
#: The TF2 example trained long enough for a fault in the middle.
LONGER = {"--steps 300": "--steps 2000", "steps: 300": "steps: 2000"}


def tensorflow_or_skip() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        if os.environ.get("CI"):
            pytest.fail("tensorflow is missing: the test command installs it (pip install -e '.[test,tensorflow]')")
        pytest.skip("tensorflow is not installed (pip install -e '.[tensorflow]')")


def example(penv: PsctlEnv, name: str, spec_file: str, **replace: str) -> SupervisedCluster:
    """The example spec (text replaced as given) beside a copy of the example programs."""
    shutil.copytree(EXAMPLES / "tensorflow", penv.tmp_path / "tensorflow", dirs_exist_ok=True)
    text = (EXAMPLES / spec_file).read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return SupervisedCluster(penv, name, text.replace(f"name: {spec_file.split('.')[0].replace('_', '')}",
                                                      f"name: {name}"))


def chief_log(cluster: SupervisedCluster) -> str:
    return cluster.log("chief-0")


def steps_printed(text: str, who: str = "chief") -> list[int]:
    return [int(s) for s in re.findall(rf"{who}: step (\d+)", text)]


# -- spec errors (no TensorFlow needed) ------------------------------------------------------------------------
def test_spec_mistakes_of_a_tensorflow_program_are_one_line_errors(psctl_env: PsctlEnv) -> None:
    folder = psctl_env.tmp_path
    (folder / "train.py").write_text("print('hi')\n")
    cases = {
        'command: "python train.py --at {nowhere}"': "training.command: unknown placeholder {nowhere}; use one of",
        'command: "python missing.py"': "training.command: script 'missing.py' not found in",
        'command: "python train.py \'unclosed"': "training.command: cannot split",
    }
    for command, message in cases.items():
        spec = folder / "bad.yaml"
        spec.write_text(f"roles: {{chief: {{}}, ps: {{}}, worker: {{}}}}\ntraining:\n  framework: tensorflow\n"
                        f"  {command}\n")
        done = psctl_env.run("validate", str(spec))
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) <= 2 and f"bad.yaml:4: {message}" in lines[0], (command, done.stderr)
    spec = folder / "mixed.yaml"  # a key of psctl's runtime: its fix reads as one (it read "remove program: the...")
    spec.write_text("roles: {chief: {}, ps: {}, worker: {}}\ntraining: {framework: tensorflow, command: "
                    "'python train.py'}\n")
    done = psctl_env.run("validate", str(spec), "--set", "training.program=psctl.models.mlp")
    assert done.returncode == 2 and done.stderr.startswith(
        "error: --set training.program=psctl.models.mlp: training.program: is for psctl's own runtime, not used "
        "with training.framework: tensorflow; remove program (the program's own flags say how it trains)"
    ), done.stderr
    # psctl's checkpoint schedule is not the program's (it was accepted and did nothing): only its folder is
    checkpoint = psctl_env.run("validate", str(spec), "--set", "training.checkpoint={dir: ck, every_steps: 7}")
    assert checkpoint.returncode == 2 and "training.checkpoint.every_steps: is for psctl's own runtime" in " ".join(
        checkpoint.stderr.split()), checkpoint.stderr
    assert psctl_env.run("validate", str(spec), "--set", "training.checkpoint={dir: ck}").returncode == 0
    spec = folder / "own.yaml"
    spec.write_text("roles: {chief: {}, ps: {command: 'python train.py'}, worker: {}}\n"
                    "training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}\n")
    done = psctl_env.run("validate", str(spec))
    assert done.returncode == 2 and "roles.ps.command: only used with training.framework: tensorflow" in done.stderr


@pytest.mark.tensorflow
def test_validate_check_and_a_dry_run_find_a_command_missing_here_and_name_the_set_that_gave_it(
        psctl_env: PsctlEnv) -> None:
    tensorflow_or_skip()
    folder = psctl_env.tmp_path
    spec = folder / "tf.yaml"
    spec.write_text("roles: {chief: {}, ps: {}, worker: {}}\ntraining: {framework: tensorflow, command: "
                    "'python train.py'}\n")
    (folder / "train.py").write_text("print('hi')\n")
    for command in (("validate",), ("check",), ("up", "--dry-run")):  # (validate let it through)
        done = psctl_env.run(*command, str(spec), "--set", "training.command=nosuchprog --x")
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert done.stderr.strip() == ("error: --set training.command=nosuchprog --x: training.command: 'nosuchprog' "
                                       "not found on this machine (PATH) (give its full path, or install it)"), command
    # a relative path is from the spec's folder, where the roles start it, whatever folder psctl runs in (it was
    # looked for from the caller's: the same spec valid or not by where one stood)
    script = folder / "run.sh"
    script.write_text("#!/bin/sh\nexec python3 train.py\n")
    script.chmod(0o755)
    assert psctl_env.run("validate", str(spec), "--set", "training.command=./run.sh").returncode == 0  # (cwd: repo)
    script.chmod(0o644)
    done = psctl_env.run("validate", str(spec), "--set", "training.command=./run.sh")
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: --set training.command=./run.sh: training.command: './run.sh' is not an executable file "
        f"({folder}/run.sh) (a relative path is from the spec's folder; chmod +x it, or start it with python)"
    ), done.stderr


# -- the programs ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.tensorflow
def test_tf2_parameter_server_strategy_trains_to_completion_and_down_leaves_nothing(psctl_env: PsctlEnv) -> None:
    tensorflow_or_skip()
    cluster = example(psctl_env, "tf2done", "tf2_pss.yaml")
    cluster_id = cluster.up()
    tf_config = wait_until(lambda: _environment(psctl_env, cluster_id, "evaluator-0"), timeout=60,
                           what="the evaluator's environment")
    # TensorFlow's format: the evaluator names itself as the task, outside the cluster
    assert '"task": {"type": "evaluator", "index": 0}' in tf_config and '"evaluator"' not in tf_config.split(
        '"task"')[0], tf_config
    state = cluster.wait_finished(240)
    assert {r["name"]: r["state"] for r in state["roles"]}["chief-0"] == "succeeded"
    log = chief_log(cluster)
    assert "chief: finished at step 300" in log, log[-2000:]
    assert "evaluator: step 300 eval loss" in cluster.log("evaluator-0")
    assert cluster.role("chief-0")["global_step"] == 300  # read from what the chief printed
    assert cluster.state()["framework"] == "tensorflow"  # (status shows "-" for a worker's steps it never printed)
    # psctl's metrics and checkpoints are its runtime's: for a program of its own, say what to use instead
    export = psctl_env.run("export", cluster.name, "-o", str(psctl_env.tmp_path / "m.npz"))
    assert export.returncode == 2 and "runs a TensorFlow program, which writes TensorFlow checkpoints, not " \
        "psctl's (use tf.train.Checkpoint" in export.stderr, export.stderr
    plot = psctl_env.run("plot", cluster.name, "-o", str(psctl_env.tmp_path / "c.png"))
    assert plot.returncode == 2 and "which writes no psctl metrics to plot" in plot.stderr, plot.stderr
    down = psctl_env.run("down", cluster.name)
    assert down.returncode == 0, down.stderr
    assert psctl_env.processes(cluster_id) == []


@pytest.mark.slow
@pytest.mark.tensorflow
def test_tf2_a_preempted_worker_is_restarted_alone_and_a_killed_ps_with_the_chief_which_resumes(
        psctl_env: PsctlEnv) -> None:
    """A preemption's SIGTERM to a worker (psctl's TensorFlow server, under its keeper): it leaves at once with
    the preempted code (blocked in TensorFlow's join it used to ignore the signal until SIGKILL) and is
    restarted, uncounted, and TensorFlow's coordinator re-runs the lost closures (the chief is not restarted).
    Then a ps killed outright: it restarts with the chief, which resumes from its checkpoint, and training
    finishes. (One cluster for both: TensorFlow's clusters take ~10 s to start on 2 cores.)"""
    tensorflow_or_skip()
    cluster = example(psctl_env, "tf2faults", "tf2_pss.yaml", **LONGER)
    cluster.up()
    wait_until(lambda: max(steps_printed(chief_log(cluster)), default=0) >= 200, timeout=180,
               what="the chief to pass step 200", detail=cluster.describe)
    cluster.process("worker-1").send_signal(signal.SIGTERM)
    wait_until(lambda: cluster.role("worker-1")["attempt"] == 2, timeout=30, what="worker-1's restart",
               detail=cluster.describe)
    preempted_at = max(steps_printed(chief_log(cluster)))
    wait_until(lambda: max(steps_printed(chief_log(cluster))) >= preempted_at + 200, timeout=180,
               what="the chief to train on after the preemption", detail=cluster.describe)
    assert cluster.role("chief-0")["attempt"] == 1  # TensorFlow's coordinator re-ran the lost closures itself
    lost = [e["reason"] for e in cluster.events("worker-1") if e["to"] == "lost"]
    assert lost and lost[0].startswith("preempted"), lost

    sigkill(cluster.process("ps-0"))
    cluster.wait_finished(300)
    first = (cluster.root / "logs" / "chief-0.1.log").read_text()
    # (a later chief can fail once more while TensorFlow's servers still reconnect to the new ps)
    last = cluster.role("chief-0")["attempt"]
    later = "\n".join((cluster.root / "logs" / f"chief-0.{a}.log").read_text() for a in range(2, last + 1))
    killed_after = max(steps_printed(first))
    resumed = re.search(r"chief: starting at step (\d+) \(restored", later)
    assert resumed is not None, later[-3000:]
    assert int(resumed[1]) >= max(preempted_at + 150, killed_after - 50), (resumed[1], preempted_at, killed_after)
    assert "chief: finished at step 2000" in later
    assert cluster.role("ps-0")["attempt"] >= 2 and cluster.role("chief-0")["attempt"] >= 2
    chief_lost = [e["reason"] for e in cluster.events("chief-0") if e["to"] == "lost"]
    assert chief_lost and chief_lost[0].startswith("restarted with ps-0"), chief_lost


@pytest.mark.slow
@pytest.mark.tensorflow
def test_tf2_the_agent_killed_its_successor_adopts_the_programs_and_nothing_restarts(psctl_env: PsctlEnv) -> None:
    """The host's agent dies mid-training: TensorFlow's programs run on (each under its keeper, which leaves its
    exit code), the next agent adopts them, and training ends with no role restarted (a ps restarted would have
    cost the chief's restart from its last checkpoint), the chief's exit 0 read from its keeper's exit file."""
    tensorflow_or_skip()
    cluster = example(psctl_env, "tf2agent", "tf2_pss.yaml", **{"--steps 300": "--steps 1000",
                                                                  "steps: 300": "steps: 1000"})
    cluster_id = cluster.up()
    wait_until(lambda: max(steps_printed(chief_log(cluster)), default=0) >= 200, timeout=180,
               what="the chief to pass step 200", detail=cluster.describe)
    roles = ("chief-0", "ps-0", "worker-0", "worker-1")
    pids = {role: cluster.process(role).pid for role in roles}
    agents = [p for p in psctl_env.processes(cluster_id) if "psctl.agent" in " ".join(p.cmdline())
              and "psctl.agent.keeper" not in " ".join(p.cmdline())]
    assert len(agents) == 1, psctl_env.describe(agents)
    sigkill(agents[0])
    cluster.wait_finished(300)
    assert "chief: finished at step 1000" in chief_log(cluster), chief_log(cluster)[-2000:]
    for role in roles:  # the same processes, on their first attempt
        record = cluster.role(role)
        assert (record["pid"], record["attempt"], record["restarts"]) == (pids[role], 1, 0), cluster.describe()
    assert {r["name"]: r["state"] for r in cluster.state()["roles"]}["chief-0"] == "succeeded"
    assert not [e for e in cluster.events() if e["to"] in ("lost", "restarting")], cluster.describe()


@pytest.mark.slow
@pytest.mark.tensorflow
def test_tf1_sync_replicas_script_finishes_with_the_configured_global_step(psctl_env: PsctlEnv) -> None:
    tensorflow_or_skip()
    cluster = example(psctl_env, "tf1", "tf1_sync.yaml")
    cluster_id = cluster.up()
    cluster.wait_finished(240)
    log = chief_log(cluster)
    assert "chief:0: finished at step 200" in log, log[-2000:]
    # The workers ran, and joined the session (a TF1 worker's session polls for the chief's every 30 s: a
    # short run can end before they push, the chief's gradients then fill each step, as TensorFlow allows)
    for worker in ("worker-0", "worker-1"):
        assert [e for e in cluster.events(worker) if e["to"] == "running"], cluster.describe()
    assert psctl_env.run("down", cluster.name).returncode == 0
    assert psctl_env.processes(cluster_id) == []


def _environment(penv: PsctlEnv, cluster_id: str, role: str) -> str | None:
    """The TF_CONFIG of ``role``'s process, read from /proc."""
    for proc in penv.processes(cluster_id):
        try:
            env: dict[str, Any] = proc.environ()
        except Exception:
            continue
        if env.get("PSCTL_ROLE") == role:
            return str(env.get("TF_CONFIG"))
    return None


def test_the_examples_are_valid_specs(psctl_env: PsctlEnv) -> None:
    for spec in ("tf2_pss.yaml", "tf1_sync.yaml"):
        done = psctl_env.run("validate", str(EXAMPLES / spec))
        assert done.returncode == 0, done.stderr


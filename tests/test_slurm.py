"""``backend: slurm`` against a real Slurm (tests/slurmbed.py: munged, slurmctld and slurmd on this machine):
the digits MLP trains through one job whose roles are job steps; a cancelled step and a killed worker come
back as new steps; a requeued job resumes from its checkpoint at the exact step; ``down`` leaves no job and
no process; what Slurm refuses is one line."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_helpers import wait_until
from conftest import Hold, PsctlEnv
from slurmbed import SlurmBed, slurmbed_fixture

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RUN_TIMEOUT = 180.0
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmBed]:
    yield from slurmbed_fixture(tmp_path_factory)


@pytest.fixture
def penv(psctl_env: PsctlEnv, slurm: SlurmBed) -> PsctlEnv:
    psctl_env.env.update(slurm.env)
    return psctl_env


def write_spec(penv: PsctlEnv, name: str, *, steps: int, slurm: str = "{partition: debug, time: '00:10:00'}",
               program: str = "psctl.models.mlp") -> Path:
    path = penv.tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: {name}
        backend: slurm
        slurm: {slurm}
        roles:
          chief: {{port: 7400}}
          ps: {{replicas: 2, port: 7410}}
          worker: {{replicas: 2, port: 7420, restart: {{backoff_seconds: 0.5}}}}
          evaluator: {{port: 7430}}
        training:
          program: {program}
          args: {{hidden_units: 64}}
          data: {{name: digits}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.01}}
          steps: {steps}
          log_every_seconds: 0.2s
          checkpoint: {{every_steps: 1000}}
        supervision: {{heartbeat_interval: 0.5s, heartbeat_timeout: 5s}}
        """))
    return path


def status(penv: PsctlEnv, name: str) -> dict[str, Any]:
    done = penv.run("status", name, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def up(penv: PsctlEnv, spec: Path) -> str:
    done = penv.run("up", "--detach", str(spec), timeout=120)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    job = (penv.home / spec.stem / "slurm-job-id").read_text().strip()
    penv.state(spec.stem)  # the fixture's teardown hunts this cluster's processes
    return job


def training(penv: PsctlEnv, name: str, at_least: int) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        s = status(penv, name)
        assert s["state"] in ("starting", "running"), s
        return s if s["progress"].get("global_step", 0) >= at_least else None

    return wait_until(reached, timeout=120, what=f"global step {at_least}", detail=lambda: describe(penv, name))


def finished(penv: PsctlEnv, name: str) -> dict[str, Any]:
    done = wait_until(lambda: (s := status(penv, name))["state"] in ("succeeded", "failed", "stopped") and s,
                      timeout=RUN_TIMEOUT, what=f"{name} to finish", detail=lambda: describe(penv, name))
    assert done["state"] == "succeeded", describe(penv, name)
    return done


def describe(penv: PsctlEnv, name: str) -> str:
    root = penv.home / name
    parts = [f"{p.name}: {p.read_text(errors='replace')[-1500:]}" for p in sorted(root.glob("slurm-*.out"))]
    events = root / "events.jsonl"
    if events.exists():
        parts.append("events: " + events.read_text()[-3000:])
    return "\n".join(parts)


def task_process(penv: PsctlEnv, cluster_id: str, role: str) -> psutil.Process:
    """The role's own python process (the job step's task), not the srun that started it."""
    for proc in penv.processes(cluster_id):
        try:
            if proc.environ().get("PSCTL_ROLE") == role and proc.cmdline()[1:3] == ["-m", "psctl.runtime"]:
                return proc
        except psutil.Error:
            continue
    raise AssertionError(f"no process of {role}")


def test_the_digits_mlp_trains_through_one_slurm_job_whose_roles_are_steps(penv: PsctlEnv, slurm: SlurmBed) -> None:
    hold = Hold(penv.tmp_path / "hold")
    spec = write_spec(penv, "sl-train", steps=3000, program=str(hold.program))
    job = up(penv, spec)
    running = training(penv, "sl-train", 100)
    with hold:  # (while the job's steps are looked at: a fast machine ended the training first)
        assert running["slurm"]["job_id"] == job and running["slurm"]["nodes"] == ["localhost"]
        assert {r["name"]: r["node"] for r in running["roles"]} == dict.fromkeys(
            ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "evaluator-0"], "localhost")
        assert set(slurm.steps(job)) >= {"chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "batch"}
        shown = penv.run("status", "sl-train").stdout
        assert f"Slurm job {job} on localhost" in shown and re.search(r"worker-1\s+localhost", shown), shown

    done = finished(penv, "sl-train")
    assert done["result"]["global_step"] == 3000
    assert done["result"]["metrics"]["accuracy"] >= 0.95, done["result"]
    assert wait_until(lambda: job not in slurm.jobs(), timeout=30, what="the job to leave squeue")


def test_a_cancelled_step_and_a_killed_worker_come_back_as_new_steps(penv: PsctlEnv, slurm: SlurmBed) -> None:
    steps = 5000
    hold = Hold(penv.tmp_path / "hold")
    spec = write_spec(penv, "sl-fault", steps=steps, program=str(hold.program))
    job = up(penv, spec)
    training(penv, "sl-fault", 500)
    cluster_id = penv.state("sl-fault")["cluster_id"]

    def back(role: str) -> bool:
        record = penv.role("sl-fault", role)
        return bool(record["attempt"] == 2 and record["state"] == "running" and role in slurm.steps(job))

    with hold:  # (one worker back before the other could train to the end, and the other restart never come)
        first = slurm.steps(job)["worker-1"]
        slurm.run("scancel", first)  # the scheduler (or an admin) ends one role's step
        victim = task_process(penv, cluster_id, "worker-0")
        victim.kill()
        for role in ("worker-1", "worker-0"):
            wait_until(lambda role=role: back(role), timeout=60, what=f"{role} as a new step",  # type: ignore[misc]
                       detail=lambda: describe(penv, "sl-fault"))
    assert slurm.steps(job)["worker-1"] != first
    lost = {e["role"]: e["reason"] for e in map(json.loads, (penv.home / "sl-fault" / "events.jsonl").read_text()
                                                .splitlines()) if e["to"] == "lost"}
    assert "CANCELLED" in lost["worker-1"] and "worker-0" in lost, lost
    done = finished(penv, "sl-fault")
    result = done["result"]
    assert result["global_step"] == steps and sum(p + 1 for p in result["shard_positions"]) == steps, result
    assert penv.role("sl-fault", "chief-0")["attempt"] == 1


def test_an_agent_killed_in_the_job_is_replaced_and_its_successor_adopts_the_roles_steps(
        penv: PsctlEnv, slurm: SlurmBed) -> None:
    """The job's agent is SIGKILLed mid-training: the supervisor starts another in the job, which adopts the
    roles' steps the first left (their sruns, not the steps' tasks, which carry the same environment): the same
    processes run on, no role restarted, no ps restored, exact step count."""
    steps = 5000
    spec = write_spec(penv, "sl-agent", steps=steps)
    job = up(penv, spec)
    before = training(penv, "sl-agent", 500)
    cluster_id = penv.state("sl-agent")["cluster_id"]
    assert set(slurm.steps(job)) >= {"chief-0", "ps-0", "ps-1", "worker-0", "worker-1"}
    agents = [p for p in penv.processes(cluster_id) if p.cmdline()[1:3] == ["-m", "psctl.agent"]]
    assert len(agents) == 1, penv.describe(agents)
    agents[0].kill()

    def successor() -> bool:
        found = [p for p in penv.processes(cluster_id) if p.cmdline()[1:3] == ["-m", "psctl.agent"]]
        return bool(found) and found[0].pid != agents[0].pid

    wait_until(successor, timeout=60, what="a new agent in the job", detail=lambda: describe(penv, "sl-agent"))
    done = finished(penv, "sl-agent")
    assert done["result"]["global_step"] == steps and done["result"]["ps_restores"] == 0, done["result"]
    pids = {r["name"]: r["pid"] for r in before["roles"]}
    for role in done["roles"]:
        if role["name"] != "evaluator-0":  # (it may have finished on its own)
            assert (role["pid"], role["attempt"], role["restarts"]) == (pids[role["name"]], 1, 0), role


def test_a_requeued_job_resumes_from_its_last_checkpoint_at_the_exact_step(penv: PsctlEnv, slurm: SlurmBed) -> None:
    steps = 5000
    spec = write_spec(penv, "sl-requeue", steps=steps)
    job = up(penv, spec)
    training(penv, "sl-requeue", 500)
    slurm.run("scontrol", "requeue", job)  # what a preemption with requeue, or a failed node, does
    stopped = wait_until(lambda: (s := status(penv, "sl-requeue"))["state"] == "stopped" and s, timeout=60,
                         what="the job's supervisor to stop the roles", detail=lambda: describe(penv, "sl-requeue"))
    assert stopped["reason"] == "stopped by Slurm (preempted, requeued, cancelled or out of time)"
    chief = (penv.home / "sl-requeue" / "logs" / "chief-0.1.log").read_text()
    taken = re.search(r"stopping: checkpoint (\S+) taken at global step (\d+)", chief)
    assert taken is not None, chief[-2000:]

    def released() -> bool:  # a requeued job waits (BeginTime) before it may start again: let it start now
        slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        return bool(status(penv, "sl-requeue")["slurm"].get("restarts") == 1)

    def slurm_view() -> str:  # why Slurm holds it: the job's reason, the node's state (completing, drained...)
        job_info = slurm.run("scontrol", "show", "job", job, check=False).stdout
        node_info = slurm.run("sinfo", "-N", "-l", check=False).stdout
        return f"{describe(penv, 'sl-requeue')}\n{job_info}\n{node_info}"

    # (seen once in a full run: not started again within 60 s on a loaded machine; Slurm's view now says why)
    wait_until(released, timeout=120, interval=1.0, what="the requeued job to start again", detail=slurm_view)
    done = finished(penv, "sl-requeue")
    assert done["result"]["global_step"] == steps
    resumed = (penv.home / "sl-requeue" / "logs" / "chief-0.2.log").read_text()
    assert f"restored {taken[1]} (global step {taken[2]})" in resumed, resumed[:2000]
    assert done["result"]["steps_this_run"] == steps - int(taken[2])  # nothing recomputed, nothing skipped


def test_a_scaled_worker_is_a_new_step_and_down_leaves_no_job_and_no_process(penv: PsctlEnv,
                                                                             slurm: SlurmBed) -> None:
    spec = write_spec(penv, "sl-down", steps=100000)
    spec.write_text(spec.read_text().replace("worker: {replicas: 2,", "worker: {replicas: 2, max_replicas: 3,"))
    job = up(penv, spec)
    training(penv, "sl-down", 200)
    cluster_id = penv.state("sl-down")["cluster_id"]
    scaled = penv.run("scale", "sl-down", "worker=3")
    assert scaled.returncode == 0, scaled.stderr
    wait_until(lambda: "worker-2" in slurm.steps(job) and penv.role("sl-down", "worker-2")["local_step"] > 0,
               timeout=60, what="worker-2 training as a step of the job", detail=lambda: describe(penv, "sl-down"))
    assert penv.role("sl-down", "worker-2")["node"] == "localhost"
    started = time.monotonic()
    done = penv.run("down", "sl-down", timeout=90)
    assert done.returncode == 0, done.stderr
    assert "stopped 7 process(es); no process of it is left" in " ".join(done.stdout.split()), done.stdout
    assert job not in slurm.jobs()
    assert penv.processes(cluster_id) == []
    assert time.monotonic() - started < 30
    state = penv.state("sl-down")
    assert state["state"] == "stopped" and all(r["state"] == "stopped" for r in state["roles"]), state


@pytest.mark.tensorflow
def test_a_tensorflow_program_trains_through_a_slurm_job_and_its_agent_s_death_restarts_nothing(
        penv: PsctlEnv, slurm: SlurmBed) -> None:
    """The TF2 example (ParameterServerStrategy: chief, ps, 2 workers as psctl's TensorFlow servers) as steps of
    one job, on fixed ports; the job's agent SIGKILLed mid-training: its successor adopts the steps' sruns (each
    under its keeper, which leaves its exit code where the cluster's folder is shared), nothing restarts, and
    the chief's exit 0 ends the training."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed (pip install -e '.[tensorflow]')")
    shutil.copytree(REPO / "cluster_examples" / "tensorflow", penv.tmp_path / "tensorflow")
    # its chief held at step 150 while a marker file exists: the agent is killed (and its successor seen) while
    # training runs (a fast machine ended it first)
    hold = penv.tmp_path / "hold"
    program = penv.tmp_path / "tensorflow" / "tf2_pss_train.py"
    loop = "    while (done := int(step.numpy())) < args.steps:\n"
    text = program.read_text()
    assert text.count(loop) == 1, "the example's training loop changed: hold it another way"
    gate = f"        while done >= 150 and os.path.exists({str(hold)!r}):\n            time.sleep(0.1)\n"
    program.write_text(text.replace(loop, loop + gate).replace("import time\n", "import os\nimport time\n"))
    hold.touch()
    spec = penv.tmp_path / "sl-tf.yaml"
    spec.write_text(textwrap.dedent("""\
        name: sl-tf
        backend: slurm
        slurm: {partition: debug, time: '00:10:00'}
        roles:
          chief: {port: 7500}
          ps: {replicas: 1, port: 7510}
          worker: {replicas: 2, port: 7520}
        training:
          framework: tensorflow
          command: "python tensorflow/tf2_pss_train.py --steps 1000 --checkpoint_dir {checkpoint_dir}"
          steps: 1000
        supervision: {heartbeat_interval: 1s, heartbeat_timeout: 10s, startup_grace: 120s}
        """))
    job = up(penv, spec)
    before = training(penv, "sl-tf", 100)
    assert set(slurm.steps(job)) >= {"chief-0", "ps-0", "worker-0", "worker-1"}
    cluster_id = penv.state("sl-tf")["cluster_id"]
    def agents() -> list[psutil.Process]:
        return [p for p in penv.processes(cluster_id) if p.cmdline()[1:3] == ["-m", "psctl.agent"]]

    first = agents()
    assert len(first) == 1, penv.describe(first)
    first[0].kill()
    wait_until(lambda: [p for p in agents() if p.pid != first[0].pid], timeout=60, what="the agent's successor",
               detail=lambda: describe(penv, "sl-tf"))
    hold.unlink()
    done = finished(penv, "sl-tf")
    assert "chief: finished at step 1000" in (penv.home / "sl-tf" / "logs" / "chief-0.1.log").read_text()
    pids = {r["name"]: r["pid"] for r in before["roles"]}
    for role in done["roles"]:
        assert (role["pid"], role["attempt"], role["restarts"]) == (pids[role["name"]], 1, 0), role
    assert wait_until(lambda: job not in slurm.jobs(), timeout=30, what="the job to leave squeue")


@pytest.mark.parametrize(("options", "sets", "code", "message"), [
    ("{partition: nope}", (), 2,
     "{spec}:3: slurm.partition: partition 'nope' does not exist; use one of: debug, short"),
    ("{partition: short, time: '01:00:00'}", (), 2,
     "{spec}:3: slurm.time: 01:00:00 is longer than partition 'short' allows (5:00); ask for less, or pick a "
     "partition with a longer limit"),
    # what Slurm refuses of the spec's options is a spec error too (exit 2), placed where they were written
    ("{partition: debug, sbatch_options: ['--nodes=5']}", (), 2,
     "Slurm queued job {job} but would never start it ({reason}) (change the slurm: options in {spec}:3)"),
    ("{partition: debug}", ("slurm.nodes=5",), 2,
     "Slurm queued job {job} but would never start it ({reason}) (change the slurm: options in {spec}:3 or "
     "--set slurm.nodes=5)"),
    ("{partition: debug, sbatch_options: ['--mem-per-cpu=nonsense']}", (), 2,
     "sbatch refused the job: Invalid --mem-per-cpu specification (change the slurm: options in {spec}:3)"),
])
def test_what_slurm_refuses_is_one_line_and_nothing_runs(penv: PsctlEnv, slurm: SlurmBed, options: str,
                                                          sets: tuple[str, ...], code: int, message: str) -> None:
    spec = write_spec(penv, "sl-bad", steps=100, slurm=options)
    before = slurm.jobs()
    done = penv.run("up", "--detach", str(spec), *(arg for s in sets for arg in ("--set", s)))
    assert done.returncode == code, done.stdout + done.stderr
    job = (penv.home / "sl-bad" / "slurm-job-id").read_text().strip() if "{job}" in message else ""
    reason = re.search(r"\((Partition\w+)\)", done.stderr)  # Slurm settles on one of its words for it
    expected = message.format(spec=spec, job=job, reason=reason[1] if reason else "?")
    assert done.stderr.strip() == "error: " + expected, done.stderr
    assert slurm.jobs() == before  # nothing left queued
    state = penv.state("sl-bad") if penv.state_file("sl-bad").exists() else {"state": "none"}
    assert state["state"] in ("failed", "none"), state


def test_check_of_a_slurm_spec_checks_the_submit_host_not_this_machine_s_ports(penv: PsctlEnv) -> None:
    spec = write_spec(penv, "sl-check", steps=100)
    done = penv.run("check", str(spec))
    assert done.returncode == 0, done.stderr
    assert " ".join(done.stdout.split()) == (f"{spec}: Slurm's commands are here and partition 'debug' exists; the "
                                             "job's nodes are Slurm's to check when it runs")
    wrong = penv.run("check", str(spec), "--set", "slurm.partition=nope")
    assert wrong.returncode == 2 and "slurm.partition: partition 'nope' does not exist" in wrong.stderr, wrong.stderr


def test_without_slurm_commands_up_says_where_to_run_it(psctl_env: PsctlEnv) -> None:
    spec = write_spec(psctl_env, "sl-none", steps=100)
    psctl_env.env["PATH"] = str(Path(psctl_env.env["PATH"].split(":")[0]))  # the venv's bin only: no sbatch
    done = psctl_env.run("up", "--detach", str(spec))
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: backend slurm, but sbatch, squeue, scancel, sinfo not found on this machine "
                                   "(run psctl on a login node of the Slurm cluster (with Slurm's client commands))")


def test_with_slurmctld_not_answering_status_and_ls_still_work_and_down_says_what_to_do(
        psctl_env: PsctlEnv, tmp_path: Path) -> None:
    """Slurm's client commands, real, against a controller that does not answer (nothing listens on its port):
    `status` and `ls` show what the record knows (a running cluster is not called stale), `down` of a running
    cluster says what happened and what to do in one line, and a finished cluster can still be purged."""
    from slurmbed import CONFIG

    from psctl.home import ClusterDir
    from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, save_state

    if shutil.which("squeue") is None:
        pytest.skip("Slurm's client commands are not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text(CONFIG.format(root=tmp_path, ctld_port=1, d_port=2) + "MessageTimeout=1\n")  # (port 1: none)
    psctl_env.env["SLURM_CONF"] = str(conf)
    for name, state, job in (("sl-gone", ClusterState.RUNNING, "4242"), ("sl-done", ClusterState.SUCCEEDED, "4243")):
        cdir = ClusterDir(psctl_env.home / name)
        cdir.create()
        chief = RoleRecord("chief-0", "chief", 0, "localhost", "127.0.0.1", 7400, state=RoleState.RUNNING,
                           node="localhost")
        save_state(cdir.state_file, ClusterRecord(name=name, cluster_id=f"{name}-1", state=state, steps=100,
                                                  roles=[chief], backend="slurm", slurm={"job_id": job}))
    try:
        _status_ls_and_down_without_slurmctld(psctl_env)
    finally:  # (no job runs for it: nothing for the teardown's `down` to stop, which cannot ask Slurm either)
        shutil.rmtree(psctl_env.home / "sl-gone")


def _status_ls_and_down_without_slurmctld(psctl_env: PsctlEnv) -> None:
    shown = psctl_env.run("status", "sl-gone", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["stale"] is False, shown.stderr
    listed = psctl_env.run("ls")
    assert listed.returncode == 0 and "sl-gone" in listed.stdout and "sl-done" in listed.stdout, listed.stderr
    down = psctl_env.run("down", "sl-gone")
    assert down.returncode == 1, down.stdout + down.stderr
    line = " ".join(down.stderr.split())
    assert line.startswith("error: ") and "squeue failed: " in line and "Unable to contact slurm controller" in line
    assert line.endswith("(is slurmctld up? (`scontrol ping` tells); run the command again once it answers)"), line
    purged = psctl_env.run("down", "--purge", "sl-done")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert not (psctl_env.home / "sl-done").exists()

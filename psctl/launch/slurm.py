"""Slurm as a backend: one job per cluster, its roles as job steps.

``psctl up`` submits ONE batch job (:func:`submit`) whose script runs the cluster's supervisor on the first
node of the allocation (``python -m psctl.supervisor CLUSTER_DIR``). The supervisor places the roles on the
allocated nodes (:func:`place`) and starts each as a job step: its agent runs ``srun --overlap -w NODE ...
python -m psctl.runtime`` (:func:`step_argv`), so a role's exit (or its step's cancellation) is seen by the
agent's waitpid on the srun client, and a restart is a new step. The cluster's folder (state, logs, metrics,
checkpoints) must be on a filesystem every node and the submit host share; ``status``, ``logs``, ``events`` and
``export`` read it from there. ``down`` asks the supervisor to stop the roles (SIGTERM to the batch step), then
cancels the job.

Every command Slurm refuses becomes one line naming the key to change (:class:`SlurmRefused`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from psctl.errors import EXIT_USAGE, LaunchError
from psctl.spec.model import SlurmSpec

#: Commands psctl runs on the submit host.
CLIENT_COMMANDS = ("sbatch", "squeue", "scancel", "sinfo")


class SlurmRefused(LaunchError):
    """Slurm refused what the spec's slurm: options ask for (sbatch refused them, or the job they make would
    never start): its words, and where to change them. A spec error: exit 2."""

    exit_code = EXIT_USAGE


class SlurmUnreachable(LaunchError):
    """Slurm's controller did not answer a command (slurmctld down, or cut off from this machine)."""


#: What to do when slurmctld does not answer.
_ASK_AGAIN = "is slurmctld up? (`scontrol ping` tells); run the command again once it answers"


def missing_commands() -> list[str]:
    return [c for c in CLIENT_COMMANDS if shutil.which(c) is None]


def _run(argv: Sequence[str], *, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on this machine: run psctl on a login node of the Slurm "
                          "cluster (where sbatch, squeue and scancel are)") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnreachable(f"{argv[0]} did not answer within {timeout:.0f}s", hint=_ASK_AGAIN) from None


def _said(done: subprocess.CompletedProcess[str]) -> str:
    text = (done.stderr or done.stdout).strip().splitlines()
    words = [line.removeprefix("sbatch: error: ").removeprefix("srun: error: ").strip() for line in text]
    return "; ".join(w for w in words if w) or f"exit code {done.returncode}"


def _failed(command: str, done: subprocess.CompletedProcess[str]) -> LaunchError:
    """The error for a Slurm command that failed: SlurmUnreachable (with what to do) where the controller did not
    answer it."""
    said = _said(done)
    if "contact slurm controller" in said or "Socket timed out" in said:
        return SlurmUnreachable(f"{command} failed: {said}", hint=_ASK_AGAIN)
    return LaunchError(f"{command} failed: {said}")


def partitions() -> dict[str, str]:
    """Every partition Slurm has, with its time limit (``sinfo``'s words, e.g. ``1:00:00`` or ``infinite``)."""
    done = _run(["sinfo", "-h", "-o", "%P %l"])
    if done.returncode != 0:
        raise _failed("sinfo", done)
    out = {}
    for line in done.stdout.splitlines():
        name, _, limit = line.partition(" ")
        out[name.rstrip("*")] = limit.strip()
    return out


def seconds(limit: str) -> float | None:
    """A Slurm time (``90``, ``5:00``, ``1:00:00``, ``2-12``, ``1-00:30:00``) in seconds; None for unlimited."""
    text = limit.strip().lower()
    if text in ("infinite", "unlimited", "none", ""):
        return None
    days = 0
    if "-" in text:
        day, text = text.split("-", 1)
        days = int(day)
        parts = [int(p) for p in text.split(":")]
        parts += [0] * (3 - len(parts))  # days-hours[:minutes[:seconds]]
        hours, minutes, secs = parts
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            hours, minutes, secs = 0, parts[0], 0  # minutes
        elif len(parts) == 2:
            hours, minutes, secs = 0, parts[0], parts[1]  # minutes:seconds
        else:
            hours, minutes, secs = parts
    return float(((days * 24 + hours) * 60 + minutes) * 60 + secs)


#: Why a pending job would wait forever: Slurm keeps it (EnforcePartLimits=NO) instead of refusing it.
NEVER_RUNS = ("PartitionConfig", "PartitionTimeLimit", "PartitionNodeLimit", "InvalidAccount", "InvalidQOS",
              "AccountNotAllowed", "QOSMaxWallDurationPerJobLimit", "BadConstraints")


def sbatch_argv(slurm: SlurmSpec, *, name: str, script: Path, output: Path, workdir: Path,
                tasks: int) -> list[str]:
    """``sbatch`` for the cluster's job: its name, output file, allocation and the spec's options."""
    argv = ["sbatch", "--parsable", f"--job-name=psctl-{name}", f"--output={output}", f"--chdir={workdir}",
            f"--nodes={slurm.nodes}", f"--ntasks-per-node={max(1, -(-tasks // slurm.nodes))}"]
    for key, value in (("partition", slurm.partition), ("account", slurm.account), ("time", slurm.time),
                       ("qos", slurm.qos), ("cpus-per-task", slurm.cpus_per_task)):
        if value:
            argv.append(f"--{key}={value}")
    if slurm.requeue:
        argv.append("--requeue")
    return [*argv, *slurm.sbatch_options, str(script)]


def write_script(path: Path, cluster_dir: Path, *, python: str = sys.executable) -> None:
    """The batch script: the supervisor, in place of the shell (it gets Slurm's signals itself)."""
    path.write_text(
        "#!/bin/sh\n"
        "# Written by `psctl up`: this cluster's supervisor, on the first node of its allocation.\n"
        f"exec {shlex.quote(python)} -m psctl.supervisor {shlex.quote(str(cluster_dir))}\n",
        encoding="utf-8",
    )
    path.chmod(0o700)


def submit(argv: Sequence[str], *, where: str) -> str:
    """Submit; returns the job id. Slurm's refusal is a one-line SlurmRefused that points at ``where``."""
    done = _run(argv)
    if done.returncode != 0:
        raise SlurmRefused(f"sbatch refused the job: {_said(done)}",
                           hint=f"change the slurm: options in {where}")
    job = done.stdout.strip().split(";")[0]
    if not job.isdigit():
        raise LaunchError(f"sbatch answered {done.stdout.strip()!r}, not a job id")
    return job


def job_state(job: str) -> str | None:
    """The job's state as squeue shows it (PENDING, RUNNING, COMPLETING, ...); None once Slurm forgot it."""
    done = _run(["squeue", "-h", "-j", job, "-o", "%T"])
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None
        raise _failed("squeue", done)
    state = done.stdout.strip()
    return state or None


def reason(job: str) -> str:
    """Why a pending job waits (squeue's reason: Resources, Priority, PartitionTimeLimit, ...)."""
    done = _run(["squeue", "-h", "-j", job, "-o", "%r"])
    return done.stdout.strip() if done.returncode == 0 else ""


def cancel(job: str, *, signal: str | None = None, batch_only: bool = False) -> None:
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch_only:
        argv.append("--batch")
    done = _run([*argv, job])
    if done.returncode != 0 and "Invalid job id" not in done.stderr and "already completing" not in done.stderr:
        raise _failed(f"scancel {job}", done)


def wait_gone(job: str, timeout: float) -> bool:
    """Wait (bounded) until Slurm no longer lists the job; True if it is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_state(job) in (None, "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
                              "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
            return True
        time.sleep(0.2)
    return False


# -- inside the allocation ----------------------------------------------------------------------------
def allocated_nodes(env: Mapping[str, str] | None = None) -> list[str]:
    """The job's nodes, in Slurm's order (``scontrol show hostnames`` expands ``n[1-3]``)."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        raise LaunchError("SLURM_JOB_NODELIST is not set: the supervisor of a Slurm cluster runs in its job")
    if not re.search(r"[\[,]", nodelist):
        return [nodelist]
    done = _run(["scontrol", "show", "hostnames", nodelist])
    if done.returncode != 0:
        raise LaunchError(f"scontrol show hostnames {nodelist} failed: {_said(done)}")
    return done.stdout.split()


def place(roles: Sequence[tuple[str, str]], nodes: Sequence[str]) -> dict[str, str]:
    """``{role name: node}``: the chief and the evaluator on the first node (beside the supervisor), each other
    job's replicas round-robin over the nodes, ps from the first node on and workers from the last back, so
    that ps and workers spread out and meet only when there are more roles than nodes."""
    out: dict[str, str] = {}
    count: dict[str, int] = {}
    for name, job in roles:
        index = count.get(job, 0)
        count[job] = index + 1
        out[name] = node_for(job, index, nodes)
    return out


def node_for(job: str, index: int, nodes: Sequence[str]) -> str:
    """Replica ``index`` of ``job``'s node (see :func:`place`; also where ``psctl scale`` adds one)."""
    if job in ("chief", "evaluator"):
        return nodes[0]
    if job == "worker":
        return nodes[len(nodes) - 1 - index % len(nodes)]
    return nodes[index % len(nodes)]


def step_argv(job: str, node: str, name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` as a job step of ``job`` on ``node``, named after the role (``squeue -s`` shows it)."""
    return ["srun", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
            f"--job-name={name}", "--kill-on-bad-exit=1", "--quiet", "--unbuffered", *argv]


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times Slurm requeued the job (``SLURM_RESTART_COUNT``)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0

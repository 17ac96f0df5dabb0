"""A cluster of ``backend: slurm``: ``up`` submits its job, its supervisor prepares the run inside the job, and
``down`` stops the roles and cancels the job (see :mod:`psctl.launch.slurm` for the job's shape)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

from psctl.errors import LaunchError, UsageError
from psctl.home import ClusterDir
from psctl.launch import slurm
from psctl.launch.slurm import SlurmRefused
from psctl.operations import new_cluster_folder
from psctl.runtime.atomic import write_json_atomic
from psctl.spec import ClusterSpec, Plan
from psctl.supervisor.state import (
    ClusterRecord,
    ClusterState,
    RoleState,
    load_state,
    save_state,
)

log = logging.getLogger("psctl.slurm")

#: Job states in which the cluster's job may still run its supervisor.
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
               "REQUEUE_HOLD", "REQUEUE_FED", "STAGE_OUT", "SIGNALING")


def job_id(record: ClusterRecord) -> str | None:
    job = record.slurm.get("job_id")
    if job:
        return str(job)
    with contextlib.suppress(OSError):
        return ClusterDir.named(record.name).slurm_job_file.read_text().strip() or None
    return None


def job_alive(record: ClusterRecord) -> bool:
    """Whether Slurm still has the cluster's job (pending or running): its supervisor runs, or will. Where
    slurmctld does not answer, as the record says (a running cluster's job is taken to run: `status` and `ls`
    still show what is known, and no second supervisor is started beside one that may run)."""
    job = job_id(record)
    if job is None:
        return False
    try:
        return slurm.job_state(job) in LIVE_STATES
    except slurm.SlurmUnreachable:
        return not record.state.terminal


def check_submit_host(spec: ClusterSpec) -> None:
    """Slurm's commands are here and the spec's partition exists: one-line errors before anything is made."""
    missing = slurm.missing_commands()
    if missing:
        raise UsageError(f"backend slurm, but {', '.join(missing)} not found on this machine",
                         hint="run psctl on a login node of the Slurm cluster (with Slurm's client commands)")
    assert spec.slurm is not None
    wanted = spec.slurm.partition
    if not wanted:
        return
    known = slurm.partitions()
    if wanted not in known:
        raise spec.source.error(("slurm", "partition"), f"partition {wanted!r} does not exist",
                                f"use one of: {', '.join(sorted(known))}")
    asked = slurm.seconds(spec.slurm.time) if spec.slurm.time else None
    allowed = slurm.seconds(known[wanted])
    if asked is not None and allowed is not None and asked > allowed:
        raise spec.source.error(("slurm", "time"), f"{spec.slurm.time} is longer than partition {wanted!r} allows "
                                f"({known[wanted]})", "ask for less, or pick a partition with a longer limit")


def slurm_options_where(spec: ClusterSpec) -> str:
    """Where the spec's slurm: options were written: the file's ``slurm:`` line, and each ``--set`` of one."""
    source = spec.source
    sets = [f"--set {text}" for path, text in source.overrides.items() if path[:1] == ("slurm",)]
    in_file = [f"{source.filename}:{source.line(('slurm',), key=True)}"] if ("slurm",) in source.key_lines else []
    return " or ".join(in_file + sets)


def submit_cluster(spec: ClusterSpec, plan: Plan, *, wait_started: float = 30.0) -> ClusterDir:
    """Write the cluster's folder (on the filesystem the nodes share) and submit its job. Returns once its
    supervisor runs the roles, or (the job still waits for nodes) after ``wait_started`` seconds."""
    check_submit_host(spec)
    assert spec.slurm is not None
    cdir = ClusterDir.named(spec.name)
    if cdir.state_file.is_file():
        cdir.keep_last_run()
    record = new_cluster_folder(cdir, spec, plan)
    save_state(cdir.state_file, record)  # before sbatch: the job may start at once and read it
    script = cdir.root / "slurm-job.sh"
    slurm.write_script(script, cdir.root)
    argv = slurm.sbatch_argv(
        spec.slurm, name=spec.name, script=script, output=cdir.root / "slurm-%j.out",
        workdir=spec.path.parent if spec.path else cdir.root, tasks=len(plan.instances),
    )
    where = slurm_options_where(spec)
    try:
        job = slurm.submit(argv, where=where)
    except LaunchError:
        shutil.rmtree(cdir.tls_dir, ignore_errors=True)
        record.state, record.reason = ClusterState.FAILED, "sbatch refused the job"
        save_state(cdir.state_file, record)
        raise
    cdir.slurm_job_file.write_text(job + "\n")
    deadline = time.monotonic() + wait_started
    #: A reason the job would never start, and since when Slurm has given it (it settles within a second).
    never: tuple[str, float] | None = None
    while time.monotonic() < deadline:
        current = load_state(cdir.state_file)
        if current.state.terminal or (current.supervisor_pid and all(r.state != RoleState.PENDING
                                                                     for r in current.roles)):
            break
        state = slurm.job_state(job)
        if state not in LIVE_STATES:
            raise LaunchError(f"Slurm job {job} ended before its supervisor started",
                              hint=f"see {cdir.root / f'slurm-{job}.out'}")
        waits = slurm.reason(job) if state == "PENDING" else ""
        if waits not in slurm.NEVER_RUNS:
            never = None
        elif never is None or never[0] != waits:
            never = (waits, time.monotonic())
        if never is not None and time.monotonic() - never[1] > 2.0:
            # accepted, but it would wait forever: say so and leave nothing queued
            slurm.cancel(job)
            slurm.wait_gone(job, 10.0)
            record = load_state(cdir.state_file)
            record.state, record.reason = ClusterState.FAILED, f"Slurm would never start job {job} ({waits})"
            save_state(cdir.state_file, record)
            raise SlurmRefused(f"Slurm queued job {job} but would never start it ({waits})",
                               hint=f"change the slurm: options in {where}")
        time.sleep(0.2)
    return cdir


def prepare_run(record: ClusterRecord, env: dict[str, str] | None = None) -> None:
    """In the job, before the supervisor runs: the job's id and nodes, each role's node (its address); a
    requeued job (Slurm's restart count went up) starts every role again, and the chief resumes from the
    latest checkpoint."""
    env = dict(os.environ) if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    restarts = slurm.restart_count(env)
    nodes = slurm.allocated_nodes(env)
    requeued = bool(record.slurm) and record.state != ClusterState.SUCCEEDED and (
        record.slurm.get("job_id") != job or record.slurm.get("restarts") != restarts or record.state.terminal)
    if requeued:
        record.state, record.reason, record.result = ClusterState.STARTING, "requeued by Slurm", None
        record.agents, record.supervisor_address = {}, None
        for role in record.roles:
            if not role.retired:
                role.state, role.reason, role.pid, role.exit_code = RoleState.PENDING, "requeued by Slurm", None, None
    record.slurm = {"job_id": job, "restarts": restarts, "nodes": nodes}
    where = slurm.place([(r.name, r.role) for r in record.roles], nodes)
    for role in record.roles:
        role.node = where[role.name]
        role.address = role.node


def stop_job(cdir: ClusterDir, record: ClusterRecord, *, grace: float) -> int:
    """``psctl down``: the supervisor stops the roles (SIGTERM to the batch step, with the grace asked for), then
    the job is cancelled; returns how many roles were running. A LaunchError if Slurm still lists the job."""
    job = job_id(record)
    if job is None:
        return 0
    running = sum(1 for r in record.roles if not r.state.terminal and r.pid)
    try:
        state = slurm.job_state(job)
    except slurm.SlurmUnreachable:
        if record.state.terminal:  # its job ended with it (its supervisor runs in it): nothing to stop
            return 0
        raise
    if state == "RUNNING":
        write_json_atomic(cdir.stop_request, {"grace": grace})
        slurm.cancel(job, signal="TERM", batch_only=True)
        slurm.wait_gone(job, grace + 20.0)
    if state is not None:
        slurm.cancel(job)
        if not slurm.wait_gone(job, 30.0):
            raise LaunchError(f"Slurm job {job} of cluster {cdir.name!r} is still listed by squeue "
                              f"({slurm.job_state(job)}) after scancel", hint="run `psctl down` again")
    return running

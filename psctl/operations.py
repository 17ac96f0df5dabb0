"""What the CLI's commands that change a cluster do, without any rendering: bring it up, supervise it again,
tear it down. Finding a cluster and reading its logs is :mod:`psctl.observe`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, cast

import psutil

from psctl.agent.logs import log_tail
from psctl.errors import LaunchError, PsctlError, UsageError
from psctl.home import ClusterDir, exclusive_lock, lock_held, release
from psctl.launch.base import ProcessHandle, Runner, on_their_hosts, sh_path, stop_on_hosts
from psctl.launch.fanout import HostsError, check_results, run_on_all
from psctl.launch.hostset import RemoteHost, host_runners, ssh_runner
from psctl.launch.local import LocalRunner
from psctl.launch.remote import (
    RUNTIME_MODULES,
    SETUP_TIMEOUT,
    TENSORFLOW_MODULES,
    HostDir,
    HostReport,
    preflight,
    prepare_host,
    psctl_bundle,
    remove_files,
    setup_failed,
    staged_files,
    tar_gz,
)
from psctl.observe import recorded_supervisor_runs, supervisor_alive
from psctl.pki import create_cluster_pki
from psctl.runtime.atomic import write_json_atomic
from psctl.spec import ClusterSpec, Plan, load_spec, make_plan
from psctl.spec.plan import LOCAL_ADDRESS, LOCAL_HOST, RoleInstance
from psctl.supervisor.agents import agent_member
from psctl.supervisor.state import (
    ClusterRecord,
    ClusterState,
    DamagedState,
    RoleState,
    keep_spec,
    load_state,
    new_record,
    save_state,
)

if TYPE_CHECKING:
    from psctl.launch.ssh import SSHRunner


def plan_spec(path: str | Path, overrides: Sequence[str] = ()) -> tuple[ClusterSpec, Plan]:
    spec = load_spec(path, overrides)
    return spec, make_plan(spec)


def ssh_runners(spec: ClusterSpec, plan: Plan) -> dict[str, SSHRunner]:
    """A runner for every host the plan puts a role on or a worker may move to (hosts defined but unused are
    left alone)."""
    used = {h for i in plan.instances for h in plan.hosts_of(i)} - {LOCAL_HOST}
    return {h.name: ssh_runner(h) for h in spec.hosts if h.name in used}


def check_hosts(spec: ClusterSpec, plan: Plan, runners: Mapping[str, SSHRunner]) -> dict[str, HostReport]:
    """The preflight on every host at once; PreflightError lists every problem found, one line each."""
    def check(runner: SSHRunner) -> HostReport:
        # The ports of the roles planned here, then those of roles that may move here (a spare host of a pool):
        # a port taken there would fail the move when a restart needs it.
        ports: dict[int, str] = {}
        keys: dict[int, str] = {}
        for instance in sorted(plan.may_run_on(runner.host), key=lambda i: i.host != runner.host):  # planned first
            if instance.port not in ports:
                moves = instance.host != runner.host
                ports[instance.port] = f"{instance.name}, should it move here" if moves else instance.name
                keys[instance.port] = _port_key(spec, instance.role, instance.index)
        modules = RUNTIME_MODULES + (TENSORFLOW_MODULES if spec.training.get("framework") == "tensorflow" else ())
        return preflight(runner, ports, keys, modules=modules)

    results = run_on_all(list(runners.values()), check)
    problems = []
    for name in sorted(results):
        found = results[name]
        if isinstance(found, PsctlError):
            problems.append(found.format_message())
        elif isinstance(found, Exception):
            problems.append(f"host {name}: {type(found).__name__}: {found}")
        else:
            problems += found.problems
    if problems:
        failed = sum(1 for r in results.values() if isinstance(r, Exception) or r.problems)
        raise PreflightError(problems, failed, len(results))
    return {name: r for name, r in results.items() if isinstance(r, HostReport)}


def _port_key(spec: ClusterSpec, role: str, index: int) -> str:
    ports = spec.roles[role].ports
    return f"roles.{role}.ports[{index}]" if ports is not None else f"roles.{role}.port"


class PreflightError(LaunchError):
    """Hosts not ready for the cluster: one line per problem, each naming its host and the fix."""

    def __init__(self, problems: list[str], failed: int, hosts: int) -> None:
        self.problems = problems
        super().__init__("\n".join([f"preflight failed on {failed} of {hosts} hosts:", *problems]))


def prepare_hosts(
    spec: ClusterSpec, plan: Plan, cdir: ClusterDir, runners: Mapping[str, SSHRunner],
    reports: Mapping[str, HostReport],
) -> dict[str, dict[str, Any]]:
    """Copy keys, files and (where needed) psctl to every host and run ``setup:``; returns what the state
    file records of each host. On failure every host's copy of the cluster's files is deleted again."""
    bundle = psctl_bundle() if any(r.copy_psctl for r in reports.values()) else None
    staged = staged_files(spec)
    archive = tar_gz(staged.items()) if staged else None

    def prepare(runner: SSHRunner) -> dict[str, Any]:
        hostdir = HostDir.of(runner.spec.workdir, spec.name)
        tls: dict[str, Path] = {}
        if spec.security.tls:  # the host's agent's own; a role's key comes with its start, where it starts
            agent = agent_member(runner.host)
            tls = {name: cdir.tls_dir / name for name in ("ca.pem", f"{agent}.pem", f"{agent}.key")}
        pythonpath = prepare_host(
            runner, hostdir, tls_files=tls, staged=archive,
            psctl_copy=bundle if reports[runner.host].copy_psctl else None, setup=spec.setup,
        )
        return RemoteHost(runner.spec, str(hostdir.root), pythonpath, reports[runner.host].cpus).to_dict()

    results = run_on_all(list(runners.values()), prepare)
    try:
        return check_results(results)
    except HostsError:
        run_on_all(list(runners.values()), lambda r: remove_files(r, HostDir.of(r.spec.workdir, spec.name)))
        raise


def run_setup_here(spec: ClusterSpec, cdir: ClusterDir) -> None:
    """``setup:`` for a cluster on this machine, as each SSH host runs it: every command once, in the folder the
    roles start in (the spec's), before anything starts; their output goes to ``logs/setup.log``."""
    folder = spec.path.parent if spec.path else cdir.root
    log_path = cdir.logs / "setup.log"
    for i, command in enumerate(spec.setup):
        with open(log_path, "ab") as log:
            os.chmod(log_path, 0o600)
            log.write(f"$ {command}\n".encode())
            log.flush()
            try:
                code = subprocess.run(command, shell=True, cwd=folder, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=SETUP_TIMEOUT).returncode
            except subprocess.TimeoutExpired:
                raise LaunchError(f"{spec.source.where(('setup', i))}: setup[{i}] `{command}` did not finish within "
                                  f"{SETUP_TIMEOUT:.0f}s; "
                                  f"fix the command under setup: (its output: {log_path})") from None
        if code != 0:
            said = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
            last = said[-1] if said and not said[-1].startswith("$ ") else f"exit code {code}"
            raise LaunchError(f"{spec.source.where(('setup', i))}: {setup_failed(i, command, code, last)} (its "
                              f"output: {log_path})")


def bring_up(
    spec: ClusterSpec, plan: Plan, *, wait_started: float = 30.0, warn: Callable[[str], None] | None = None
) -> ClusterDir:
    """Check the hosts, persist the plan, prepare the hosts and start the cluster's supervisor; returns once
    the supervisor is running. ``warn`` gets the preflight's warnings (clock skew)."""
    cdir = ClusterDir.named(spec.name)
    cdir.create()  # (a UsageError naming PSCTL_HOME where it cannot hold a cluster; the lock lies beside it)
    held = exclusive_lock(cdir.up_lock)
    if held is None:
        raise UsageError(f"another `psctl up` of cluster {spec.name!r} is starting it now",
                         hint=f"watch it with `psctl status {spec.name}`")
    try:
        return _bring_up(spec, plan, wait_started=wait_started, warn=warn)
    finally:
        release(held)


def _bring_up(
    spec: ClusterSpec, plan: Plan, *, wait_started: float, warn: Callable[[str], None] | None
) -> ClusterDir:
    refuse_if_up(spec)  # before the preflight: the cluster's own roles would read as ports taken
    if spec.backend == "slurm":
        from psctl.slurm_cluster import submit_cluster

        return submit_cluster(spec, plan, wait_started=wait_started)
    check_local_program(spec, plan)
    runners = ssh_runners(spec, plan)
    try:
        reports = check_hosts(spec, plan, runners)
        for report in reports.values():
            for line in report.warnings:
                if warn is not None:
                    warn(line)
        return _start(spec, plan, runners, reports, wait_started=wait_started)
    finally:
        for runner in runners.values():
            runner.close()


def check_local_program(spec: ClusterSpec, plan: Plan) -> None:
    """A TensorFlow program's roles on this machine: tensorflow importable here, every command's program
    found (SSH hosts are checked by their preflight). A UsageError naming what is missing otherwise."""
    if spec.training.get("framework") != "tensorflow" or not any(i.host == LOCAL_HOST for i in plan.instances):
        return
    if importlib.util.find_spec("tensorflow") is None:
        raise UsageError(f"training.framework is tensorflow, but this machine's python ({sys.executable}) cannot "
                         "import tensorflow", hint="pip install 'psctl[tensorflow]' (tensorflow-cpu) there")
    commands: dict[tuple[str, ...], list[str]] = {("training", "command"): spec.training["command"]}
    commands.update({("roles", name, "command"): list(r.command) for name, r in spec.roles.items() if r.command})
    folder = spec.path.parent if spec.path else Path.cwd()  # (where the roles run)
    for path, words in commands.items():
        program = words[0]
        if "{" in program or program in ("python", "python3"):
            continue
        if "/" in program:  # a path: relative ones from the spec's folder, where the roles start it
            where = folder / program
            if not (where.is_file() and os.access(where, os.X_OK)):
                raise UsageError(f"{spec.source.where(path)}: {'.'.join(path)}: {program!r} is not an executable "
                                 f"file ({where})", hint="a relative path is from the spec's folder; chmod +x it, "
                                                         "or start it with python")
        elif shutil.which(program) is None:
            raise UsageError(f"{spec.source.where(path)}: {'.'.join(path)}: {program!r} not found on this machine "
                             "(PATH)", hint="give its full path, or install it")


def refuse_if_up(spec: ClusterSpec) -> None:
    """A UsageError if a cluster of this name still runs (its supervisor, or any process of it here)."""
    cdir = ClusterDir.named(spec.name)
    if not cdir.state_file.is_file():
        return
    old = load_state(cdir.state_file)
    alive = supervisor_alive(cdir, old)
    if not old.state.terminal and (alive or LocalRunner().cluster_processes(old.cluster_id)):
        again = "" if alive else f"supervise it again with `psctl supervise {spec.name}`, "
        raise UsageError(
            f"cluster {spec.name!r} is already up ({old.state.value}){'' if alive else ' without its supervisor'}",
            hint=f"see `psctl status {spec.name}`, {again}or stop it with `psctl down {spec.name}`",
        )


def _refuse_if_left_on_hosts(name: str, old: ClusterRecord, runners: Mapping[str, SSHRunner]) -> None:
    """A UsageError if processes of the last cluster of this name still run on the hosts about to be prepared
    (its supervisor died, or `down` could not reach a host): `up` would move their logs and results from under
    them, and no later `down` would look for their cluster id."""
    found, _ = _cluster_processes(runners, old.cluster_id)
    if found:
        where = ", ".join(f"{h.host}:{h.pid}" for h in found)
        raise UsageError(f"cluster {name!r} from its last run still has processes on its hosts ({where})",
                         hint=f"stop them with `psctl down {name}`, then run up again")


def _start(
    spec: ClusterSpec, plan: Plan, runners: Mapping[str, SSHRunner], reports: Mapping[str, HostReport], *,
    wait_started: float,
) -> ClusterDir:
    cdir = ClusterDir.named(spec.name)
    if cdir.state_file.is_file():
        _wait_for_the_last_supervisor(cdir)
        _refuse_if_left_on_hosts(spec.name, load_state(cdir.state_file), runners)
        cdir.keep_last_run()
    record = new_cluster_folder(cdir, spec, plan)
    try:
        if spec.backend == "local":
            run_setup_here(spec, cdir)
        record.hosts = prepare_hosts(spec, plan, cdir, runners, reports)
    except (PsctlError, KeyboardInterrupt) as exc:
        shutil.rmtree(cdir.tls_dir, ignore_errors=True)
        # recorded as this run's end (status, ls and `down --purge` know the name; an older run's record would
        # show that run instead, its logs moved to history/): failed, or stopped by Ctrl-C in its setup
        if isinstance(exc, KeyboardInterrupt):
            record.state, record.reason = ClusterState.STOPPED, "interrupted while starting, before any role ran"
        else:
            record.state, record.reason = ClusterState.FAILED, exc.format_message()
        save_state(cdir.state_file, record)
        raise
    save_state(cdir.state_file, record)
    supervisor = spawn_supervisor(cdir, record)
    # every host's agent is started (16 at a time) before its roles: allow for it with many hosts
    wait_started += 0.5 * len(record.hosts)
    deadline = time.monotonic() + wait_started
    while time.monotonic() < deadline:
        current = load_state(cdir.state_file)
        if current.supervisor_pid and current.roles and all(r.state != RoleState.PENDING for r in current.roles):
            return cdir
        if current.state.terminal:
            return cdir
        if supervisor.poll() is not None and not load_state(cdir.state_file).state.terminal:  # (ended since?)
            tear_down(cdir)  # (it may have started an agent, or roles, before it ended)
            said = log_tail(str(cdir.supervisor_log), 1) or "its log is empty"
            raise LaunchError(f"the supervisor of {spec.name!r} ended as it started (exit code "
                              f"{supervisor.returncode}): {said}",
                              hint=f"the whole of it is in {cdir.supervisor_log}")
        time.sleep(0.1)
    tear_down(cdir)
    raise LaunchError(
        f"the supervisor of {spec.name!r} did not start within {wait_started:.0f}s; "
        f"see {cdir.supervisor_log}"
    )


#: Seconds a new run of a name waits for the last run's supervisor to end (it writes its record last of all).
LAST_SUPERVISOR_WAIT = 15.0


def _wait_for_the_last_supervisor(cdir: ClusterDir) -> None:
    """A run that just finished may still have its supervisor, ending: its last save of the record landed after
    the new run's (whose `up` then showed the last run's result and exited 0), and the new run's supervisor
    found the cluster's lock held and left. Wait (bounded) until it is gone; a UsageError if it does not go."""
    deadline = time.monotonic() + LAST_SUPERVISOR_WAIT
    while lock_held(cdir.supervisor_lock) and time.monotonic() < deadline:
        time.sleep(0.05)
    if lock_held(cdir.supervisor_lock):
        raise UsageError(f"the supervisor of cluster {cdir.name!r}'s last run still runs (waited "
                         f"{LAST_SUPERVISOR_WAIT:g}s for it to end)", hint=f"see `psctl status {cdir.name}`, or stop "
                         f"it with `psctl down {cdir.name}`, then run up again")


def new_cluster_folder(cdir: ClusterDir, spec: ClusterSpec, plan: Plan) -> ClusterRecord:
    """The folder of a cluster about to start (its last run's leftovers already cleared): created, the spec
    kept as read, the roles' certificates made; returns its new record (not saved yet)."""
    cdir.create()
    keep_spec(cdir.spec_file, spec)
    record = new_record(spec, plan)
    if record.tls:  # (roles are named, not addressed: TLS checks the cluster's server name, see pki)
        create_cluster_pki(cdir.tls_dir, record.cluster_id, pki_members(spec, plan))
    return record


def pki_members(spec: ClusterSpec, plan: Plan) -> list[tuple[str, list[str]]]:
    """Who gets a certificate at ``up``, with the addresses it may listen on: every role (its whole pool),
    every replica ``psctl scale`` may add (no CA key is kept to mint them later), the supervisor, and the
    agent of every host."""
    addresses = {h.name: h.address for h in spec.hosts}

    def where(i: RoleInstance) -> list[str]:  # the addresses of every host the instance may run on
        return [addresses.get(h, i.address) for h in plan.hosts_of(i)]

    members = [(i.name, where(i)) for i in plan.instances]
    members += [(name, [addresses.get(h, LOCAL_ADDRESS) for h in pool] or [LOCAL_ADDRESS])
                for name, pool in plan.spare_slots()]
    members.append(("supervisor", [LOCAL_ADDRESS]))
    members += [(agent_member(h), [LOCAL_ADDRESS]) for h in sorted({LOCAL_HOST, *addresses})]
    return members


def spawn_supervisor(cdir: ClusterDir, record: ClusterRecord) -> subprocess.Popen[bytes]:
    """Start the cluster's supervisor daemon (it outlives this command; Ctrl-C here does not reach it)."""
    fd = os.open(cdir.supervisor_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "psctl.supervisor", str(cdir.root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PSCTL_CLUSTER_ID=record.cluster_id, PYTHONUNBUFFERED="1"),
        )


def resupervise(cdir: ClusterDir, *, wait_started: float = 30.0) -> ClusterRecord:
    """Start a new supervisor for a cluster whose supervisor died: its agents dial in and their roles are
    adopted as they run (nothing restarted). Returns the record once the new supervisor runs."""
    record = load_state(cdir.state_file)
    if record.state.terminal:
        raise UsageError(f"cluster {cdir.name!r} has {record.state.value}; nothing to supervise",
                         hint=f"start it again with `{record.up_command()}` (raise training.steps to train further)")
    if supervisor_alive(cdir, record):
        raise UsageError(f"cluster {cdir.name!r} is supervised already", hint=f"see `psctl status {cdir.name}`")
    old_pid = record.supervisor_pid
    spawn_supervisor(cdir, record)
    deadline = time.monotonic() + wait_started
    while time.monotonic() < deadline:
        current = load_state(cdir.state_file)
        if current.supervisor_pid != old_pid and recorded_supervisor_runs(current):
            return current
        time.sleep(0.1)
    raise LaunchError(f"the new supervisor of {cdir.name!r} did not start within {wait_started:.0f}s; "
                      f"see {cdir.supervisor_log}")


def abandon_start(name: str) -> None:
    """``up`` interrupted before the cluster ran: whatever of it had started is stopped (a half-started cluster
    is not left running behind a command that said it stopped)."""
    cdir = ClusterDir.named(name)
    if cdir.state_file.is_file():  # (none: interrupted before anything was started)
        tear_down(cdir)


@dataclass(frozen=True)
class TeardownReport:
    stopped: int
    #: Spare pool hosts that did not answer, where no role of the cluster ever ran (nothing to stop there).
    unanswered_spares: tuple[str, ...] = ()
    #: Why the cluster's state could not be read (its processes here were found by their open files instead).
    damaged: str | None = None
    #: Where ``--purge`` left the cluster's checkpoints (``host:folder`` on an SSH host); "" where there are none.
    kept_checkpoints: str = ""


def tear_down(cdir: ClusterDir, *, grace: float = 5.0, purge: bool = False) -> TeardownReport:
    """Stop the supervisor and every process of the cluster on every host; verify none is left. Safe to
    repeat. A host that cannot be reached is an error naming it (run ``down`` again once it is back)."""
    try:
        record = load_state(cdir.state_file)
    except DamagedState as exc:
        return _down_damaged(cdir, grace=grace, purge=purge, why=exc.format_message())
    runners = host_runners(record.hosts)
    try:
        return _tear_down(cdir, record, runners, grace=grace, purge=purge)
    finally:
        for runner in runners.values():
            runner.close()


def _cluster_processes(runners: Mapping[str, Runner], cluster_id: str) -> tuple[list[ProcessHandle], dict[str, str]]:
    """Every process of the cluster on every host, and the hosts that could not be searched (why)."""
    found: list[ProcessHandle] = []
    errors: dict[str, str] = {}
    for host, result in run_on_all(list(runners.values()), lambda r: r.cluster_processes(cluster_id)).items():
        if isinstance(result, Exception):
            errors[host] = result.format_message() if isinstance(result, PsctlError) else str(result)
        else:
            found += result
    return found, errors


def _running(
    runners: Mapping[str, Runner], handles: list[ProcessHandle]
) -> tuple[list[ProcessHandle], dict[str, Exception]]:
    """The handles whose process still runs, asked of every host at once, and the hosts that could not say."""
    live: list[ProcessHandle] = []
    errors: dict[str, Exception] = {}
    polled = on_their_hosts(runners, handles, lambda runner, group: [h for h in group if runner.poll(h) is None])
    for host, (_, result) in polled.items():
        if isinstance(result, Exception):
            errors[host] = result
        else:
            live += result
    return live, errors


def _tear_down(
    cdir: ClusterDir, record: ClusterRecord, runners: Mapping[str, Runner], *, grace: float, purge: bool
) -> TeardownReport:
    stopped_by_supervisor = 0
    if record.backend == "slurm":
        from psctl.slurm_cluster import stop_job

        stopped_by_supervisor = stop_job(cdir, record, grace=grace)
    elif recorded_supervisor_runs(record):  # (one still starting, its pid not recorded, is among the processes below)
        assert record.supervisor_pid is not None
        running = {r.name for r in record.roles if not r.state.terminal and r.pid}
        write_json_atomic(cdir.stop_request, {"grace": grace})
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 10.0
        while recorded_supervisor_runs(record) and time.monotonic() < deadline:
            time.sleep(0.1)
        after = load_state(cdir.state_file)  # the supervisor stops its roles through their agents
        stopped_by_supervisor = sum(1 for r in after.roles if r.name in running and r.state == RoleState.STOPPED)
    found, unreachable = _cluster_processes(runners, record.cluster_id)
    handles = [
        ProcessHandle(r.host, r.pid, r.create_time) for r in record.roles
        if r.pid is not None and r.host not in unreachable
    ] + found
    handles = list({(h.host, h.pid): h for h in handles}.values())  # state file and process scan overlap
    live, poll_errors = _running(runners, handles)
    survivors, errors = stop_on_hosts(runners, live, grace=grace)
    errors.update(poll_errors)
    left, still_unreachable = _cluster_processes(runners, record.cluster_id)
    survivors += [h for h in left if h not in survivors]
    unreachable.update(still_unreachable)
    unreachable.update({h: e.format_message() if isinstance(e, PsctlError) else str(e) for h, e in errors.items()})
    record = load_state(cdir.state_file)
    changed = not record.state.terminal or any(not role.state.terminal for role in record.roles)
    if not record.state.terminal:
        record.state = ClusterState.STOPPED
        record.reason = "stopped by psctl down"
    for role in record.roles:
        if not role.state.terminal:
            role.state = RoleState.STOPPED
            role.reason = "stopped by psctl down"
    if changed:  # (a finished cluster's record, and the time `ls` shows it ended, stay as they were)
        try:
            save_state(cdir.state_file, record)
        except OSError:
            if not purge:  # (purged, the record goes anyway: a full disk must not keep --purge from freeing it)
                raise
    # A pool host that no attempt of any role ran on holds nothing of the cluster: its silence is no failure.
    ran = {r.host for r in record.roles} | {where for r in record.roles for _, where in r.hosts_by_attempt}
    spares = tuple(sorted(h for h in unreachable if h not in ran))
    unreachable = {h: why for h, why in unreachable.items() if h in ran}
    if unreachable:
        lines = [f"cannot verify that nothing of cluster {cdir.name!r} is left on {len(unreachable)} host(s); "
                 f"run `psctl down {cdir.name}` again once they answer:"]
        raise LaunchError("\n".join([*lines, *(f"  {why}" for _, why in sorted(unreachable.items()))]))
    if survivors:
        pids = ", ".join(f"{h.host}:{h.pid}" for h in survivors)
        raise LaunchError(f"processes of cluster {cdir.name!r} survived SIGKILL: {pids}")
    if purge:  # logs, state and keys go, on every host; checkpoints are training results and stay
        # every host but this machine has an SSH runner (host_runners), checked without importing paramiko
        remote = [cast("SSHRunner", r) for name, r in runners.items() if name != LOCAL_HOST]
        roots = {name: HostDir(PurePosixPath(raw["root"])) for name, raw in record.hosts.items()}
        check_results(run_on_all(remote, lambda r: remove_files(r, roots[r.host])))
        _remove_cluster_folder(cdir)
        # said, since a later `up` of the name resumes from them ("nothing to train") where one expects a fresh run
        kept = _kept_checkpoints(cdir, record, runners)
        return TeardownReport(stopped=len(live) + stopped_by_supervisor, unanswered_spares=spares,
                              kept_checkpoints=kept)
    return TeardownReport(stopped=len(live) + stopped_by_supervisor, unanswered_spares=spares)


def _kept_checkpoints(cdir: ClusterDir, record: ClusterRecord, runners: Mapping[str, Runner]) -> str:
    """The folder of the cluster's checkpoints (``host:folder`` on an SSH host) if it holds any, else ""."""
    from psctl.checkpoints import checkpoint_folder  # (numpy, through the runtime's checkpoint module)

    host, folder = checkpoint_folder(cdir, record)
    if host == LOCAL_HOST:
        return folder if _holds_files(Path(folder)) else ""
    try:  # an empty one there is removed by remove_files: a folder left holds checkpoints
        code, _, _ = cast("SSHRunner", runners[host]).run(f"test -d {sh_path(folder)}", timeout=30.0)
    except (KeyError, PsctlError, OSError):
        code = 0  # (cannot tell: the folder is named rather than a checkpoint kept silently)
    return f"{host}:{folder}" if code == 0 else ""


def _holds_files(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def _remove_cluster_folder(cdir: ClusterDir) -> None:
    """The cluster's folder here, but its checkpoints (training results: they stay)."""
    for path in cdir.root.iterdir():
        if path.name != "checkpoints":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if not any(cdir.root.iterdir()):
        cdir.root.rmdir()
    with contextlib.suppress(OSError):  # (a purge while an `up` of the name starts is not guarded against)
        cdir.up_lock.unlink()


def _down_damaged(cdir: ClusterDir, *, grace: float, purge: bool, why: str) -> TeardownReport:
    """``down`` of a cluster whose state cannot be read. Its record (hosts, pids, cluster id) is lost, so its
    processes on this machine are found by the files they hold open in its folder (the supervisor's log, the
    agent's and the roles' logs, which their children inherit) and each is stopped; its other hosts, if it had
    any, are not known here. ``purge``: its folder goes too (else its logs stay, to read)."""
    found = _holding_files_in(cdir.root)
    for proc in found:  # (each process, not its group as `down` signals roles: these need not lead one)
        with contextlib.suppress(psutil.NoSuchProcess):  # (psutil refuses a pid reused since it was found)
            proc.terminate()
    _, alive = psutil.wait_procs(found, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    if alive:
        pids = ", ".join(str(p.pid) for p in alive)
        raise LaunchError(f"processes of cluster {cdir.name!r} survived SIGKILL: {pids}; its folder is kept")
    kept = ""
    if purge:
        _remove_cluster_folder(cdir)
        kept = str(cdir.checkpoints) if _holds_files(cdir.checkpoints) else ""  # (one its lost record named: unknown)
    return TeardownReport(stopped=len(found), damaged=None if purge else why, kept_checkpoints=kept)


def _holding_files_in(folder: Path) -> list[psutil.Process]:
    """Every process here, but this one, with a file open to write under ``folder`` (a log: a role, its agent, its
    supervisor; not someone's `tail -f` or `less` of it)."""
    inside = f"{folder.resolve()}{os.sep}"
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if any(f.path.startswith(inside) and f.mode != "r" for f in proc.open_files()):
                found.append(proc)
    return found

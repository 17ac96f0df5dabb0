"""The supervisor loop: start every role, watch exits and heartbeats, apply the restart policy, persist.

One loop (monitor → decide → act → persist), in the manner of TorchElastic's agent: monitoring never raises
for a failed role, it returns what it saw and the loop decides. The state file is rewritten atomically after
every change, so ``psctl status`` works from the file alone, even after this process is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from psctl.errors import PsctlError
from psctl.home import ClusterDir
from psctl.launch.base import ProcessHandle, Runner, stop_on_hosts
from psctl.launch.env import tuning_env
from psctl.launch.hostset import Placement, placements
from psctl.launch.remote import remote_training
from psctl.launch.ssh import SSHRunner
from psctl.pki import member_files
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.cluster import tf_config
from psctl.runtime.rpc import make_server
from psctl.spec import ClusterSpec
from psctl.spec.plan import LOCAL_HOST
from psctl.supervisor.hosts import DIALED_ROLES, HostBench, Occupant, restart_host
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, save_state

log = logging.getLogger("psctl.supervisor")

#: Roles whose exit with code 0 means their job is done. ps and workers serve until told to stop, so any
#: exit of theirs while training runs (preemption sends SIGTERM, which they answer with exit 0) is a loss.
FINISHING_ROLES = ("chief", "evaluator")
#: A role running this many times max_backoff_seconds counts as stable: its failures in a row reset.
STABLE_FACTOR = 10.0
#: Seconds an evaluator gets, after training finished, to evaluate the final checkpoint.
EVALUATOR_GRACE = 120.0
#: How often the roles on an SSH host are looked at (one command for all of them, in a thread per host).
SSH_STATUS_INTERVAL = 0.5
#: A host whose last answered look is older than this is not given a moving role (its current look may be
#: waiting on a cut-off connection, which takes seconds to time out).
LOOK_OVERDUE = 2.5
#: How often a role waiting for its host to answer looks again.
HOST_WAIT = 1.0
#: How often the stale processes of cut-off roles are tried again on hosts that answer.
STALE_SWEEP_INTERVAL = 2.0
#: How often a remote chief's new metrics lines are copied here.
MIRROR_INTERVAL = 2.0


def describe_exit(code: int) -> str:
    if code == -255:
        return "exited (code unknown: not a child of this supervisor)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_tail(runner: Runner, path: os.PathLike[str] | str, lines: int = 5) -> str:
    """The last lines of a role's log on its host, joined into one line ("" if it cannot be read)."""
    try:
        text = runner.read_file(str(path), -8192).decode("utf-8", "replace")
    except (OSError, PsctlError):
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


@dataclass
class Live:
    """What the supervisor knows of a role beyond its persisted record (monotonic times)."""

    handle: ProcessHandle | None = None
    started: float = 0.0
    last_heartbeat: float | None = None
    restart_at: float | None = None
    #: The role's progress counter (a worker's local step, the chief's global step) and when it last moved.
    progress: int = -1
    progressed_at: float = 0.0
    #: Restarts since the role last ran stably: drives the backoff and the max_restarts limit, so a long job
    #: whose worker is preempted now and then is not failed for good by its eleventh preemption.
    failures_in_a_row: int = 0
    running_since: float | None = None
    #: Earlier processes of the role on an SSH host that could not be confirmed stopped (the host was cut
    #: off): stopped before the role starts there again, so that no zombie answers on its port, and on any
    #: host as soon as it answers again.
    stale: list[ProcessHandle] = field(default_factory=list)


class HeartbeatServicer(pb_grpc.SupervisorServicer):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        response = pb.HeartbeatResponse(fenced=self.supervisor.on_heartbeat(request))
        if not response.fenced:  # the chief follows moved ps and workers, a worker moved ps, a ps nobody
            job = request.task.partition(":")[0]
            response.addresses.update(self.supervisor.addresses(job))
            if job in DIALED_ROLES:  # they refuse a replaced chief that still runs somewhere (see fencing)
                response.chief_incarnation = self.supervisor.chief_incarnation()
        return response


class Supervisor:
    def __init__(
        self,
        cdir: ClusterDir,
        spec: ClusterSpec,
        record: ClusterRecord,
        runner: Runner | Mapping[str, Placement],
        *,
        get_time: Callable[[], float] = time.monotonic,
        poll_interval: float = 0.1,
        python: str = sys.executable,
    ) -> None:
        """``runner``: the runner of this machine (every role local), or the placement of every host."""
        self.cdir = cdir
        self.spec = spec
        self.record = record
        if isinstance(runner, Runner):
            cwd = str(spec.path.parent if spec.path else cdir.root)
            runner = placements(cdir, {}, {LOCAL_HOST: runner}, cwd=cwd, python=python)
        #: The chief's record (records are changed in place, never replaced): heartbeats read its incarnation.
        self._chief = next((r for r in record.roles if r.role == "chief"), None)
        self.places: dict[str, Placement] = dict(runner)
        self.runners: dict[str, Runner] = {name: p.runner for name, p in self.places.items()}
        self._heartbeat_port: int | None = None
        #: How much of each host's metrics.jsonl is mirrored: a chief that moved appends to the file on its new
        #: host, and one that comes back to a host appends to that host's file after what was mirrored of it.
        self._mirror_offsets: dict[str, int] = {}
        self._mirrored_at = float("-inf")
        #: The loop mirrors outside the main lock, and finish() (from any thread) once more: one at a time.
        self._mirror_lock = threading.Lock()
        self._host_errors: dict[str, str | None] = {}
        sup = spec.supervision
        self.bench = HostBench(failures=sup.bench_after_failures, window=sup.bench_window, cooloff=sup.bench_cooloff)
        self._sweeping: set[str] = set()  # hosts whose stale processes a thread is stopping now
        self._swept_at: dict[str, float] = {}  # when each host's stale processes were last tried
        self._addresses = self._address_map()
        self.time = get_time
        self.poll_interval = poll_interval
        self.python = python
        self.live: dict[str, Live] = {r.name: Live() for r in record.roles}
        self.lock = threading.Lock()
        self.stop_requested = threading.Event()
        self._dirty = True
        self._last_save = 0.0
        self._server: grpc.Server | None = None
        #: Set when the chief finished while an evaluator still had checkpoints to evaluate.
        self._evaluator_deadline: float | None = None

    # -- events ---------------------------------------------------------------------------------------
    def write_event(self, subject: str, was: str, to: str, reason: str, **extra: object) -> None:
        """One line of events.jsonl: ``subject`` (a role, "cluster" or "host NAME") went from ``was`` to ``to``."""
        event = {"time": time.time(), "role": subject, "from": was, "to": to, "reason": reason, **extra}
        with open(self.cdir.events_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    def transition(self, role: RoleRecord, state: RoleState, reason: str = "") -> None:
        if role.state == state and not reason:
            return
        log.info("%s: %s -> %s%s", role.name, role.state.value, state.value, f" ({reason})" if reason else "")
        self.write_event(role.name, role.state.value, state.value, reason, attempt=role.attempt)
        role.state = state
        if reason:
            role.reason = reason
        self._dirty = True

    def cluster_transition(self, state: ClusterState, reason: str = "") -> None:
        log.info("cluster: %s -> %s%s", self.record.state.value, state.value, f" ({reason})" if reason else "")
        self.write_event("cluster", self.record.state.value, state.value, reason)
        self.record.state = state
        if reason:
            self.record.reason = reason
        self._dirty = True

    def on_heartbeat(self, hb: pb.HeartbeatRequest) -> bool:
        """Record a heartbeat; True if it comes from a replaced incarnation (the role must exit)."""
        job, _, index = hb.task.partition(":")
        name = f"{job}-{index}"
        with self.lock:
            try:
                role = self.record.role(name)
            except KeyError:
                return True
            if hb.incarnation != role.incarnation or role.state == RoleState.FAILED:
                return True  # replaced, or given up on: a process that still runs must exit
            self.live[name].last_heartbeat = self.time()
            role.last_heartbeat = time.time()
            role.global_step = hb.global_step
            role.local_step = hb.local_step
            role.loss = hb.loss if hb.loss == hb.loss else None
            role.steps_per_sec = hb.steps_per_second
            role.rss_bytes = hb.rss_bytes
            role.metrics = dict(hb.metrics)
            return False

    def chief_incarnation(self) -> int:
        """The current chief's incarnation (0: no chief yet)."""
        return self._chief.incarnation if self._chief is not None else 0

    def addresses(self, job: str) -> dict[str, str]:
        """The addresses a role of ``job`` follows in its heartbeat replies (``"worker:2" -> "host:port"``): every
        ps's and worker's for the chief, every ps's for a worker (it talks to no other worker: a reply stays
        O(ps), not O(workers)), none for others; none at all where no ps or worker can move."""
        return self._addresses.get(job, {})

    def _address_map(self) -> dict[str, dict[str, str]]:
        """Rebuilt when a role moves (heartbeats read it without the lock: it is replaced, never changed)."""
        if not any(len(set(self.spec.roles[r.role].hosts)) > 1 and r.role in DIALED_ROLES for r in self.record.roles):
            return {}
        chief = {f"{r.role}:{r.index}": r.endpoint for r in self.record.roles if r.role in DIALED_ROLES}
        return {"chief": chief, "worker": {task: at for task, at in chief.items() if task.startswith("ps:")}}

    # -- starting roles -------------------------------------------------------------------------------
    def role_env(self, role: RoleRecord) -> dict[str, str]:
        place = self.places[role.host]
        jobs: dict[str, list[str]] = {}
        for r in self.record.roles:
            jobs.setdefault(r.role, []).append(r.endpoint)
        if place.remote:
            training = remote_training(self.spec, place.dirs)  # type: ignore[arg-type]  # a HostDir on SSH hosts
        else:
            training = dict(self.spec.training)
            if isinstance(training.get("checkpoint"), dict) and not training["checkpoint"].get("dir"):
                training["checkpoint"] = {**training["checkpoint"], "dir": str(self.cdir.checkpoints)}
        if role.role == "chief":
            folder = (training.get("checkpoint") or {}).get("dir")
            self.record.checkpoint_dir = "" if not folder else f"{role.host}:{folder}" if place.remote else str(folder)
        cluster = {
            "cluster": jobs,
            "task": {"type": role.role, "index": role.index},
            "cluster_id": self.record.cluster_id,
            "incarnation": role.incarnation,
            "training": training,
            "run_dir": str(place.dirs.run_dir),
            "supervisor": self.supervisor_address_for(place),
            "tls": asdict(member_files(place.dirs.tls_dir, role.name)) if self.record.tls else None,
            "chief_incarnation": self.chief_incarnation(),
        }
        spec_role = self.spec.roles[role.role]
        on_host = sum(1 for r in self.record.roles if r.host == role.host)
        threads = spec_role.threads or max(1, place.cpus // max(1, on_host))
        env = dict(place.base_env)
        env.update(
            PSCTL_CLUSTER=json.dumps(cluster),
            TF_CONFIG=tf_config(jobs, role.role, role.index),
            PSCTL_CLUSTER_ID=self.record.cluster_id,
            PSCTL_ROLE=role.name,
            PSCTL_HEARTBEAT_INTERVAL=str(self.spec.supervision.heartbeat_interval),
        )
        env.update(tuning_env(threads))
        env.update(spec_role.env)
        return env

    def supervisor_address_for(self, place: Placement) -> str | None:
        """The heartbeat endpoint as roles on ``place`` reach it: loopback here; on an SSH host, the port
        that forwards to it there (which a reconnect may have changed)."""
        if isinstance(place.runner, SSHRunner) and self._heartbeat_port is not None:
            port = place.runner.remote_port(self._heartbeat_port)
            return f"127.0.0.1:{port}" if port is not None else None
        return self.record.supervisor_address

    def start_role(self, role: RoleRecord) -> None:
        """Start the role's next attempt. On an SSH host the start runs in a thread of its own (holding no
        lock), so that a slow or cut-off host never holds up the loop, nor the heartbeats of other roles."""
        live = self.live[role.name]
        if live.handle is not None and self.places[role.host].remote:
            live.stale.append(live.handle)
        live.handle = None
        self.place_role(role)
        role.attempt += 1
        if not role.hosts_by_attempt or role.hosts_by_attempt[-1][1] != role.host:
            role.hosts_by_attempt.append([role.attempt, role.host])
        role.incarnation = max(role.incarnation + 1, int(time.time() * 1000))
        role.exit_code = None
        role.last_heartbeat = None
        place = self.places[role.host]
        live.restart_at = None
        stale = [h for h in live.stale if h.host == role.host]  # the rest: swept once their host answers
        env = self.role_env(role)
        if place.remote:
            threading.Thread(target=self._launch, args=(role, role.attempt, place, env, stale), daemon=True,
                             name=f"psctl-start-{role.name}").start()
        else:
            self._launch(role, role.attempt, place, env, stale, locked=True)

    def usable(self, host: str) -> bool:
        """Whether roles may start on ``host`` now: it answers and is not benched."""
        return self.usable_now(host) and not self.bench.is_benched(host, self.time())

    def usable_now(self, host: str) -> bool:
        """Whether ``host`` answers: its last look neither failed nor is overdue (a cut-off host's look takes
        seconds to time out)."""
        place = self.places.get(host)
        if place is None or place.runner.last_error is not None:
            return False
        answered = place.runner.answered_at
        return answered is None or time.monotonic() - answered <= LOOK_OVERDUE

    def waits_for_host(self, role: RoleRecord, now: float) -> bool:
        """A role due to restart whose host does not answer (and which has no usable host to move to) waits for
        it, looking again every HOST_WAIT: an outage must not use up its restarts."""
        self.place_role(role)
        if not self.places[role.host].remote or self.usable_now(role.host):
            return False
        self.live[role.name].restart_at = now + HOST_WAIT
        waiting = f"waiting for {role.host} to answer"
        if not role.reason.startswith(waiting):
            self.transition(role, role.state, waiting)
        return True

    def place_role(self, role: RoleRecord) -> None:
        """Move a role whose host is cut off or benched to another host of its pool (if one is usable)."""
        if role.attempt == 0:
            return  # the first start goes where the plan put it
        occupants = [Occupant(r.name, r.host, r.port) for r in self.record.roles if not r.state.terminal]
        pool = self.spec.roles[role.role].hosts
        target = restart_host(role.name, role.host, role.port, pool, occupants, self.usable)
        if target == role.host:
            return
        old = role.host
        why = self.places[old].runner.last_error or (
            "benched" if self.bench.is_benched(old, self.time()) else "not usable")
        self.transition(role, role.state, f"moves from {old} to {target} ({why})")
        role.host, role.address = target, self.places[target].address
        self._addresses = self._address_map()
        self._dirty = True

    def sweep_stale(self) -> None:
        """Stop, in a thread per host, the stale processes of every role on each host that answers, every
        STALE_SWEEP_INTERVAL until they are gone. Called holding the lock. (Their heartbeats would fence them,
        but a process cut off with its host may still hold a forward port that a reconnect replaced.)"""
        now = self.time()
        for host in {h.host for live in self.live.values() for h in live.stale}:
            if (host not in self._sweeping and self.usable_now(host)
                    and now - self._swept_at.get(host, float("-inf")) >= STALE_SWEEP_INTERVAL):
                self._swept_at[host] = now
                self._sweep(host)

    def _sweep(self, host: str) -> None:
        handles = [h for live in self.live.values() for h in live.stale if h.host == host]
        self._sweeping.add(host)

        def sweep() -> None:
            survivors, errors = stop_on_hosts(self.runners, handles, grace=0.0)
            with self.lock:
                self._sweeping.discard(host)
                if errors:
                    return
                gone = [h for h in handles if h not in survivors]
                for live in self.live.values():
                    live.stale = [h for h in live.stale if h not in gone]
                if gone:
                    log.info("stopped %d stale process(es) on %s", len(gone), host)

        threading.Thread(target=sweep, daemon=True, name=f"psctl-sweep-{host}").start()

    def _launch(self, role: RoleRecord, attempt: int, place: Placement, env: dict[str, str],
                stale: list[ProcessHandle], *, locked: bool = False) -> None:
        handle: ProcessHandle | None = None
        error: PsctlError | None = None
        unreachable = place.runner.last_error
        try:
            if unreachable is not None:  # known to be down: fail at once rather than wait for the timeouts
                raise PsctlError(unreachable)
            if stale:
                # Lost while its host was cut off, an old process may still run there and answer on the
                # role's port: now that the host answers again, make sure it is gone before starting anew.
                survivors, errors = stop_on_hosts(self.runners, stale, grace=0.0)
                if errors or survivors:
                    raise PsctlError(f"cannot stop the previous process first: {errors or survivors}")
                with self.lock:
                    live = self.live[role.name]
                    live.stale = [h for h in live.stale if h not in stale]
            handle = place.runner.start(argv=[place.python, "-m", "psctl.runtime"], env=env, cwd=place.cwd,
                                        log_path=place.dirs.role_log(role.name, attempt))
        except PsctlError as exc:  # the host is unreachable, or its folder is gone
            error = exc
        with contextlib.nullcontext() if locked else self.lock:
            self._launched(role, attempt, handle, error)

    def _launched(self, role: RoleRecord, attempt: int, handle: ProcessHandle | None, error: PsctlError | None) -> None:
        live = self.live[role.name]
        if role.attempt != attempt or self.record.state.terminal or role.state.terminal:
            if handle is not None:  # superseded while it started (stopped by down, say): do not leave it running
                self.stop([handle], grace=0.0)
            return
        if handle is None:
            assert error is not None
            reason = f"cannot start on {role.host}: {error.format_message()}"
            if self.record.state == ClusterState.STARTING and attempt == 1:
                self.transition(role, RoleState.FAILED, reason)
                self.finish(ClusterState.FAILED, f"{role.name} failed to start: {reason}")
            else:
                self.transition(role, RoleState.LOST, reason)
                self.maybe_restart(role, None)
            return
        live.handle, live.started, live.last_heartbeat = handle, self.time(), None
        role.pid, role.create_time, role.started_at = handle.pid, handle.create_time, time.time()
        self.transition(role, RoleState.STARTING, f"attempt {attempt}, pid {handle.pid}")
        self._dirty = True

    # -- the loop -------------------------------------------------------------------------------------
    def serve_heartbeats(self) -> None:
        """Listen on loopback; every SSH host gets a reverse forward to it through its SSH connection, so
        heartbeats arrive also where the hosts cannot open connections back to this machine."""
        tls = member_files(self.cdir.tls_dir, "supervisor") if self.record.tls else None
        server, port = make_server("127.0.0.1:0", tls, max_workers=8)
        pb_grpc.add_SupervisorServicer_to_server(HeartbeatServicer(self), server)
        server.start()
        self._server = server
        self.record.supervisor_address = f"127.0.0.1:{port}"
        self._heartbeat_port = port
        for place in self.places.values():
            if isinstance(place.runner, SSHRunner):
                place.runner.forward_remote_port(port)
                place.runner.watch_in_background(SSH_STATUS_INTERVAL)

    def run(self) -> ClusterState:
        try:
            self.serve_heartbeats()
        except PsctlError as exc:
            self.finish(ClusterState.FAILED, exc.format_message())
        with self.lock:
            for role in self.record.roles:
                if self.record.state.terminal:
                    break
                self.start_role(role)
            self.save()
        try:
            while not self.record.state.terminal:
                if self.stop_requested.is_set():
                    with self.lock:  # a launch finishing meanwhile then sees the cluster stopped and stops its process
                        self.finish(ClusterState.STOPPED, "stopped by psctl down")
                    break
                with self.lock:
                    self.step()
                    self.save()
                if self.time() - self._mirrored_at > MIRROR_INTERVAL:
                    self.mirror_metrics()
                self.stop_requested.wait(self.poll_interval)
        finally:
            if self._server is not None:
                self._server.stop(grace=0.5)
            self.save(force=True)
            for runner in self.runners.values():
                runner.close()
        return self.record.state

    def mirror_metrics(self) -> None:
        """Copy what a chief on an SSH host added to its metrics.jsonl into the local run folder, so that
        ``status`` and plots read it here (the chief's own file stays complete on its host)."""
        self._mirrored_at = self.time()
        chief = self._chief
        if chief is None or not self.places[chief.host].remote:
            return
        host = chief.host
        place = self.places[host]
        with self._mirror_lock:
            try:
                offset = self._mirror_offsets.get(host, 0)
                data = place.runner.read_file(str(place.dirs.run_dir / "metrics.jsonl"), offset)
            except (OSError, PsctlError):
                return
            complete = data[: data.rfind(b"\n") + 1]  # whole lines only: the rest is read next time
            if complete:
                with open(self.cdir.run_dir / "metrics.jsonl", "ab") as f:
                    f.write(complete)
                self._mirror_offsets[host] = offset + len(complete)

    def save(self, *, force: bool = False) -> None:
        now = self.time()
        if force or self._dirty or now - self._last_save > 1.0:
            save_state(self.cdir.state_file, self.record)
            self._dirty = False
            self._last_save = now

    def watch_hosts(self) -> None:
        """An event when an SSH host stops answering the supervisor, and when it answers again (its roles
        are judged by their heartbeats meanwhile)."""
        for name, place in self.places.items():
            error = place.runner.last_error
            # Only a change of reachability is news: a down host's error text may change from one try to
            # the next (a timeout, then a refused connection) without it having come back.
            was = "reachable" if self._host_errors.get(name) is None else "unreachable"
            to = "reachable" if error is None else "unreachable"
            self._host_errors[name] = error
            if to == was:
                continue
            log.warning("host %s: %s", name, error or "answers again")
            self.host_event(name, was, to, error or "")
        for name in self.bench.released(self.time()):
            self.host_event(name, "benched", "available", "cooling-off ended")

    def host_event(self, host: str, was: str, to: str, reason: str) -> None:
        """Log a host's change in the events, and what is wrong with it now in the record (for status)."""
        self.write_event(f"host {host}", was, to, reason)
        problems = []
        if self._host_errors.get(host):
            problems.append(f"unreachable: {self._host_errors[host]}")
        until = self.bench.benched_until(host)
        if until is not None and self.bench.is_benched(host, self.time()):
            clock = time.strftime("%H:%M:%S", time.localtime(time.time() + until - self.time()))
            problems.append(f"benched until {clock} (roles that can move start elsewhere)")
        if problems:
            self.record.host_problems[host] = "; ".join(problems)
        else:
            self.record.host_problems.pop(host, None)
        self._dirty = True

    def step(self) -> None:
        """One pass: look at every role, decide, act."""
        sup = self.spec.supervision
        now = self.time()
        self.watch_hosts()
        self.sweep_stale()
        for role in self.record.roles:
            live = self.live[role.name]
            if role.state.terminal:
                continue
            if role.state == RoleState.RESTARTING:
                if live.restart_at is not None and now >= live.restart_at and not self.waits_for_host(role, now):
                    self.start_role(role)
                continue
            if live.handle is None:  # its start failed; a restart is scheduled or it has failed
                continue
            code = self.runners[role.host].poll(live.handle)
            if code is not None:
                role.exit_code = code
                self.on_exit(role, code)
                if self.record.state.terminal:
                    return
                continue
            if live.last_heartbeat is not None:
                if role.state == RoleState.STARTING:
                    self.transition(role, RoleState.RUNNING)
                    live.running_since = now
                policy = self.spec.roles[role.role].restart
                if live.running_since is not None and now - live.running_since > STABLE_FACTOR * max(
                    policy.max_backoff_seconds, 1.0
                ):
                    live.failures_in_a_row = 0
                silent = now - live.last_heartbeat
                if silent > sup.heartbeat_timeout:
                    self.on_lost(role, f"no heartbeat for {silent:.1f}s (hung or cut off)")
                else:
                    self.check_stall(role, live, now)
            elif now - live.started > sup.startup_grace:
                self.on_lost(role, f"no heartbeat within the start-up grace of {sup.startup_grace:.0f}s")
        if self._evaluator_deadline is not None and now > self._evaluator_deadline:
            self.finish(ClusterState.SUCCEEDED, "training finished (the evaluator was stopped after its grace)")
            return
        if self.record.state == ClusterState.STARTING and all(
            r.state in (RoleState.RUNNING, RoleState.SUCCEEDED) for r in self.record.roles
        ):
            self.cluster_transition(ClusterState.RUNNING, "every role is up")

    def check_stall(self, role: RoleRecord, live: Live, now: float) -> None:
        """A worker or chief whose heartbeats go on but whose step stopped moving, while other workers' steps
        move, is reported STALLED (and RUNNING again once it moves). Reported, not restarted: a slow step is
        the coordinator's to re-schedule, a hang is caught by the heartbeat timeout."""
        if role.role not in ("worker", "chief"):
            return
        progress = role.local_step if role.role == "worker" else role.global_step
        if progress != live.progress:
            live.progress, live.progressed_at = progress, now
            if role.state == RoleState.STALLED:
                self.transition(role, RoleState.RUNNING, "progressing again")
            return
        if role.state != RoleState.RUNNING or now - live.progressed_at <= self.spec.supervision.stall_timeout:
            return
        others = [self.live[r.name] for r in self.record.roles if r.role == "worker" and r.name != role.name]
        if any(o.progressed_at > live.progressed_at for o in others):
            still = now - live.progressed_at
            reason = f"heartbeats arrive but its step has not moved for {still:.0f}s while others progress"
            self.transition(role, RoleState.STALLED, reason)

    def on_exit(self, role: RoleRecord, code: int) -> None:
        what = describe_exit(code)
        if code == 0 and role.role in FINISHING_ROLES:
            self.transition(role, RoleState.SUCCEEDED, "finished")
            if role.role == "chief":
                self.on_training_done()
            elif self._evaluator_deadline is not None:
                self.finish(ClusterState.SUCCEEDED, "training finished")
            return
        if self._evaluator_deadline is not None:  # training is over; nothing is restarted any more
            self.transition(role, RoleState.FAILED, what)
            self.finish(ClusterState.SUCCEEDED, "training finished (the evaluator did not finish cleanly)")
            return
        place = self.places[role.host]
        tail = log_tail(place.runner, place.dirs.role_log(role.name, role.attempt))
        reason = f"{what}" + (f"; last log lines: {tail}" if tail else "")
        if self.record.state == ClusterState.STARTING and role.attempt == 1:
            self.transition(role, RoleState.FAILED, reason)
            self.finish(ClusterState.FAILED, f"{role.name} failed to start: {reason}")
            return
        self.transition(role, RoleState.LOST, reason)
        self.maybe_restart(role, code)

    def on_training_done(self) -> None:
        """Stop ps and workers at once; give a running evaluator time to evaluate the final checkpoint."""
        evaluators = [r for r in self.record.roles if r.role == "evaluator" and not r.state.terminal]
        if not evaluators:
            self.finish(ClusterState.SUCCEEDED, "training finished")
            return
        others = [r for r in self.record.roles if r.role in ("ps", "worker") and not r.state.terminal]
        handles = [self.live[r.name].handle for r in others]
        self.stop([h for h in handles if h is not None], grace=5.0)
        for role in others:
            self.transition(role, RoleState.STOPPED, "training finished")
        self._evaluator_deadline = self.time() + EVALUATOR_GRACE

    def on_lost(self, role: RoleRecord, reason: str) -> None:
        live = self.live[role.name]
        self.transition(role, RoleState.LOST, reason)
        if live.handle is not None:
            if self.places[role.host].remote:  # its host may be cut off: do not hold up the loop for it (the
                # handle stays, so that the next start makes sure the process is gone)
                threading.Thread(target=self.stop, args=([live.handle],), kwargs={"grace": 0.0}, daemon=True,
                                 name=f"psctl-stop-{role.name}").start()
            else:
                self.stop([live.handle], grace=0.0)
        self.maybe_restart(role, None)

    def maybe_restart(self, role: RoleRecord, code: int | None) -> None:
        policy = self.spec.roles[role.role].restart
        live = self.live[role.name]
        # A host that does not answer is not benched for it (its roles wait for it, or move); a host that
        # answers while roles keep failing there is.
        if (self.places[role.host].remote and self.usable_now(role.host)
                and self.bench.record_failure(role.host, self.time())):
            sup = self.spec.supervision
            self.host_event(role.host, "available", "benched",
                            f"{sup.bench_after_failures} role failures within {sup.bench_window:.0f}s; "
                            f"no role that can go elsewhere starts there for {sup.bench_cooloff:.0f}s")
        why_not = None
        if policy.policy == "never":
            why_not = "restart policy is never"
        elif code is not None and code in policy.permanent_exit_codes:
            why_not = f"exit code {code} is permanent (a configuration or program error)"
        elif live.failures_in_a_row >= policy.max_restarts:
            why_not = f"restarted {live.failures_in_a_row} times in a row, the limit (max_restarts)"
        if why_not is not None:
            self.transition(role, RoleState.FAILED, f"{role.reason}; not restarted: {why_not}")
            if live.handle is not None and self.places[role.host].remote:  # its stop may not have reached it
                live.stale.append(live.handle)
                live.handle = None
            if role.role in ("chief", "ps") or all(
                r.state == RoleState.FAILED for r in self.record.roles if r.role == "worker"
            ):
                self.finish(ClusterState.FAILED, f"{role.name} failed: {role.reason}")
            return
        backoff = min(policy.max_backoff_seconds, policy.backoff_seconds * (2**live.failures_in_a_row))
        backoff *= random.uniform(0.8, 1.2)  # jitter: roles lost together do not restart in lockstep
        role.restarts += 1
        live.failures_in_a_row += 1
        live.running_since = None
        live.restart_at = self.time() + backoff
        self.transition(role, RoleState.RESTARTING, f"restart {role.restarts} in {backoff:.1f}s")

    def finish(self, state: ClusterState, reason: str) -> None:
        """Stop every role still running and record the outcome (idempotent)."""
        if self.record.state.terminal:
            return
        handles = [
            self.live[r.name].handle
            for r in self.record.roles
            if not r.state.terminal and self.live[r.name].handle is not None
        ]
        # and the old processes of roles lost with their host, not swept yet, where the host answers (a host still
        # cut off would hold the lock for its timeouts; `psctl down` looks for the cluster's processes again)
        stale = [h for live in self.live.values() for h in live.stale if self.usable_now(h.host)]
        self.stop([*(h for h in handles if h is not None), *stale], grace=self.stop_grace())
        for role in self.record.roles:
            if not role.state.terminal:
                self.transition(role, RoleState.STOPPED, "cluster finished" if state != ClusterState.STOPPED
                                else "stopped by psctl down")
        self.mirror_metrics()
        self.record.result = self.read_result()
        self.cluster_transition(state, reason)
        self.save(force=True)

    def stop(self, handles: list[ProcessHandle], *, grace: float) -> None:
        """SIGTERM, wait, SIGKILL on every host at once; a host that cannot be reached is logged (its
        processes are fenced off by their incarnation, and ``psctl down`` looks again)."""
        survivors, errors = stop_on_hosts(self.runners, handles, grace=grace)
        for host, exc in errors.items():
            log.warning("cannot stop processes on %s: %s", host, exc)
        if survivors:
            log.warning("still running after SIGKILL: %s", ", ".join(f"{h.host}:{h.pid}" for h in survivors))

    def stop_grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL: ``psctl down --grace`` leaves it in stop-request.json."""
        try:
            return float(json.loads((self.cdir.root / "stop-request.json").read_text())["grace"])
        except (OSError, ValueError, KeyError, TypeError):
            return 5.0

    def read_result(self) -> dict[str, Any] | None:
        """The chief's result.json and the evaluator's last result, read on their hosts."""
        by_role = {r.role: r for r in self.record.roles}
        chief = by_role.get("chief")
        result = self._read_run_file(chief, "result.json", 0)
        if not isinstance(result, dict):
            return None
        if chief is not None and self.places[chief.host].remote and result.get("checkpoint"):
            result["checkpoint"] = f"{chief.host}:{result['checkpoint']}"  # scp's notation: where it is
        lines = self._read_run_file(by_role.get("evaluator"), "eval.jsonl", -65536)
        if isinstance(lines, str):
            last = lines.strip().splitlines()[-1:] if lines.strip() else []
            with contextlib.suppress(ValueError):
                result["evaluation"] = json.loads(last[0]) if last else None
        return result

    def _read_run_file(self, role: RoleRecord | None, name: str, offset: int) -> Any:
        """A file of the run folder on ``role``'s host: parsed JSON for .json, else text; None if missing."""
        if role is None:
            return None
        place = self.places[role.host]
        try:
            text = place.runner.read_file(str(place.dirs.run_dir / name), offset).decode("utf-8", "replace")
            return json.loads(text) if name.endswith(".json") else text
        except (OSError, ValueError, PsctlError):
            return None

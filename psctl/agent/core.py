"""The per-host agent: runs the roles of one host on the supervisor's word and reports on them.

It starts each role as its own child (a session and process group of its own, output appended to its log),
watches it with ``waitpid`` (``Popen.poll``: a system call, no remote command; woken by the child's pidfd the
moment it exits), signals its group, answers its
heartbeats (a replaced incarnation is told it is fenced; moved peers' addresses are passed on), and sends the
supervisor ONE report per heartbeat interval for all of them over ONE long-lived gRPC stream (mutual TLS), at
once when a role exits. It never restarts a role by itself: restarts are the supervisor's decision.

When the supervisor goes away the agent keeps its roles running and dials again until one answers; the new
supervisor adopts them from the agent's hello (nothing restarted, nothing lost). When the agent itself goes
away, the next agent of the host adopts the roles it left (``psctl.agent.orphans``).

Needs only what a role needs (the runtime's dependencies): it imports nothing of the launcher side.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from psctl.agent.exits import ExitWaiter
from psctl.agent.keeper import keeper_argv
from psctl.agent.leftovers import end_group, exited_uncollected, kill_tree
from psctl.agent.logs import last_step, log_tail
from psctl.agent.orphans import (
    ADOPTION_VARIABLE,
    AdoptedProcess,
    Orphan,
    adoptable,
    adoptable_port,
    adoption_record,
    end_strays,
    ended_code,
    kill_orphans,
    left_to_their_roles,
    record_path,
)
from psctl.agent.procfs import create_time, tree_usage
from psctl.launch.cpus import (
    CPUS_FILE_VARIABLE,
    CPUS_VARIABLE,
    ClusterCpus,
    Move,
    allowed_cpus,
    bind,
    cpu_list,
    set_yielding,
    yields,
)
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.exits import EXIT_FILE_VARIABLE
from psctl.runtime.metrics import CPU_METRIC
from psctl.runtime.rpc import make_channel, make_server, member_of_task, refuse_unless_from

log = logging.getLogger("psctl.agent")

#: How often a child whose exit no pidfd shows (see psctl.agent.exits) is looked at (``waitpid`` with WNOHANG):
#: its exit is reported within this. A child watched through its pidfd is reported the moment it exits.
WATCH_INTERVAL = 0.1
#: Longest wait between two tries to reach the supervisor.
MAX_RECONNECT_BACKOFF = 1.0
#: HTTP/2 pings on the stream to the supervisor: it carries a report every heartbeat interval already, and
#: the supervisor judges the agent by those; the pings only end a stream to a supervisor that vanished.
LINK_KEEPALIVE_MS = 10_000
#: An agent with no running role ends after this long without a supervisor (its cluster is gone, or it was
#: replaced while cut off); one with roles keeps them and keeps dialling, for a new supervisor to adopt them.
ORPHAN_TIMEOUT = 600.0


class Process(Protocol):
    """What the agent needs of a started role: ``subprocess.Popen`` has it; benchmarks pass fakes."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


Spawn = Callable[[pb.StartRole, int], Process]
"""Starts a role: (the command, the log file's descriptor) -> its process."""


def spawn_process(command: pb.StartRole, log_fd: int) -> Process:
    """Start the role's argv as a child in its own session and process group (signalled as one)."""
    # (not the agent's own configuration, nor where its launcher reads its exit code: a role's are its own)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCTL_AGENT") and k != EXIT_FILE_VARIABLE}
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash leaves its stacks in the log (psctl.agent.logs)
    env.update(command.env)
    return subprocess.Popen(
        list(command.argv), env=env, cwd=host_path(command.cwd) if command.cwd else None,
        stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT, start_new_session=True,
    )


def _check_program(command: pb.StartRole) -> None:
    """FileNotFoundError (as ``Popen`` raises it) unless the program ``command.argv`` names can be run where it
    starts: checked here because a program under a keeper would only fail inside it, after its start."""
    program = command.argv[0] if command.argv else ""
    if os.sep in program:  # (relative to where it starts; an absolute path stays as it is)
        path = os.path.join(host_path(command.cwd) if command.cwd else os.getcwd(), program)
        found = path if os.access(path, os.X_OK) else None
    else:
        found = shutil.which(program, path=command.env.get("PATH", os.environ.get("PATH")))
    if not program or found is None or os.path.isdir(found):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def host_path(path: str) -> str:
    """A path as the launcher writes it for a host: ``~/x`` and relative paths are under the user's home."""
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.join(os.path.expanduser("~"), path)


#: Seconds of a watched program's printed steps its rate is taken over (it prints every N steps, not every one).
STEP_RATE_WINDOW = 30.0


def printed_step_rate(moves: collections.deque[tuple[float, int]], now: float, step: int) -> float:
    """Steps per second of a program that prints its step now and then (every checkpoint, say): over the moves of
    its printed step seen in the last STEP_RATE_WINDOW seconds (``moves`` is updated with ``step`` seen at
    ``now``). Over one report's interval it read 0, then the whole print's steps in one second (0 and 499 for
    170 steps/s). 0 once nothing was printed for three of its usual gaps (at least 10 s)."""
    if moves and step < moves[-1][1]:  # (restarted from a checkpoint behind its last print)
        moves.clear()
    if not moves or step != moves[-1][1]:
        moves.append((now, step))
    while len(moves) > 2 and now - moves[0][0] > STEP_RATE_WINDOW:
        moves.popleft()
    if len(moves) < 2:
        return 0.0
    (first, first_step), (last, last_step) = moves[0], moves[-1]
    gap = (last - first) / (len(moves) - 1)
    if last <= first or now - last > max(10.0, 3 * gap):
        return 0.0
    return (last_step - first_step) / (last - first)


@dataclass
class RoleProcess:
    """One role the agent started (or failed to start)."""

    name: str
    incarnation: int
    attempt: int
    log_path: str
    process: Process | None = None
    create_time: float = 0.0
    exit_code: int | None = None
    start_error: str = ""
    tail: str = ""
    last: pb.HeartbeatRequest | None = None
    last_beat: float | None = None
    #: When a stop's SIGTERM turns into SIGKILL (monotonic); None: no stop in progress.
    kill_at: float | None = None
    #: Its stop's grace ran out and it was sent SIGKILL (said once in the agent's log).
    killed: bool = False
    #: A framework's program: no heartbeats; alive while it runs, its progress read from its log.
    watched_only: bool = False
    #: A watched role's step was read from its log after it exited: there is nothing more to read.
    final_step_read: bool = False
    #: A watched role's last sample of its processes: (when, CPU seconds), for its CPU use.
    sampled: tuple[float, float] | None = None
    #: A watched role's printed step, each time it was seen to change: (when, step), for its steps per second.
    step_moves: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=64))
    #: The supervisor gave it a CPU slot (it is bound where the host's roles outnumber its CPUs) ...
    cpu_managed: bool = False
    #: ... and the CPUs it is bound to now (None: every CPU).
    cpus: list[int] | None = None
    #: Where this agent writes the CPUs it moves the role to, for the role to bind itself there
    #: (psctl.launch.cpus.bind_self); "" where it has no slot.
    cpus_file: str = ""
    #: Where the role (a watched program: its keeper) leaves its exit code as it ends, for an agent that adopts it.
    exit_file: str = ""

    @classmethod
    def from_record(cls, record: dict[str, Any], **known: Any) -> RoleProcess:
        """The role an earlier agent described in its adoption record (``adoption_record``), with what else is
        ``known`` of it; KeyError, TypeError or ValueError if the record lacks or garbles a field."""
        return cls(str(record["name"]), int(record["incarnation"]), int(record["attempt"]), str(record["log"]),
                   cpus_file=str(record.get("cpus_file", "")), exit_file=str(record.get("exit_file", "")),
                   watched_only=bool(record.get("watched_only", False)), **known)

    @property
    def running(self) -> bool:
        return self.process is not None and self.exit_code is None

    def signal(self, sig: int) -> None:
        """Signal the role's process group (the role's own children with it); SIGKILL also goes to every
        process below the role in a group of its own (psctl.agent.leftovers)."""
        if not self.running:
            return
        assert self.process is not None
        if not isinstance(self.process, subprocess.Popen):
            self.process.send_signal(sig)
            return
        if sig == signal.SIGKILL:
            kill_tree(self.process.pid)
            return
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)

    def _watched_beat(self, now: float, step: int) -> pb.HeartbeatRequest:
        """What a watched program would beat, as this agent sees it: the step it printed last, and (while it
        runs) its processes' memory, CPU use and steps per second since the last report."""
        beat = pb.HeartbeatRequest(global_step=step, status="running", loss=float("nan"))
        usage = tree_usage(self.process.pid) if self.running and self.process is not None else None
        if usage is None:
            return beat
        cpu_seconds, beat.rss_bytes = usage
        if self.sampled is not None and now > self.sampled[0]:
            beat.metrics[CPU_METRIC] = max(0.0, cpu_seconds - self.sampled[1]) / (now - self.sampled[0])
        self.sampled = (now, cpu_seconds)
        beat.steps_per_second = printed_step_rate(self.step_moves, now, step)
        return beat

    def report(self, now: float) -> pb.RoleReport:
        if self.watched_only and not self.final_step_read:  # its step from what it printed
            step = last_step(self.log_path)
            if step is None:  # other output since its last step line: still the step it named
                step = self.last.global_step if self.last is not None else 0
            self.last = self._watched_beat(now, step)
            if self.running:  # alive as long as it runs
                self.last_beat = now
            else:  # read once more after it exited (its last lines); its log no longer changes
                self.final_step_read = True
        out = pb.RoleReport(
            name=self.name, incarnation=self.incarnation, attempt=self.attempt,
            pid=self.process.pid if self.process is not None else 0, create_time=self.create_time,
            exited=self.exit_code is not None or bool(self.start_error), exit_code=self.exit_code or 0,
            log_tail=self.tail, start_error=self.start_error,
            heartbeat_age=now - self.last_beat if self.last_beat is not None else -1.0,
        )
        if self.last is not None:
            out.last.CopyFrom(self.last)
        return out


class HeartbeatEndpoint(pb_grpc.SupervisorServicer):
    """The roles' heartbeat endpoint, answered by their host's agent."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        refuse_unless_from(context, member_of_task(request.task), f"a heartbeat of {request.task}")
        return self.agent.on_heartbeat(request)


class Agent:
    """The agent of one host. ``start()`` serves the roles' heartbeats and dials the supervisor; ``wait()``
    returns once the supervisor told it to shut down (or ``stop()`` was called)."""

    def __init__(
        self,
        host: str,
        supervisor: str,
        *,
        cluster_id: str,
        tls: TlsFiles | None = None,
        interval: float = 1.0,
        spawn: Spawn = spawn_process,
        serve_heartbeats: bool = True,
        get_time: Callable[[], float] = time.monotonic,
        heartbeat_host: str = "127.0.0.1",
    ) -> None:
        """``heartbeat_host``: where the roles' heartbeats reach this agent (loopback unless its roles run on
        other machines: the nodes of a Slurm job)."""
        self.host = host
        self.supervisor = supervisor
        self.cluster_id = cluster_id
        self.tls = tls
        self.interval = interval
        self.spawn = spawn
        self.time = get_time
        self._serve = serve_heartbeats
        self.heartbeat_host = heartbeat_host
        self.heartbeat_address = ""
        self.roles: dict[str, RoleProcess] = {}
        self.lock = threading.Lock()
        self.view = pb.ClusterView()
        self._outbox: queue.SimpleQueue[pb.AgentReport | None] | None = None
        self._report_now = threading.Event()
        #: What the watch thread sleeps on between looks: a role's exit, or a poke (see ``_poke``), ends it.
        self._exits = ExitWaiter()
        #: A role started, began to stop or sent its first heartbeat: the next report says so (``changed``), and
        #: the supervisor acts on it at once (a view or CPU move is reported promptly too, but not marked).
        self._role_changed = threading.Event()
        #: Notified (under ``lock``) when the watch thread collects a role's exit.
        self._reaped = threading.Condition(self.lock)
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self.pid = os.getpid()
        self.pid_create_time = create_time(self.pid)
        #: This cluster's CPUs on this host (where its roles outnumber them).
        self._cpus = ClusterCpus(cluster_id)

    # -- life -----------------------------------------------------------------------------------------
    def start(self, orphans: Sequence[Orphan] = (), records: Sequence[dict[str, Any]] = ()) -> None:
        """Serve the roles' heartbeats and dial the supervisor. ``orphans``: roles of this cluster and host that
        an earlier agent left (it died; ``psctl.agent.orphans``): adopted where their heartbeats' port can be
        served here, before the hello that names them; the others are SIGKILLed. ``records``: the adoption
        records an earlier agent left beside its roles' logs (``find_records``): those of roles no longer running
        are reported in the hello as ended, with their exit codes."""
        adopt_on = adoptable_port(orphans, self.heartbeat_host) if self._serve else 0
        if self._serve:
            loopback = self.heartbeat_host in ("127.0.0.1", "localhost")
            bind = self.heartbeat_host if loopback else "0.0.0.0"
            try:  # only if no one else serves it (gRPC shares ports by default: a live agent may hold it)
                server, port = make_server(f"{bind}:{adopt_on}", self.tls, max_workers=4, exclusive=True)
            except OSError as exc:
                if not adopt_on:
                    raise
                log.warning("cannot serve heartbeats on the port of the roles left behind (%s)", exc)
                server, port = make_server(f"{bind}:0", self.tls, max_workers=4)
                adopt_on = 0
            pb_grpc.add_SupervisorServicer_to_server(HeartbeatEndpoint(self), server)
            server.start()
            self._server = server
            self.heartbeat_address = f"{self.heartbeat_host}:{port}"
        adopted = self._adopt(adoptable(orphans)) if adopt_on else []
        left = left_to_their_roles(orphans, adopted)
        stopped = kill_orphans(left)
        if stopped:
            log.warning("stopped roles an earlier agent of this host left behind: pids %s", stopped)
        self._take_ended(records, stopped={o.role for o in left})
        for target, name in ((self._watch, "watch"), (self._link, "link")):
            thread = threading.Thread(target=target, name=f"psctl-agent-{name}-{self.host}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _adopt(self, orphans: Sequence[Orphan]) -> list[Orphan]:
        """Take over running roles an earlier agent started; returns those it took."""
        adopted = []
        with self.lock:
            for orphan in orphans:
                record = orphan.record or {}
                try:
                    role = RoleProcess.from_record(record, process=AdoptedProcess(orphan),
                                                   create_time=orphan.create_time)
                except (KeyError, TypeError, ValueError):
                    continue
                if role.name in self.roles:
                    continue
                role.cpu_managed = bool(role.cpus_file)
                if role.cpu_managed:  # where it is bound now: a rebind to the same CPU is no move
                    with contextlib.suppress(OSError):
                        bound = sorted(os.sched_getaffinity(orphan.pid))
                        role.cpus = bound if set(bound) != set(allowed_cpus()) else None
                self.roles[role.name] = role
                self._exits.look_only(orphan.pid)  # not a child: its exit shows when it is looked at
                adopted.append(orphan)
                log.info("%s: attempt %d adopted, pid %d (started by an earlier agent of this host)", role.name,
                         role.attempt, orphan.pid)
        return adopted

    def _take_ended(self, records: Sequence[dict[str, Any]], *, stopped: set[str]) -> None:
        """Roles an earlier agent started that ended while no agent watched them (their records are left, their
        processes gone): known as ended, with the code their exit files hold, as if this agent had seen them end.
        Those it has just stopped itself are forgotten: the supervisor finds them missing, and why."""
        with self.lock:
            for record in records:
                try:
                    role = RoleProcess.from_record(record)
                except (KeyError, TypeError, ValueError):
                    continue
                name = role.name
                if name in self.roles:  # adopted: running
                    continue
                if name not in stopped:
                    role.exit_code = ended_code(role.exit_file, role.log_path)
                    role.tail = log_tail(role.log_path)
                    self.roles[name] = role
                    log.info("%s: attempt %d ended with %d while no agent watched it", name, role.attempt,
                             role.exit_code)
                _forget_files(role)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the agent's threads to end (after ``wait``: they were told
        to), so that none is cut off half-way by the interpreter's exit."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Leave the roles running and stop serving (a test's or a benchmark's end; ``Shutdown`` stops roles)."""
        self._done.set()
        self._exits.wake()  # the watch thread ends now, not at its next look
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)
        if self._server is not None:
            self._server.stop(grace=0.2)

    # -- heartbeats -----------------------------------------------------------------------------------
    def on_heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Record a role's heartbeat; fenced if the agent does not run that incarnation of it (replaced)."""
        job = request.task.partition(":")[0]
        with self.lock:
            role = self.roles.get(member_of_task(request.task))
            if role is None or role.incarnation != request.incarnation or not role.running:
                return pb.HeartbeatResponse(fenced=True)
            if role.last_beat is None:  # its first: the supervisor learns at once that it runs
                self._poke(changed=True)
            role.last, role.last_beat = request, self.time()
            view = self.view
        response = pb.HeartbeatResponse()
        if job in view.addresses:
            response.addresses.update(view.addresses[job].addresses)
        if job in ("ps", "worker"):  # they refuse a replaced chief that still runs somewhere (see fencing)
            response.chief_incarnation = view.chief_incarnation
        return response

    # -- commands -------------------------------------------------------------------------------------
    def handle(self, command: pb.AgentCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start":
            self._start(command.start)
        elif kind == "stop":
            with self.lock:
                role = self.roles.get(command.stop.name)
                if role is None or command.stop.incarnation not in (0, role.incarnation):
                    return
                if not self._begin_stop(role, command.stop.grace_seconds):
                    return  # sent again while the role is stopping (each report of it): nothing new to say
        elif kind == "view":
            with self.lock:
                self.view = command.view
        elif kind == "cpus":
            with self.lock:
                self._rebind(command.cpus)
        elif kind == "shutdown":
            self.handle_shutdown(command.shutdown.grace_seconds)
        self._poke(changed=kind in ("start", "stop"))

    def _poke(self, *, changed: bool) -> None:
        """Report soon; ``changed``: mark that report changed (a role started, began to stop, first beat)."""
        if changed:
            self._role_changed.set()
        self._report_now.set()
        self._exits.wake()

    def handle_shutdown(self, grace: float) -> None:
        """Stop every role and end, in a thread of its own (safe from a signal handler; once)."""
        if not self._stopping.is_set():
            self._stopping.set()
            threading.Thread(target=self._shutdown, args=(grace,), daemon=True,
                             name=f"psctl-agent-shutdown-{self.host}").start()

    def _begin_stop(self, role: RoleProcess, grace: float) -> bool:
        """SIGTERM the role (SIGKILL where ``grace`` <= 0) and note when SIGKILL follows; True if that began a
        stop or brought its SIGKILL forward. The supervisor sends a stop again with each report that shows the
        role still running: those must not signal it again (one SIGTERM per stop; a role's handler runs once).
        """
        if not role.running:
            return False
        deadline = self.time() + max(0.0, grace)
        if role.kill_at is not None and deadline >= role.kill_at:
            return False
        if grace <= 0:
            role.signal(signal.SIGKILL)
        elif role.kill_at is None:
            role.signal(signal.SIGTERM)
        role.kill_at = deadline
        return True

    def _start(self, command: pb.StartRole) -> None:
        with self.lock:
            old = self.roles.get(command.name)
            if old is not None and old.incarnation == command.incarnation:
                return  # a command sent again after a reconnect
            if old is not None and old.running:  # replaced here: the old process must not answer on its port
                old.signal(signal.SIGKILL)
                if not self._reap(old, timeout=5.0):  # not gone yet: no longer watched (its pidfd would stay ready)
                    assert old.process is not None
                    self._exits.forget(old.process.pid)
            role = RoleProcess(command.name, command.incarnation, command.attempt, host_path(command.log_path),
                               watched_only=command.watched_only)
            self.roles[command.name] = role
            try:
                for path, data in command.files.items():
                    write_private(host_path(path), data)
                os.makedirs(os.path.dirname(role.log_path), mode=0o700, exist_ok=True)
                fd = os.open(role.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                self._assign_cpu(command, role)
                if command.watched_only:  # a framework's program leaves no exit code: its keeper does
                    _check_program(command)
                    command.argv[:] = keeper_argv(sys.executable, command.argv)
                # the role leaves its exit code, so that a later agent may adopt it
                role.exit_file = os.path.splitext(role.log_path)[0] + ".exit"  # beside its log
                with contextlib.suppress(FileNotFoundError):
                    os.remove(role.exit_file)  # an earlier attempt's of the same number (a cluster of that name)
                command.env[EXIT_FILE_VARIABLE] = role.exit_file
                record = adoption_record(
                    name=role.name, incarnation=role.incarnation, attempt=role.attempt, argv=command.argv,
                    log_path=role.log_path, exit_file=role.exit_file, cpus_file=role.cpus_file,
                    heartbeats=self.heartbeat_address, watched_only=command.watched_only, cluster_id=self.cluster_id)
                command.env[ADOPTION_VARIABLE] = record
                write_private(record_path(role.log_path), record.encode())  # for an agent after its end
                try:
                    role.process = self.spawn(command, fd)
                finally:
                    os.close(fd)
                role.create_time = create_time(role.process.pid)
                if isinstance(role.process, subprocess.Popen):
                    self._exits.watch(role.process.pid)
                else:  # a stand-in (benchmarks): its exit shows only when it is looked at
                    self._exits.look_only(role.process.pid)
                log.info("%s: attempt %d started, pid %d", command.name, command.attempt, role.process.pid)
            except (OSError, ValueError) as exc:
                where = command.argv[0] if command.argv else "(empty argv)"
                role.start_error = f"cannot start {where}: {exc}"
                log.warning("%s: %s", command.name, role.start_error)

    def _assign_cpu(self, command: pb.StartRole, role: RoleProcess) -> None:
        """Name the role's CPU in its environment, where the supervisor gave it a slot and this host has fewer
        CPUs than roles: the role binds itself to it once started (a worker or the evaluator also yields it to
        the ps and the chief: psctl.launch.cpus)."""
        if not command.cpu_slots:
            return
        role.cpu_managed = True
        role.cpus_file = os.path.splitext(role.log_path)[0] + ".cpus"  # beside its log: logs/worker-0.3.cpus
        with contextlib.suppress(FileNotFoundError):
            os.remove(role.cpus_file)  # an earlier cluster's of the same name: this role has not moved yet
        command.env[CPUS_FILE_VARIABLE] = role.cpus_file
        cpus = self._cpus.for_slot(command.cpu_slot, command.cpu_slots)
        if cpus is not None:
            command.env[CPUS_VARIABLE] = cpu_list(cpus)
            role.cpus = cpus
            log.info("%s: CPU %s (slot %d of %d roles here)", command.name, cpu_list(cpus), command.cpu_slot,
                     command.cpu_slots)  # fmt: skip

    def _rebind(self, slots: pb.CpuSlots) -> None:
        """The host's roles changed (psctl scale, a role moved, the host answered again after a cut): move each
        running role this agent gave a slot to onto the CPU its slot now names, or onto every CPU where the roles
        no longer outnumber them (caller holds the lock). A role restarted later gets its slot in its start."""
        allowed = allowed_cpus()
        for name, slot in slots.cpu_slot.items():
            role = self.roles.get(name)
            if role is None or not role.running or not role.cpu_managed:
                continue
            cpus = self._cpus.for_slot(slot, slots.cpu_slots)
            if cpus == role.cpus:
                continue
            assert role.process is not None
            # bound, a worker or the evaluator yields its CPU to the ps and the chief (psctl.launch.cpus)
            move = Move(cpu_list(cpus or allowed), yielding=cpus is not None and yields(name))
            try:  # first, for a role that has not bound itself yet: it binds itself there, not to its start's
                write_private(role.cpus_file, move.text().encode())
            except OSError as exc:
                log.warning("%s: cannot write %s: %s; a role not yet bound may bind to its first CPU",
                            name, role.cpus_file, exc)  # fmt: skip
            if bind(role.process.pid, cpus or allowed):
                role.cpus = cpus
                log.info("%s: now on CPU(s) %s (slot %d of %d roles here)", name, move.cpus, slot,
                         slots.cpu_slots)  # fmt: skip
            if isinstance(role.process, subprocess.Popen) and not set_yielding(role.process.pid, move.yielding):
                log.warning("%s: cannot set its priority %s; it runs as it was", name,
                            "to yield its CPU" if move.yielding else "back to the usual")  # fmt: skip

    def _shutdown(self, grace: float) -> None:
        """Stop every role (SIGTERM, SIGKILL after ``grace``), report their exits, then end."""
        with self.lock:
            for role in self.roles.values():
                self._begin_stop(role, grace)
            self._exits.wake()  # the watch thread's next SIGKILL is due sooner
            self._reaped.wait_for(lambda: not any(r.running for r in self.roles.values()), timeout=grace + 5.0)
        strays = end_strays(self.cluster_id, self.host)
        if strays:
            log.warning("stopped %d process(es) its roles left running (daemons?): pid(s) %s", len(strays),
                        ", ".join(map(str, strays)))
        self._send(self.report(changed=True))
        outbox = self._outbox
        if outbox is not None:
            outbox.put(None)  # ends the stream: the supervisor has the last report before the agent goes
        self._done.set()
        self._exits.wake()

    # -- watching -------------------------------------------------------------------------------------
    def _reap(self, role: RoleProcess, *, timeout: float = 0.0) -> bool:
        """Collect the role's exit if it has one (waiting up to ``timeout``); True if it exited just now."""
        if not role.running:
            return False
        assert role.process is not None
        if isinstance(role.process, subprocess.Popen) and exited_uncollected(role.process.pid):
            end_group(role.process.pid)  # what it left in its group: nothing signals that group again
        deadline = self.time() + timeout
        code = role.process.poll()
        while code is None and self.time() < deadline:
            time.sleep(0.01)
            code = role.process.poll()
        if code is None:
            return False
        role.exit_code, role.kill_at = code, None
        self._exits.forget(role.process.pid)
        _forget_files(role)
        role.tail = log_tail(role.log_path)
        log.info("%s: attempt %d exited with %d", role.name, role.attempt, code)
        return True

    def _watch(self) -> None:
        try:
            self._watch_roles()
        finally:
            self._exits.close()

    def _watch_roles(self) -> None:
        next_report = self.time()
        while not self._done.is_set():
            now = self.time()
            changed = False
            wake_at = next_report
            with self.lock:
                for role in self.roles.values():
                    changed |= self._reap(role)
                    if role.running and role.kill_at is not None and now >= role.kill_at:
                        if not role.killed:
                            log.warning("%s: still running at the end of its stop's grace: SIGKILL (it did not end "
                                        "on SIGTERM)", role.name)
                            role.killed = True
                        role.signal(signal.SIGKILL)
                        role.kill_at = now + 1.0  # again, should the group have left a process behind
                    if role.running and role.kill_at is not None:
                        wake_at = min(wake_at, role.kill_at)
                if changed:
                    self._reaped.notify_all()
            changed |= self._role_changed.is_set()
            if changed or self._report_now.is_set() or now >= next_report:
                self._role_changed.clear()
                self._report_now.clear()
                self._send(self.report(changed=changed))
                next_report = now + self.interval
                wake_at = min(wake_at, next_report)
            # until the next report or SIGKILL is due, unless a role exits or a command, a first heartbeat or a
            # stop pokes it first; children no pidfd shows are looked at every WATCH_INTERVAL
            timeout = min(max(0.0, wake_at - now), self.interval)
            self._exits.wait(min(timeout, WATCH_INTERVAL) if self._exits.blind() else timeout)

    def report(self, *, hello: bool = False, changed: bool = False) -> pb.AgentReport:
        """Every role's state now; ``changed``: sent because a role started, exited, was told to stop or sent its
        first heartbeat (see AgentReport.changed)."""
        now = self.time()
        with self.lock:
            roles = [role.report(now) for role in self.roles.values()]
        return pb.AgentReport(host=self.host, agent_pid=self.pid, agent_create_time=self.pid_create_time,
                              heartbeat_address=self.heartbeat_address, hello=hello, roles=roles, changed=changed)

    # -- the stream to the supervisor -----------------------------------------------------------------
    def _send(self, report: pb.AgentReport) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.put(report)

    def _link(self) -> None:
        """Keep one stream to the supervisor: dial, say hello, carry out its commands; dial again when it
        breaks (the roles go on meanwhile)."""
        backoff = 0.1
        alone_since = self.time()
        while not self._done.is_set():
            if self.time() - alone_since > ORPHAN_TIMEOUT and not any(r.running for r in list(self.roles.values())):
                log.warning("no supervisor for %.0fs and no role to keep: exiting", ORPHAN_TIMEOUT)
                self._done.set()
                break
            channel = make_channel(self.supervisor, self.tls, keepalive_ms=LINK_KEEPALIVE_MS)
            outbox: queue.SimpleQueue[pb.AgentReport | None] = queue.SimpleQueue()
            outbox.put(self.report(hello=True))
            self._outbox = outbox
            try:
                for command in pb_grpc.AgentLinkStub(channel).Attach(_drain(outbox)):
                    backoff, alone_since = 0.1, float("inf")  # attached
                    self.handle(command)
            except grpc.RpcError as exc:
                if not self._done.is_set():
                    log.info("supervisor at %s: %s; dialling again", self.supervisor, exc.code().name)
            finally:
                self._outbox = None
                outbox.put(None)
                channel.close()
                alone_since = min(alone_since, self.time())
            if self._stopping.is_set():
                self._done.wait(10.0)  # the shutdown ends the agent
            self._done.wait(backoff)
            backoff = min(2 * backoff, MAX_RECONNECT_BACKOFF)


def _forget_files(role: RoleProcess) -> None:
    """Remove what the role's end no longer needs beside its log (a restart gets files of its own): its CPU
    file, exit file and adoption record."""
    for done_with in (role.cpus_file, role.exit_file, record_path(role.log_path)):
        if done_with:
            with contextlib.suppress(OSError):
                os.remove(done_with)


def _drain(outbox: queue.SimpleQueue[pb.AgentReport | None]) -> Iterator[pb.AgentReport]:
    while (item := outbox.get()) is not None:
        yield item


def write_private(path: str, data: bytes) -> None:
    """Write a file readable by its owner only (the folder is created, mode 0700), replacing it atomically."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}.part"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(partial, path)

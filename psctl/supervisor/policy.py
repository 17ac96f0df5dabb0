"""The supervisor's rules: ``decide(state, observations, now) -> list[Action]``.

A pure policy: it reads what the agents reported (:class:`Report`, :class:`Detached`, ...), changes the
cluster's record and its own bookkeeping, and returns what must be done (:class:`StartRole`,
:class:`StopRole`, :class:`WriteEvent`, ...). It does no I/O, starts no thread and reads no clock: ``now`` (a
monotonic time) is the only clock, so that tests drive it step by step. The I/O shell
(:mod:`psctl.supervisor.daemon`) carries the actions out.

Every state change goes through :func:`transition` / :func:`cluster_transition`, which refuse a change the
tables below do not allow (see :mod:`psctl.supervisor.state` for the diagram).
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field

from psctl.proto import psctl_pb2 as pb
from psctl.runtime.exits import EXIT_PREEMPTED, EXIT_TRAINING_OVER, EXITING
from psctl.runtime.log_format import LOG_TIME
from psctl.spec import ClusterSpec
from psctl.supervisor.hosts import DIALED_ROLES, HostBench, Occupant, restart_host
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState

R, C = RoleState, ClusterState
ROLE_TRANSITIONS: dict[RoleState, frozenset[RoleState]] = {
    R.PENDING: frozenset({R.STARTING, R.FAILED, R.STOPPED}),
    R.STARTING: frozenset({R.RUNNING, R.SUCCEEDED, R.LOST, R.FAILED, R.STOPPED}),
    R.RUNNING: frozenset({R.STALLED, R.SUCCEEDED, R.LOST, R.FAILED, R.STOPPED}),
    R.STALLED: frozenset({R.RUNNING, R.SUCCEEDED, R.LOST, R.FAILED, R.STOPPED}),
    R.LOST: frozenset({R.RESTARTING, R.FAILED, R.STOPPED}),
    R.RESTARTING: frozenset({R.STARTING, R.RUNNING, R.FAILED, R.STOPPED}),  # (running: taken back, see take_back)
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.STOPPED: frozenset(),
}
CLUSTER_TRANSITIONS: dict[ClusterState, frozenset[ClusterState]] = {
    C.STARTING: frozenset({C.RUNNING, C.SUCCEEDED, C.FAILED, C.STOPPING, C.STOPPED}),
    C.RUNNING: frozenset({C.SUCCEEDED, C.FAILED, C.STOPPING, C.STOPPED}),
    C.STOPPING: frozenset({C.STOPPED, C.SUCCEEDED, C.FAILED}),
    C.SUCCEEDED: frozenset(),
    C.FAILED: frozenset(),
    C.STOPPED: frozenset(),
}

#: Roles whose exit with code 0 means their job is done. ps and workers serve until told to stop, so any
#: exit of theirs while training runs (preemption sends SIGTERM, which they answer with exit 0) is a loss.
FINISHING_ROLES = ("chief", "evaluator")
#: A role running this many times max_backoff_seconds counts as stable: its failures in a row reset.
STABLE_FACTOR = 10.0
#: Seconds an evaluator gets, after training finished, to evaluate the final checkpoint.
EVALUATOR_GRACE = 120.0
#: A role whose last heartbeat said it exits (psctl.runtime.exits.EXITING) is taken for hung only this many
#: seconds after the heartbeat timeout (a preempted role that took longer to end than the timeout was killed as
#: hung, and counted as a failure).
EXIT_ALLOWANCE = 30.0
#: How often a role waiting for its host to answer looks again.
HOST_WAIT = 1.0
#: How often an agent is started again on a host where none is attached.
AGENT_RETRY = 3.0
#: Grace, in seconds, of the stops the policy orders on its own (a replaced or lost process: SIGKILL).
KILL = 0.0


class IllegalTransition(RuntimeError):
    """A state change the transition tables do not allow: a bug in the policy, never a user's mistake."""


# -- observations: what the shell saw ----------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """An agent's report (its first on a stream is its hello), received at ``at`` (monotonic)."""

    host: str
    at: float
    report: pb.AgentReport


@dataclass(frozen=True)
class Detached:
    """The stream of the agent ``agent_pid`` of ``host`` ended."""

    host: str
    agent_pid: int
    reason: str


@dataclass(frozen=True)
class AgentStartFailed:
    """The shell could not start (or find) an agent on ``host``: the host did not answer, say."""

    host: str
    reason: str


@dataclass(frozen=True)
class AgentAlive:
    """An agent of ``host`` from before runs (a restarted supervisor waits for it to dial in)."""

    host: str


@dataclass(frozen=True)
class SupervisorStalled:
    """The supervisor itself did not run for ``seconds`` (stopped, its VM paused, swapped out, starved of CPU):
    what its agents sent meanwhile is still on its way in, so silence is counted from now, not from before."""

    seconds: float


@dataclass(frozen=True)
class StopRequested:
    grace: float
    reason: str = "stopped by psctl down"


@dataclass(frozen=True)
class Slot:
    """Where replica ``index`` of a role goes if it is added (the shell picks free ports on this machine)."""

    index: int
    host: str
    address: str
    port: int
    #: backend slurm: the node of the job it runs on (its address too).
    node: str = ""


@dataclass(frozen=True)
class ScaleRequested:
    """``psctl scale``: ``role`` (ps or worker) should have ``replicas`` replicas; ``slots`` places the ones that
    may be added."""

    role: str
    replicas: int
    slots: tuple[Slot, ...] = ()


Observation = Report | Detached | AgentStartFailed | AgentAlive | StopRequested | ScaleRequested | SupervisorStalled


# -- actions: what the shell must do ---------------------------------------------------------------------
@dataclass(frozen=True)
class StartAgent:
    """Start the host's agent, unless the one it has still runs (``replace``: stop that one first)."""

    host: str
    replace: bool = False


@dataclass(frozen=True)
class StartRole:
    name: str
    host: str
    incarnation: int
    attempt: int


@dataclass(frozen=True)
class StopRole:
    name: str
    host: str
    incarnation: int
    grace: float


@dataclass(frozen=True)
class SendView:
    """Tell the agents (of ``host``; None: all) where the dialled roles are and the chief's incarnation."""

    host: str | None = None


@dataclass(frozen=True)
class RebindCpus:
    """The roles of ``host`` changed (scaled, or one moved there or away): tell its agent (if it has one
    attached) each role's CPU slot among them now."""

    host: str


@dataclass(frozen=True)
class WriteEvent:
    subject: str
    was: str
    to: str
    reason: str
    attempt: int | None = None


@dataclass(frozen=True)
class Finish:
    """Training is over (or the cluster failed or was stopped): the stops are ordered; the shell collects the
    result, then calls :func:`conclude`."""

    state: ClusterState
    reason: str
    grace: float


Action = StartAgent | StartRole | StopRole | SendView | RebindCpus | WriteEvent | Finish


# -- the state the policy keeps --------------------------------------------------------------------------
@dataclass
class RoleLive:
    """What the policy knows of a role beyond its persisted record (monotonic times)."""

    started: float = 0.0
    last_heartbeat: float | None = None
    #: Its last heartbeat said it exits (EXITING).
    exiting: bool = False
    restart_at: float | None = None
    #: The role's progress counter (a worker's local step, the chief's global step) and when it last moved.
    progress: int = -1
    progressed_at: float = 0.0
    #: Restarts since the role last ran stably: drives the backoff and the max_restarts limit, so a long job
    #: whose worker is preempted now and then is not failed for good by its eleventh preemption.
    failures_in_a_row: int = 0
    running_since: float | None = None
    #: When a new agent of its host said it runs (its hello, after adopting it): until then its heartbeats had
    #: no agent to go to, so its silence is counted from here.
    vouched_at: float | None = None
    #: The host it was lost with (cut off, down to the supervisor), or its restart waits for (see waits_for_host):
    #: if that host answers with its process still running there, beating, it is taken back (see take_back).
    waits_for: str | None = None
    #: The error of the program's own text (PROGRAM_ERRORS) its last loss ended with, if it was one.
    last_program_error: str | None = None


@dataclass
class HostLive:
    """One host as its agent's stream shows it."""

    remote: bool
    address: str
    attached: bool = False
    agent_pid: int = 0
    last_report: float | None = None
    heartbeat_address: str = ""
    #: Why no agent is attached (None: one is, or none was asked for yet).
    error: str | None = None
    agent_asked_at: float | None = None
    #: Since when an agent that runs there has been expected to dial in (see AgentAlive).
    awaited_since: float | None = None
    #: The reachability last written to the events (first attach: "starting" -> "reachable").
    shown: str = "starting"


@dataclass
class PolicyState:
    record: ClusterRecord
    spec: ClusterSpec
    hosts: dict[str, HostLive]
    #: ``time.time() - now``: turns the policy's clock into the wall-clock times the record shows.
    wall_offset: float
    bench: HostBench = field(init=False)
    roles: dict[str, RoleLive] = field(init=False)
    #: job -> the addresses a role of that job follows (see :func:`address_map`).
    addresses: dict[str, dict[str, str]] = field(init=False)
    evaluator_deadline: float | None = None
    finishing: bool = False
    #: The restart backoff's jitter (tests may seed it).
    rng: random.Random = field(default_factory=random.Random)
    #: The grace of the stops that end the cluster (``psctl down --grace``).
    stop_grace: float = 5.0
    #: Since when silence counts: the end of the supervisor's own last stall (see SupervisorStalled), during
    #: which it heard nothing whoever spoke (see _Decision.silent_since).
    heard_from: float = float("-inf")

    def __post_init__(self) -> None:
        sup = self.spec.supervision
        self.bench = HostBench(failures=sup.bench_after_failures, window=sup.bench_window, cooloff=sup.bench_cooloff)
        self.roles = {r.name: RoleLive() for r in self.record.roles}
        self.addresses = address_map(self.spec, self.record)

    @property
    def chief(self) -> RoleRecord | None:
        return next((r for r in self.record.roles if r.role == "chief"), None)

    def chief_incarnation(self) -> int:
        chief = self.chief
        return chief.incarnation if chief is not None else 0

    def adopt(self, now: float) -> None:
        """A restarted supervisor: the roles the record shows running are given one heartbeat timeout for
        their agents to dial in and report them (then they are adopted as they are, nothing restarted)."""
        for role in self.record.roles:
            if role.state in (R.STARTING, R.RUNNING, R.STALLED):
                live = self.roles[role.name]
                live.started = now
                live.last_heartbeat = now
                live.running_since = now if role.state != R.STARTING else None
            elif role.state in (R.LOST, R.RESTARTING):
                self.roles[role.name].restart_at = now


def address_map(spec: ClusterSpec, record: ClusterRecord) -> dict[str, dict[str, str]]:
    """Every ps's and worker's address for the chief (which ones there are: psctl scale; where they are: moves),
    every ps's for a worker (it talks to no other worker: a reply stays O(ps)), none for others."""
    chief = {f"{r.role}:{r.index}": r.endpoint for r in record.roles if r.role in DIALED_ROLES and not r.retired}
    return {"chief": chief, "worker": {task: at for task, at in chief.items() if task.startswith("ps:")}}


def members(record: ClusterRecord, role: str) -> list[RoleRecord]:
    """The replicas of ``role`` that belong to the cluster now (not scaled away), by index."""
    return sorted((r for r in record.roles if r.role == role and not r.retired), key=lambda r: r.index)


def reported_ps_layout(chief: RoleRecord | None) -> int | None:
    """How many ps the chief last said its variables lie on (its ``ps_layout`` metric); None before it said."""
    layout = chief.metrics.get("ps_layout") if chief is not None else None
    return int(layout) if layout else None


def chief_ps_layout(record: ClusterRecord) -> list[RoleRecord] | None:
    """The ps a chief starts on while its last layout (``ps_layout``, as it reported it) is not the cluster's ps
    count (psctl scale ps=N, the chief lost before it resharded): the first ``ps_layout`` ps by index, a retired
    one among them, so that it resumes from the variables they hold and then reshards, instead of restoring the
    latest checkpoint onto the new layout. None where its layout is the cluster's (or unknown)."""
    layout = reported_ps_layout(next((r for r in record.roles if r.role == "chief"), None))
    if layout is None or layout == len(members(record, "ps")):
        return None
    ps = sorted((r for r in record.roles if r.role == "ps" and r.index < layout), key=lambda r: r.index)
    return ps if len(ps) == layout else None


def cluster_view(state: PolicyState, *, for_chief: bool = True) -> pb.ClusterView:
    """What the agents answer their roles' heartbeats with: the dialled roles' addresses, the chief's incarnation.
    Every worker's address goes only to the chief's host (``for_chief``): with a thousand workers, the other
    hosts' agents would get tens of kB each they never use."""
    view = pb.ClusterView(chief_incarnation=state.chief_incarnation())
    for job, addresses in state.addresses.items():
        if job != "chief" or for_chief:
            view.addresses[job].addresses.update(addresses)
    return view


#: How a role of psctl's runtime says it left once stopped (psctl.runtime.__main__), in its log's last lines.
_STOPPING = re.compile(r" stopping: ([^|]+)")


def describe_exit(code: int) -> str:
    if code == EXIT_PREEMPTED:
        return "preempted (stopped by SIGTERM)"
    if code == EXIT_TRAINING_OVER:
        return "ended by itself: training was over"
    if code == -255:
        return "exited (code unknown)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


#: A log line that says why a role ended: one logged at ERROR or CRITICAL (the runtime's and most programs'
#: format), the last line of a Python traceback (``ValueError: ...``), or a native crash (the agent's one-line
#: summary of the fault handler's report, whatever leads it: ``psctl.agent.logs``).
_CAUSE = re.compile(LOG_TIME + r"(?:ERROR|CRITICAL) (?P<logged>.+)"
                    r"|(?P<raised>[\w.]*(?:Error|Exception|Exit|Interrupt)(?:: .+)?)"
                    r"|(?P<fatal>.*Fatal Python error: .+)")


def _causes(tail: str) -> list[re.Match[str]]:
    return [m for m in map(_CAUSE.fullmatch, tail.split(" | ")) if m]


def exit_text(code: int, tail: str) -> str:
    """How a role ended (``describe_exit``) and why, as the end of its log (``tail``: its last lines joined by
    `` | ``) says it: the last line that gives a cause, else those last lines."""
    what = describe_exit(code)
    causes = [m.group("logged") or m.group("raised") or m.group("fatal") for m in _causes(tail)]
    if causes:
        said = _GRPC_DETAILS.search(tail) if causes[-1].endswith("of RPC that terminated with:") else None
        if said:  # (a gRPC error's first line says only that: its status and details are the lines after it)
            return f"{what}: {causes[-1].split(':', 1)[0]}: {said['status']}: {said['details']}"
        return f"{what}: {causes[-1]}"
    return what + (f"; last log lines: {tail}" if tail else "")


_GRPC_DETAILS = re.compile(r"status = StatusCode\.(?P<status>\w+) \| \s*details = \"(?P<details>.*?)\"(?: \||$)")


#: Exceptions of a program's own text: a role that ends with the same one twice in a row would raise it again
#: however often it was restarted (a TensorFlow program's typo met at step 100 cost ~10 restarts, minutes of
#: them). Twice, not once: an ImportError can be one host's (a file system that failed for a moment).
PROGRAM_ERRORS = frozenset({"SyntaxError", "IndentationError", "TabError", "NameError", "UnboundLocalError",
                            "ImportError", "ModuleNotFoundError"})


def program_error(tail: str) -> str | None:
    """The exception line a log's ``tail`` ends with (its last cause) where it is one of PROGRAM_ERRORS; none
    where the interpreter reported errors while it shut down (``Exception ignored in``: a NameError of a
    module's globals gone, not the program's)."""
    if "Exception ignored in" in tail:
        return None
    causes = _causes(tail)
    raised = causes[-1].group("raised") if causes else None
    return raised if raised and exception_kind(raised) in PROGRAM_ERRORS else None


def exception_kind(raised: str) -> str:
    """``NameError`` of ``NameError: name 'x' ...`` (``a.b.UnavailableError: ...``: ``UnavailableError``)."""
    return raised.split(":", 1)[0].rsplit(".", 1)[-1]


def role_of_task(task: str) -> str:
    job, _, index = task.partition(":")
    return f"{job}-{index}"


# -- the policy --------------------------------------------------------------------------------------------
def decide(state: PolicyState, observations: Iterable[Observation], now: float) -> list[Action]:
    """Apply what was observed, then look at every role and host at ``now``; returns what to do."""
    decision = _Decision(state, now)
    for observation in observations:
        decision.observe(observation)
    decision.tick()
    return decision.actions


def conclude(state: PolicyState, how: ClusterState, reason: str) -> list[Action]:
    """The cluster's final transition, once the shell has stopped its roles and read the result."""
    decision = _Decision(state, 0.0)
    if not state.record.state.terminal:
        decision.cluster_transition(how, reason)
    return decision.actions


def transition(role: RoleRecord, to: RoleState, reason: str = "") -> WriteEvent | None:
    """Change a role's state (a change to itself just updates the reason); the event to write, if any."""
    if role.state == to and not reason:
        return None
    if role.state != to and to not in ROLE_TRANSITIONS[role.state]:
        raise IllegalTransition(f"{role.name}: {role.state.value} -> {to.value} ({reason})")
    event = WriteEvent(role.name, role.state.value, to.value, reason, attempt=role.attempt)
    role.state = to
    if reason:
        role.reason = reason
    return event


class _Decision:
    """One call of :func:`decide`: the state, the time, and the actions gathered so far."""

    def __init__(self, state: PolicyState, now: float) -> None:
        self.s = state
        self.now = now
        self.actions: list[Action] = []
        self.sup = state.spec.supervision

    @property
    def record(self) -> ClusterRecord:
        return self.s.record

    # -- bookkeeping ------------------------------------------------------------------------------------
    def transition(self, role: RoleRecord, to: RoleState, reason: str = "") -> None:
        event = transition(role, to, reason)
        if event is not None:
            self.actions.append(event)
        if to == R.LOST and role.role == "ps" and self.runs_tensorflow():
            self.restart_chief(f"restarted with {role.name}: a TensorFlow coordinator does not outlive a ps; "
                               "the program resumes from its checkpoint")

    def restart_chief(self, why: str) -> None:
        chief = self.s.chief
        if chief is None or chief.state not in (R.STARTING, R.RUNNING, R.STALLED):
            return
        self.transition(chief, R.LOST, why)
        self.actions.append(StopRole(chief.name, chief.host, chief.incarnation, KILL))
        self.restart_uncounted(chief, "with the ps")

    def cluster_transition(self, to: ClusterState, reason: str = "") -> None:
        was = self.record.state
        if was != to and to not in CLUSTER_TRANSITIONS[was]:
            raise IllegalTransition(f"cluster: {was.value} -> {to.value} ({reason})")
        self.actions.append(WriteEvent("cluster", was.value, to.value, reason))
        self.record.state = to
        if reason:
            self.record.reason = reason

    def host_event(self, host: str, was: str, to: str, reason: str) -> None:
        """Log a host's change, and what is wrong with it now in the record (for status)."""
        self.actions.append(WriteEvent(f"host {host}", was, to, reason))
        self.show_host_problems(host)

    def show_host_problems(self, host: str) -> None:
        h = self.s.hosts[host]
        problems = []
        if h.error:
            # (an SSH error says so itself: "host h3 (10.0.0.3:22): unreachable: connection timed out ...")
            problems.append(h.error if "unreachable" in h.error else f"unreachable: {h.error}")
        until = self.s.bench.benched_until(host)
        if until is not None and self.s.bench.is_benched(host, self.now):
            problems.append(f"benched for {until - self.now:.0f}s more (roles that can move start elsewhere)")
        if problems:
            self.record.host_problems[host] = "; ".join(problems)
        else:
            self.record.host_problems.pop(host, None)

    def usable_now(self, host: str) -> bool:
        """Whether ``host``'s agent is attached and its reports are not overdue."""
        h = self.s.hosts.get(host)
        if h is None or not h.attached or h.last_report is None:
            return False
        return self.now - h.last_report <= max(2.5, 2.5 * self.sup.heartbeat_interval)

    def usable(self, host: str) -> bool:
        return self.usable_now(host) and not self.s.bench.is_benched(host, self.now)

    # -- observations -----------------------------------------------------------------------------------
    def observe(self, observation: Observation) -> None:
        if isinstance(observation, Report):
            self.on_report(observation)
        elif isinstance(observation, Detached):
            h = self.s.hosts.get(observation.host)
            if h is not None and h.attached and h.agent_pid == observation.agent_pid:
                self.detach(observation.host, observation.reason)
        elif isinstance(observation, AgentStartFailed):
            self.on_agent_start_failed(observation.host, observation.reason)
        elif isinstance(observation, AgentAlive):
            h = self.s.hosts.get(observation.host)
            if h is not None and not h.attached:
                h.agent_asked_at = self.now  # it dials in: no new agent for a while
                h.awaited_since = h.awaited_since if h.awaited_since is not None else self.now
        elif isinstance(observation, StopRequested):
            self.finish(ClusterState.STOPPED, observation.reason, grace=observation.grace)
        elif isinstance(observation, ScaleRequested):
            self.scale(observation)
        elif isinstance(observation, SupervisorStalled):
            self.s.heard_from = self.now

    def detach(self, host: str, reason: str) -> None:
        h = self.s.hosts[host]
        h.attached, h.error = False, reason
        if h.shown != "unreachable":
            self.host_event(host, h.shown, "unreachable", reason)
            h.shown = "unreachable"
        else:
            self.show_host_problems(host)

    def on_agent_start_failed(self, host: str, reason: str) -> None:
        h = self.s.hosts[host]
        h.error = reason
        waiting = [r for r in self.record.roles if r.host == host and r.state == R.PENDING]
        if self.record.state == C.STARTING and waiting:  # the first start goes where the plan put it
            for role in waiting:
                self.transition(role, R.FAILED, f"cannot start on {host}: {reason}")
            self.finish(ClusterState.FAILED, f"{waiting[0].name} failed to start: cannot start on {host}: {reason}")
            return
        if h.shown != "unreachable":
            self.host_event(host, h.shown, "unreachable", reason)
            h.shown = "unreachable"

    def on_report(self, obs: Report) -> None:
        h = self.s.hosts.get(obs.host)
        if h is None:
            return
        report = obs.report
        if report.hello:
            if h.attached and h.agent_pid not in (0, report.agent_pid):
                self.actions.append(WriteEvent(f"host {obs.host}", "reachable", "reachable",
                                               f"agent pid {report.agent_pid} replaces pid {h.agent_pid}"))
            h.agent_pid = report.agent_pid
            h.heartbeat_address = report.heartbeat_address
            self.actions.append(SendView(obs.host))
        elif report.agent_pid != h.agent_pid:
            return  # an older agent's stream, not closed yet
        h.attached, h.last_report, h.error, h.awaited_since = True, obs.at, None, None
        if h.shown != "reachable":
            self.host_event(obs.host, h.shown, "reachable", "agent attached" if h.shown == "starting"
                            else "answers again")
            if h.shown != "starting":  # its roles may have changed while it was cut off (one moved away)
                self.actions.append(RebindCpus(obs.host))
            h.shown = "reachable"
        reported = set()
        for rr in report.roles:
            reported.add(rr.name)
            self.on_role_report(obs.host, obs.at, rr)
            if report.hello and not rr.exited:
                self.vouch(obs.host, obs.at, rr)
        if report.hello:  # a role this host should run that its agent does not know: the agent was replaced
            for role in self.record.roles:
                if (role.host == obs.host and role.name not in reported
                        and role.state in (R.STARTING, R.RUNNING, R.STALLED)):
                    self.on_lost(role, f"{obs.host}'s agent restarted without it")

    def on_role_report(self, host: str, at: float, rr: pb.RoleReport) -> None:
        try:
            role = self.record.role(rr.name)
        except KeyError:
            role = None
        current = role is not None and role.host == host and rr.incarnation == role.incarnation
        if current and role is not None and role.retired and rr.exited and role.pid is not None:
            role.pid, role.exit_code = None, rr.exit_code  # gone: its slot may be scaled up again
        if (current and role is not None and role.state == R.RESTARTING and not rr.exited
                and self.s.roles[role.name].waits_for == host and 0 <= rr.heartbeat_age < self.sup.heartbeat_timeout):
            self.take_back(role, rr, at)
            return
        if role is None or not current or role.state.terminal or role.state in (R.LOST, R.RESTARTING):
            # Replaced, moved, lost or given up on: that process must go (a stop sent while its host was cut
            # off may never have arrived). A role stopped on purpose keeps its stop's grace (the agent keeps
            # the first deadline: a stop sent again does not shorten it).
            if current and role is not None and role.state.terminal:
                # what it did until it went still counts: a worker stopped at the end of training beats once
                # more on its way out, with the steps it ran since its last periodic beat
                self.take_heartbeat(role, self.s.roles[role.name], rr, at)
            if not rr.exited:
                grace = KILL
                if current and role is not None and role.state == R.STOPPED:
                    grace = self.sup.preemption_grace if role.retired else self.s.stop_grace
                self.actions.append(StopRole(rr.name, host, rr.incarnation, grace))
            return
        live = self.s.roles[role.name]
        if rr.start_error:
            self.lose(role, f"cannot start on {host}: {rr.start_error}")
            return
        if rr.pid and role.pid != rr.pid:
            role.pid, role.create_time = rr.pid, rr.create_time
            role.started_at = live.started + self.s.wall_offset
            self.transition(role, role.state, f"attempt {role.attempt}, pid {rr.pid}")
        if rr.exited:
            # what it reported last still counts: its final heartbeat (an evaluator's last evaluation), or a watched
            # program's step, read from its final lines at exit
            before = live.last_heartbeat
            self.take_heartbeat(role, live, rr, at)
            if live.last_heartbeat == before and rr.last.global_step > role.global_step:
                role.metrics = dict(rr.last.metrics)  # (those it has are of an older step: not shown as this one's)
            role.global_step = max(role.global_step, rr.last.global_step)
            role.exit_code = rr.exit_code
            self.on_exit(role, rr.exit_code, rr.log_tail)
            return
        self.take_heartbeat(role, live, rr, at)

    def take_back(self, role: RoleRecord, rr: pb.RoleReport, at: float) -> None:
        """A role lost with its host (cut off, down to the supervisor), whose restart waited for that host: the
        host answers, and the process still runs there and beats. It is taken back as it is: a restart would
        have cost a ps its updates since the last checkpoint (the chief keeps what every ps still holds)."""
        live = self.s.roles[role.name]
        live.waits_for, live.restart_at, live.running_since = None, None, self.now
        live.failures_in_a_row = max(0, live.failures_in_a_row - 1)
        role.restarts = max(0, role.restarts - 1)  # (the restart it was due never happened)
        self.transition(role, R.RUNNING, f"{role.host} answers again and its process still runs: taken back, "
                                         "not restarted")
        self.take_heartbeat(role, live, rr, at)

    def vouch(self, host: str, at: float, rr: pb.RoleReport) -> None:
        """A new agent's hello says the role runs (it adopted it): its heartbeats had nowhere to go until now."""
        try:
            role = self.record.role(rr.name)
        except KeyError:
            return
        if role.host == host and role.incarnation == rr.incarnation and not role.state.terminal:
            self.s.roles[role.name].vouched_at = at

    def take_heartbeat(self, role: RoleRecord, live: RoleLive, rr: pb.RoleReport, at: float) -> None:
        """The role's progress from the heartbeat its agent reports, if newer than the last one taken."""
        if rr.heartbeat_age < 0:
            return
        beat = at - rr.heartbeat_age
        if live.last_heartbeat is None or beat > live.last_heartbeat:
            live.last_heartbeat = beat
            hb = rr.last
            role.last_heartbeat = beat + self.s.wall_offset
            step = hb.global_step
            if not step and role.role == "chief" and self.runs_tensorflow():
                # a restarted TensorFlow chief prints its step once it has restored (~10 s on): the step it
                # printed last stands until then (status showed step 0: all training lost, it seemed)
                step = role.global_step
            role.global_step, role.local_step = step, hb.local_step
            role.loss = hb.loss if hb.loss == hb.loss else None
            role.steps_per_sec = hb.steps_per_second
            role.rss_bytes = hb.rss_bytes
            role.metrics = dict(hb.metrics)
            live.exiting = hb.status == EXITING

    # -- the look at every host and role ----------------------------------------------------------------
    def tick(self) -> None:
        if self.record.state.terminal or self.s.finishing:
            return
        self.look_at_hosts()
        self.retire_resharded_ps()
        for role in self.record.roles:
            if self.s.finishing:
                return
            self.look_at(role)
        if self.s.finishing:
            return
        if self.s.evaluator_deadline is not None and self.now > self.s.evaluator_deadline:
            self.finish(ClusterState.SUCCEEDED, "training finished (the evaluator was stopped after its grace)")
            return
        if self.record.state == C.STARTING and all(r.state in (R.RUNNING, R.SUCCEEDED) for r in self.record.roles
                                                   if not r.retired):
            self.cluster_transition(C.RUNNING, "every role is up")

    def look_at_hosts(self) -> None:
        timeout = self.sup.heartbeat_timeout
        for name, h in self.s.hosts.items():
            if h.attached and h.last_report is not None:
                silent = self.now - self.silent_since(h.last_report)
                if silent > timeout / 2 and (h.agent_asked_at is None or self.now - h.agent_asked_at >= AGENT_RETRY):
                    # An agent that hangs (or is stopped) on a host that answers: another replaces it and adopts its
                    # roles, vouching for them, before their silence (they beat to it) counts against them. A host
                    # that is down or cut off does not answer the attempt either, and is detached at the timeout.
                    h.agent_asked_at = self.now
                    self.actions.append(StartAgent(name, replace=True))
                if silent > timeout:
                    self.detach(name, f"agent silent for {self.now - h.last_report:.1f}s (host down or cut off)")
            if not h.attached and (h.agent_asked_at is None or self.now - h.agent_asked_at >= AGENT_RETRY):
                h.agent_asked_at = self.now
                # one that runs but never dials in (it cannot find this supervisor) is replaced
                replace = (h.awaited_since is not None
                           and self.now - self.silent_since(h.awaited_since) > self.sup.startup_grace)
                if replace:
                    h.awaited_since = None
                self.actions.append(StartAgent(name, replace=replace))
        for name in self.s.bench.released(self.now):
            self.host_event(name, "benched", "available", "cooling-off ended")

    def look_at(self, role: RoleRecord) -> None:
        live = self.s.roles[role.name]
        if role.state.terminal:
            return
        if role.state == R.PENDING:
            if self.usable_now(role.host):
                self.start_role(role)
            return
        if role.state == R.RESTARTING:
            if (live.restart_at is not None and self.now >= live.restart_at and not self.waits_for_host(role)
                    and not self.waits_for_ps(role)):
                self.start_role(role)
            return
        if role.state == R.LOST:
            return
        if live.last_heartbeat is None:
            if self.now - self.silent_since(live.started) > self.sup.startup_grace:
                self.on_lost(role, f"no heartbeat within the start-up grace of {self.sup.startup_grace:.0f}s")
            return
        if role.state == R.STARTING:
            self.transition(role, R.RUNNING)
            live.running_since = self.now
        policy = self.s.spec.roles[role.role].restart
        if live.running_since is not None and self.now - live.running_since > STABLE_FACTOR * max(
            policy.max_backoff_seconds, 1.0
        ):
            live.failures_in_a_row = 0
        heard = max(live.last_heartbeat, live.vouched_at or 0.0)
        # a role whose last beat said it exits beats no more: its agent reports its end (the process may take a
        # while to go: its program's threads, a loaded machine), so its silence counts for longer
        timeout = self.sup.heartbeat_timeout + (EXIT_ALLOWANCE if live.exiting else 0.0)
        if self.now - self.silent_since(heard) > timeout:
            self.on_lost(role, f"no heartbeat for {self.now - heard:.1f}s (hung or cut off)")
        else:
            self.check_stall(role, live)

    def silent_since(self, heard: float) -> float:
        """When a silence that began at ``heard`` counts from: then, or the end of the supervisor's own last
        stall if later (a role or agent is not judged by time the supervisor did not run)."""
        return max(heard, self.s.heard_from)

    def check_stall(self, role: RoleRecord, live: RoleLive) -> None:
        """A worker or chief whose heartbeats go on but whose step stopped moving, while other workers' steps
        move, is reported STALLED (and RUNNING again once it moves). Reported, not restarted: a slow step is
        the coordinator's to re-schedule past its deadline (``training.step_timeout``), and a worker whose step
        hangs in the program leaves by itself once the chief's deadline for it has passed (see
        ``psctl.runtime.worker``)."""
        if role.role not in ("worker", "chief") or self.runs_tensorflow():
            return  # (a TensorFlow program's workers print no step, its chief one when it will: no stall is told)
        progress = role.local_step if role.role == "worker" else role.global_step
        if progress != live.progress:
            live.progress, live.progressed_at = progress, self.now
            if role.state == R.STALLED:
                self.transition(role, R.RUNNING, "progressing again")
            return
        if role.state != R.RUNNING or self.now - self.silent_since(live.progressed_at) <= self.sup.stall_timeout:
            return
        others = [self.s.roles[r.name] for r in members(self.record, "worker") if r.name != role.name]
        if any(o.progressed_at > live.progressed_at for o in others):
            still = self.now - live.progressed_at
            reason = f"heartbeats arrive but its step has not moved for {still:.0f}s while others progress"
            self.transition(role, R.STALLED, reason)

    # -- starting ---------------------------------------------------------------------------------------
    def start_role(self, role: RoleRecord) -> None:
        live = self.s.roles[role.name]
        self.place_role(role)
        role.attempt += 1
        if not role.hosts_by_attempt or role.hosts_by_attempt[-1][1] != role.host:
            role.hosts_by_attempt.append([role.attempt, role.host])
        was_chief = role.role == "chief"
        role.incarnation = max(role.incarnation + 1, int((self.now + self.s.wall_offset) * 1000))
        role.exit_code = None
        role.last_heartbeat = None
        role.pid = None
        live.restart_at, live.started, live.last_heartbeat, live.waits_for = None, self.now, None, None
        live.progress, live.progressed_at = -1, self.now  # (a new attempt's steps count from its start)
        self.transition(role, R.STARTING, f"attempt {role.attempt} on {role.host}")
        self.actions.append(StartRole(role.name, role.host, role.incarnation, role.attempt))
        if was_chief:
            self.actions.append(SendView())  # ps and workers refuse the replaced chief from now on

    def waits_for_host(self, role: RoleRecord) -> bool:
        """A role due to restart whose host does not answer (and which has no usable host to move to) waits for
        it, looking again every HOST_WAIT: an outage must not use up its restarts."""
        self.place_role(role)
        if self.usable_now(role.host):
            return False
        self.s.roles[role.name].restart_at = self.now + HOST_WAIT
        self.s.roles[role.name].waits_for = role.host
        waiting = f"waiting for {role.host} to answer"
        if not role.reason.startswith(waiting):
            self.transition(role, role.state, waiting)
        return True

    def waits_for_ps(self, role: RoleRecord) -> bool:
        """A TensorFlow chief restarts once every ps runs again: its coordinator connects to them at its start."""
        if role.role != "chief" or self.s.spec.training.get("framework") != "tensorflow":
            return False
        if all(r.state == R.RUNNING for r in self.record.roles if r.role == "ps"):
            return False
        self.s.roles[role.name].restart_at = self.now + HOST_WAIT / 2
        return True

    def place_role(self, role: RoleRecord) -> None:
        """Move a role whose host is cut off or benched to another host of its pool (if one is usable)."""
        if role.attempt == 0:
            return  # the first start goes where the plan put it
        occupants = [Occupant(r.name, r.host, r.port) for r in self.record.roles if not r.state.terminal]
        pool = self.s.spec.roles[role.role].hosts
        target = restart_host(role.name, role.host, role.port, pool, occupants, self.usable)
        if target == role.host:
            return
        old = role.host
        why = self.s.hosts[old].error or ("benched" if self.s.bench.is_benched(old, self.now) else "not usable")
        self.transition(role, role.state, f"moves from {old} to {target} ({why})")
        role.host, role.address = target, self.s.hosts[target].address
        self.s.addresses = address_map(self.s.spec, self.record)
        self.actions.append(SendView())
        self.actions.extend(RebindCpus(host) for host in (old, target))  # both hosts' roles changed

    def lose(self, role: RoleRecord, reason: str, code: int | None = None, raised: str | None = None) -> None:
        """The role's process is gone, or never started: on the cluster's first start that fails the
        cluster (a bad spec or program shows at once); else its restart policy decides (``raised``: a
        PROGRAM_ERRORS exception it ended with)."""
        if role.retired:  # scaled away while it ran
            self.transition(role, R.STOPPED, f"scaled down; {reason}")
            return
        if self.record.state == C.STARTING and role.attempt == 1:
            self.transition(role, R.FAILED, reason)
            self.finish(ClusterState.FAILED, f"{role.name} failed to start: {reason}")
            return
        self.transition(role, R.LOST, reason)
        self.maybe_restart(role, code, raised)

    # -- losing -----------------------------------------------------------------------------------------
    def on_exit(self, role: RoleRecord, code: int, tail: str) -> None:
        what = describe_exit(code)
        # a TensorFlow program's worker ends by itself when its session does (TF1 scripts); psctl's serve
        finishing = FINISHING_ROLES + (("worker",) if self.runs_tensorflow() else ())
        if code == 0 and role.role in finishing:
            self.transition(role, R.SUCCEEDED, "finished")
            if role.role == "chief":
                self.on_training_done()
            elif role.role == "evaluator" and self.s.evaluator_deadline is not None:
                self.finish(ClusterState.SUCCEEDED, "training finished")
            return
        if code == EXIT_TRAINING_OVER and role.role in ("ps", "worker") and not self.runs_tensorflow():
            # told by the chief that training is over, nothing stopped it (a supervisor that died): the
            # training's end, not a loss, whether or not the chief's end is seen first
            self.transition(role, R.SUCCEEDED, "training is over: it ended by itself")
            return
        if self.s.evaluator_deadline is not None:  # training is over; nothing is restarted any more
            self.transition(role, R.FAILED, what)
            self.finish(ClusterState.SUCCEEDED, "training finished (the evaluator did not finish cleanly)")
            return
        if role.retired:
            self.transition(role, R.STOPPED, f"scaled down; {what}")
            return
        if code == EXIT_PREEMPTED:  # not a failure: no count towards max_restarts or benching
            # how it left, as it said (its steps finished, or still running when its grace ran out: re-run)
            how = _STOPPING.findall(tail)
            self.transition(role, R.LOST, f"{what}: {how[-1].strip()}" if how else what)
            self.restart_uncounted(role, "preempted")
            return
        self.lose(role, exit_text(code, tail), code, program_error(tail) if code > 0 else None)

    def runs_tensorflow(self) -> bool:
        """Whether the roles run a TensorFlow program of the user's rather than psctl's runtime."""
        return self.s.spec.training.get("framework") == "tensorflow"

    def on_training_done(self) -> None:
        """Stop ps and workers at once; give a running evaluator time to evaluate the final checkpoint."""
        evaluators = [r for r in self.record.roles if r.role == "evaluator" and not r.state.terminal]
        if not evaluators:
            self.finish(ClusterState.SUCCEEDED, "training finished")
            return
        for role in self.record.roles:
            if role.role in ("ps", "worker") and not role.state.terminal:
                self.actions.append(StopRole(role.name, role.host, role.incarnation, 5.0))
                self.transition(role, R.STOPPED, "training finished")
        self.s.evaluator_deadline = self.now + EVALUATOR_GRACE

    def on_lost(self, role: RoleRecord, reason: str) -> None:
        if role.retired:
            self.actions.append(StopRole(role.name, role.host, role.incarnation, KILL))
            self.transition(role, R.STOPPED, f"scaled down; {reason}")
            return
        self.transition(role, R.LOST, reason)
        if self.usable_now(role.host):  # its agent answers: the process hangs, or is cut off from it
            self.actions.append(StopRole(role.name, role.host, role.incarnation, KILL))
        else:
            # Lost with its host: no stop now (held in the agent's stream, it would arrive when the host answers
            # again and kill a process that may run on unharmed). The host's next report decides: the process
            # taken back if it beats (see take_back), else stopped (on_role_report).
            self.s.roles[role.name].waits_for = role.host
        self.maybe_restart(role, None)

    def maybe_restart(self, role: RoleRecord, code: int | None, raised: str | None = None) -> None:
        policy = self.s.spec.roles[role.role].restart
        live = self.s.roles[role.name]
        # A host that does not answer is not benched for it (its roles wait for it, or move); a host that
        # answers while roles keep failing there is.
        if (self.s.hosts[role.host].remote and self.usable_now(role.host)
                and self.s.bench.record_failure(role.host, self.now)):
            self.host_event(role.host, "available", "benched",
                            f"{self.sup.bench_after_failures} role failures within {self.sup.bench_window:.0f}s; "
                            f"no role that can go elsewhere starts there for {self.sup.bench_cooloff:.0f}s")
        why_not = None
        if policy.policy == "never":
            why_not = "restart policy is never"
        elif code is not None and code in policy.permanent_exit_codes:
            why_not = f"exit code {code} is permanent (a configuration or program error)"
        elif raised is not None and raised == live.last_program_error:
            why_not = (f"a {exception_kind(raised)} is the program's own error, raised again by the restart; fix "
                       "the program, then psctl up again")
        elif live.failures_in_a_row >= policy.max_restarts:
            times = "once" if live.failures_in_a_row == 1 else f"{live.failures_in_a_row} times"
            why_not = (f"restarted {times} in a row, the limit (max_restarts)" if live.failures_in_a_row
                       else "max_restarts is 0")
        live.last_program_error = raised
        if why_not is not None:
            self.transition(role, R.FAILED, f"{role.reason}; not restarted: {why_not}")
            if role.role in ("chief", "ps"):
                self.finish(ClusterState.FAILED, f"{role.name} failed: {role.reason}")
                return
            # workers: training goes on with fewer, down to min_replicas (1 unless the spec says)
            fewest = self.s.spec.roles["worker"].min_replicas
            left = [r for r in members(self.record, "worker") if r.state != R.FAILED]
            if len(left) < fewest:
                more = f"; {len(left)} worker(s) left, fewer than min_replicas ({fewest})" if left else ""
                self.finish(ClusterState.FAILED, f"{role.name} failed: {role.reason}{more}")
            return
        backoff = min(policy.max_backoff_seconds, policy.backoff_seconds * (2**live.failures_in_a_row))
        backoff *= self.s.rng.uniform(0.8, 1.2)  # jitter: roles lost together do not restart in lockstep
        backoff = min(max(backoff, policy.backoff_seconds), policy.max_backoff_seconds)  # (within its bounds)
        role.restarts += 1
        live.failures_in_a_row += 1
        live.running_since = None
        live.restart_at = self.now + backoff
        # (the loss's reason kept: status and up's progress say why it restarts, not only that it does)
        self.transition(role, R.RESTARTING, f"{role.reason}; restart {role.restarts} in {backoff:.1f}s")

    def restart_uncounted(self, role: RoleRecord, why: str) -> None:
        """A role lost through no fault of its own (preempted; a TensorFlow chief whose ps was lost) starts
        again after its policy's first backoff, its failures in a row unchanged."""
        policy = self.s.spec.roles[role.role].restart
        if policy.policy == "never":
            self.transition(role, R.FAILED, f"{role.reason}; not restarted: restart policy is never")
            if role.role in ("chief", "ps"):
                self.finish(ClusterState.FAILED, f"{role.name} failed: {role.reason}")
            return
        role.restarts += 1
        live = self.s.roles[role.name]
        live.running_since = None
        live.restart_at = self.now + policy.backoff_seconds
        self.transition(role, R.RESTARTING, f"restart {role.restarts} in {policy.backoff_seconds:.1f}s ({why})")

    # -- scaling ----------------------------------------------------------------------------------------
    def scale(self, request: ScaleRequested) -> None:
        """``psctl scale``: add replicas (started like any pending role; the chief takes them in through the
        address map) or retire the highest ones. A retired worker is stopped at once with the preemption
        grace (it finishes its step, the chief hands the rest to others); a retired ps once the chief says it
        resharded without it (see retire_resharded_ps)."""
        role_name, wanted = request.role, request.replicas
        now = members(self.record, role_name)
        if self.record.state.terminal or self.s.finishing or wanted == len(now) or wanted < 1:
            return
        why = f"psctl scale {role_name}={wanted}"
        self.actions.append(WriteEvent("cluster", self.record.state.value, self.record.state.value,
                                       f"{why}: {role_name} {len(now)} -> {wanted}"))
        changed: set[str] = set()  # hosts whose roles changed
        if wanted > len(now):
            slots = {slot.index: slot for slot in request.slots}
            for index in range(len(now), wanted):
                slot = slots.get(index)
                if slot is None:
                    continue  # the shell checked the bounds: no slot means no certificate and port for it
                self.add_role(role_name, slot, why)
                changed.add(slot.host)
        else:
            for role in now[wanted:]:
                role.retired = True
                changed.add(role.host)
                if role.role == "worker":
                    self.retire(role, why)
                else:
                    self.transition(role, role.state, f"{why}: leaves once the chief has resharded without it")
        self.s.addresses = address_map(self.s.spec, self.record)
        self.actions.append(SendView())
        self.actions.extend(RebindCpus(host) for host in sorted(changed))

    def add_role(self, role_name: str, slot: Slot, why: str) -> None:
        name = f"{role_name}-{slot.index}"
        role = RoleRecord(name, role_name, slot.index, slot.host, slot.address, slot.port, node=slot.node)
        was = "new"  # (the events table's "from" column)
        with contextlib.suppress(KeyError):
            old = self.record.role(name)  # scaled away before: its attempts (and their logs) count on
            role.attempt, role.hosts_by_attempt, role.restarts = old.attempt, old.hosts_by_attempt, old.restarts
            was = old.state.value
        self.record.put_role(role)
        self.s.roles[name] = RoleLive()
        self.actions.append(WriteEvent(name, was, role.state.value, f"{why}: added on {slot.host}"))

    def retire(self, role: RoleRecord, why: str) -> None:
        if role.state.terminal:
            return
        if role.state in (R.STARTING, R.RUNNING, R.STALLED):
            self.actions.append(StopRole(role.name, role.host, role.incarnation, self.sup.preemption_grace))
        self.transition(role, R.STOPPED, f"{why}: scaled down")

    def retire_resharded_ps(self) -> None:
        """Stop a retired ps once the chief reports its ps layout without it (its variables moved to the
        others), or at once where no chief will train again. A chief lost before it resharded is not a reason:
        its successor starts on the layout it left (see ``chief_ps_layout``), with this ps, and reshards."""
        leaving = [r for r in self.record.roles if r.role == "ps" and r.retired and not r.state.terminal]
        if not leaving:
            return
        chief = self.s.chief
        count = len(members(self.record, "ps"))
        layout = reported_ps_layout(chief)
        if chief is not None and not chief.state.terminal and layout != count:
            return  # (a chief training, or one to start again, reshards first)
        for role in leaving:
            self.retire(role, f"resharded onto {count} ps" if layout == count else "no chief trains any more")

    def finish(self, how: ClusterState, reason: str, *, grace: float = 5.0) -> None:
        """Order every running role stopped and hand over to the shell (once)."""
        if self.record.state.terminal or self.s.finishing:
            return
        self.s.finishing, self.s.stop_grace = True, grace
        why = {ClusterState.STOPPED: reason, ClusterState.FAILED: f"the cluster failed: {reason}"}.get(
            how, "cluster finished")
        for role in self.record.roles:
            if not role.state.terminal:
                self.actions.append(StopRole(role.name, role.host, role.incarnation, grace))
                self.transition(role, R.STOPPED, why)
        self.actions.append(Finish(how, reason, grace))


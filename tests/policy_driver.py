"""Drives the supervisor's pure policy as its I/O shell does, with the hosts' agents simulated as dicts.

A fake is right here: what is under test is the decision logic (restart policy, backoff, placement, benching,
fencing, stalls, completion), not process handling or the agents' streams, which the end-to-end and fault
tests cover with real processes, real agents and real sshd hosts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from psctl.proto import psctl_pb2 as pb
from psctl.spec import load_spec_text, make_plan
from psctl.spec.plan import LOCAL_ADDRESS, LOCAL_HOST
from psctl.supervisor import policy
from psctl.supervisor.policy import HostLive, PolicyState
from psctl.supervisor.state import ClusterRecord, RoleRecord, RoleState


@dataclass
class FakeProcess:
    name: str
    incarnation: int
    attempt: int
    pid: int
    exit_code: int | None = None
    beat: float | None = None
    local_step: int = 0
    global_step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    #: Its heartbeat's status ("exiting" in the last one of a role that exits).
    status: str = "training"
    #: The last lines of its log, as its agent reports them with its exit.
    log_tail: str = ""


class FakeCluster:
    """The policy of one cluster spec over simulated agents. ``step()`` advances the clock, lets every live
    process heartbeat (but the ``silent``), sends each reachable host's report and carries the actions out."""

    def __init__(self, spec_text: str, tmp_path: Path) -> None:
        self.spec = load_spec_text(spec_text, filename=str(tmp_path / "spec.yaml"))
        plan = make_plan(self.spec, check_ports=False)
        self.record = ClusterRecord(
            name=self.spec.name, cluster_id=f"{self.spec.name}-test", tls=False,
            roles=[RoleRecord(i.name, i.role, i.index, i.host, i.address, i.port) for i in plan.instances],
        )
        hosts = {h.name: HostLive(remote=True, address=h.address) for h in self.spec.hosts}
        if any(r.host == LOCAL_HOST for r in self.record.roles):
            hosts[LOCAL_HOST] = HostLive(remote=False, address=LOCAL_ADDRESS)
        self.now = 100.0
        self.state = PolicyState(self.record, self.spec, hosts, wall_offset=1.7e9)
        self.processes: dict[str, dict[str, FakeProcess]] = {h: {} for h in hosts}
        #: Hosts whose agent does not reach the supervisor (cut off): they report nothing, get no command.
        self.cut: set[str] = set()
        self.hello: set[str] = set(hosts)  # hosts whose next report is a hello
        self.actions: list[policy.Action] = []
        self._pids = itertools.count(1000)

    # -- driving --------------------------------------------------------------------------------------
    def step(self, seconds: float = 0.0, *, silent: Sequence[str] = (),
             observations: Sequence[policy.Observation] = ()) -> list[policy.Action]:
        self.now += seconds
        for host, processes in self.processes.items():
            for p in processes.values():
                if p.exit_code is None and p.name not in silent and host not in self.cut:
                    p.beat = self.now
        reports = [policy.Report(h, self.now, self.report(h)) for h in self.processes if h not in self.cut]
        actions = policy.decide(self.state, [*observations, *reports], self.now)
        self.act(actions)
        return actions

    def report(self, host: str) -> pb.AgentReport:
        hello = host in self.hello
        self.hello.discard(host)
        roles = [
            pb.RoleReport(name=p.name, incarnation=p.incarnation, attempt=p.attempt, pid=p.pid,
                          exited=p.exit_code is not None, exit_code=p.exit_code or 0, log_tail=p.log_tail,
                          heartbeat_age=self.now - p.beat if p.beat is not None else -1.0,
                          last=pb.HeartbeatRequest(local_step=p.local_step, global_step=p.global_step,
                                                   metrics=p.metrics, status=p.status))
            for p in self.processes[host].values()
        ]
        return pb.AgentReport(host=host, agent_pid=1, hello=hello, roles=roles)

    def act(self, actions: list[policy.Action]) -> None:
        self.actions += actions
        for action in actions:
            if isinstance(action, policy.StartRole) and action.host not in self.cut:
                old = self.processes[action.host].get(action.name)
                if old is not None and old.exit_code is None:
                    old.exit_code = -9
                self.processes[action.host][action.name] = FakeProcess(
                    action.name, action.incarnation, action.attempt, next(self._pids))
            elif isinstance(action, policy.StopRole) and action.host not in self.cut:
                p = self.processes[action.host].get(action.name)
                if p is not None and p.exit_code is None and action.incarnation in (0, p.incarnation):
                    p.exit_code = -15 if action.grace > 0 else -9  # (a role's SIGTERM handler exits 0 there)
            elif isinstance(action, policy.Finish):
                self.act(policy.conclude(self.state, action.state, action.reason))

    # -- looking --------------------------------------------------------------------------------------
    def process(self, name: str) -> FakeProcess:
        """The process of the role's current attempt."""
        role = self.record.role(name)
        return self.processes[role.host][name]

    def role(self, name: str) -> RoleRecord:
        return self.record.role(name)

    def states(self) -> dict[str, RoleState]:
        return {r.name: r.state for r in self.record.roles}

    def events(self, subject: str | None = None) -> list[policy.WriteEvent]:
        return [a for a in self.actions if isinstance(a, policy.WriteEvent) and subject in (None, a.subject)]

    def running(self) -> set[tuple[str, str, int]]:
        """(host, role, pid) of every process still running."""
        return {(h, p.name, p.pid) for h, ps in self.processes.items() for p in ps.values() if p.exit_code is None}

"""The supervisor's state machine, driven by an injected clock and a fake process runner.

A fake is right here: what is under test is the decision logic (restart policy, backoff, permanent exits,
fencing, stalls, completion), not process handling, which the end-to-end and fault tests cover for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from supervisor_fakes import Clock, FakeRunner

from psctl.home import ClusterDir
from psctl.proto import psctl_pb2 as pb
from psctl.spec import load_spec_text, make_plan
from psctl.supervisor.daemon import Supervisor
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState

SPEC = """\
name: logic
roles:
  chief: {}
  ps: {replicas: 1}
  worker: {replicas: 2, restart: {max_restarts: 2, backoff_seconds: 1, max_backoff_seconds: 4}}
training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
supervision: {heartbeat_interval: 1s, heartbeat_timeout: 5s, startup_grace: 20s, stall_timeout: 30s}
security: {tls: false}
"""


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    spec_path = tmp_path / "logic.yaml"
    spec_path.write_text(SPEC)
    spec = load_spec_text(SPEC, filename=str(spec_path))
    plan = make_plan(spec, check_ports=False)
    record = ClusterRecord(
        name="logic", cluster_id="logic-test", spec_path=str(spec_path), tls=False,
        roles=[RoleRecord(i.name, i.role, i.index, i.host, i.address, i.port) for i in plan.instances],
    )
    cdir = ClusterDir(tmp_path / "home" / "logic")
    cdir.create()
    supervisor = Supervisor(cdir, spec, record, FakeRunner(), get_time=Clock())
    for role in record.roles:
        supervisor.start_role(role)
    return supervisor


def clock(sup: Supervisor) -> Clock:
    assert isinstance(sup.time, Clock)
    return sup.time


def runner(sup: Supervisor) -> FakeRunner:
    assert isinstance(sup.runners["localhost"], FakeRunner)
    return sup.runners["localhost"]


def beat(
    sup: Supervisor, name: str, *, local_step: int = 0, global_step: int = 0, incarnation: int | None = None
) -> bool:
    role = sup.record.role(name)
    job, index = role.role, role.index
    return sup.on_heartbeat(pb.HeartbeatRequest(
        task=f"{job}:{index}", incarnation=role.incarnation if incarnation is None else incarnation,
        local_step=local_step, global_step=global_step,
    ))


def beat_all(sup: Supervisor, **steps: int) -> None:
    for role in sup.record.roles:
        if not role.state.terminal and role.state != RoleState.RESTARTING:
            beat(sup, role.name, local_step=steps.get(role.name.replace("-", "_"), 0))


def state(sup: Supervisor, name: str) -> RoleState:
    return sup.record.role(name).state


def test_roles_run_once_every_one_heartbeats(sup: Supervisor) -> None:
    assert all(r.state == RoleState.STARTING for r in sup.record.roles)
    beat_all(sup)
    sup.step()
    assert all(r.state == RoleState.RUNNING for r in sup.record.roles)
    assert sup.record.state == ClusterState.RUNNING


def test_a_silent_role_is_lost_killed_and_restarted_after_its_backoff(sup: Supervisor) -> None:
    beat_all(sup)
    sup.step()
    first_pid = sup.record.role("worker-1").pid
    clock(sup).now += 6  # worker-1 silent for longer than heartbeat_timeout (5 s); the others keep beating
    for name in ("chief-0", "ps-0", "worker-0"):
        beat(sup, name)
    sup.step()
    assert state(sup, "worker-1") == RoleState.RESTARTING
    assert any(pid == first_pid for pid, _sig in runner(sup).signals), "the silent process was not killed"
    events = sup.cdir.events_file.read_text()
    assert '"to": "lost", "reason": "no heartbeat for 6.0s (hung or cut off)"' in events
    clock(sup).now += 0.5  # backoff is 1 s ± 20% jitter: not yet
    sup.step()
    assert state(sup, "worker-1") == RoleState.RESTARTING
    clock(sup).now += 1.0
    sup.step()
    worker = sup.record.role("worker-1")
    assert (worker.state, worker.attempt, worker.restarts) == (RoleState.STARTING, 2, 1)
    assert worker.pid != first_pid


def test_restarts_stop_at_max_restarts_and_backoff_grows(sup: Supervisor) -> None:
    beat_all(sup)
    sup.step()
    backoffs = []
    for _ in range(2):  # max_restarts: 2
        runner(sup).exit_codes[sup.record.role("worker-0").pid] = 1
        sup.step()
        assert state(sup, "worker-0") == RoleState.RESTARTING
        due = sup.live["worker-0"].restart_at
        assert due is not None
        backoffs.append(due - clock(sup).now)
        clock(sup).now = due + 0.01
        sup.step()
        beat(sup, "worker-0")
        sup.step()
    assert backoffs[1] > backoffs[0]  # 1 s then 2 s (each ±20%)
    runner(sup).exit_codes[sup.record.role("worker-0").pid] = 1
    sup.step()
    assert state(sup, "worker-0") == RoleState.FAILED
    assert "max_restarts" in sup.record.role("worker-0").reason
    assert sup.record.state == ClusterState.RUNNING  # one worker left: training goes on


def test_a_permanent_exit_code_is_not_restarted_and_a_failed_ps_fails_the_cluster(sup: Supervisor) -> None:
    beat_all(sup)
    sup.step()
    runner(sup).exit_codes[sup.record.role("ps-0").pid] = 2  # bad configuration
    sup.step()
    assert state(sup, "ps-0") == RoleState.FAILED
    assert "permanent" in sup.record.role("ps-0").reason
    assert sup.record.state == ClusterState.FAILED
    assert all(r.state.terminal for r in sup.record.roles)


def test_a_replaced_incarnation_is_fenced(sup: Supervisor) -> None:
    role = sup.record.role("worker-0")
    assert beat(sup, "worker-0") is False
    assert beat(sup, "worker-0", incarnation=role.incarnation - 1) is True


def test_a_role_whose_step_stops_while_others_progress_is_stalled_then_running_again(sup: Supervisor) -> None:
    beat_all(sup)
    sup.step()
    for step in range(1, 40):  # worker-0 stuck at local step 5, worker-1 advancing
        clock(sup).now += 1
        beat(sup, "chief-0", global_step=step)
        beat(sup, "ps-0")
        beat(sup, "worker-0", local_step=5)
        beat(sup, "worker-1", local_step=step)
        sup.step()
    assert state(sup, "worker-0") == RoleState.STALLED
    assert "has not moved" in sup.record.role("worker-0").reason
    assert state(sup, "worker-1") == RoleState.RUNNING
    clock(sup).now += 1
    beat(sup, "worker-0", local_step=6)
    sup.step()
    assert state(sup, "worker-0") == RoleState.RUNNING


def test_the_chief_finishing_stops_everyone_and_succeeds(sup: Supervisor) -> None:
    beat_all(sup)
    sup.step()
    runner(sup).exit_codes[sup.record.role("chief-0").pid] = 0
    sup.step()
    assert sup.record.state == ClusterState.SUCCEEDED
    assert state(sup, "chief-0") == RoleState.SUCCEEDED
    assert all(state(sup, n) == RoleState.STOPPED for n in ("ps-0", "worker-0", "worker-1"))


def test_a_host_event_is_written_when_its_reachability_changes_not_its_error_text(sup: Supervisor) -> None:
    def host_events() -> list[tuple[str, str]]:
        lines = sup.cdir.events_file.read_text().splitlines() if sup.cdir.events_file.exists() else []
        return [(e["from"], e["to"]) for e in map(json.loads, lines) if e["role"] == "host localhost"]

    sup.watch_hosts()
    assert host_events() == []
    runner(sup).last_error = "host h3: timed out"
    sup.watch_hosts()
    runner(sup).last_error = "host h3: connection refused"  # still down, for another reason
    sup.watch_hosts()
    runner(sup).last_error = None
    sup.watch_hosts()
    sup.watch_hosts()
    assert host_events() == [("reachable", "unreachable"), ("unreachable", "reachable")]

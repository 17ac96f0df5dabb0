"""Benching hosts and moving workers within their pool: the supervisor's decisions on fake hosts and a clock.

The hosts are fake runners (see supervisor_fakes): what is under test is where a role restarts, what the
events say and what the chief is told, not SSH, which tests/test_ssh_cluster.py covers with real hosts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from supervisor_fakes import Clock, FakeRunner

from psctl.errors import LaunchError, PsctlError
from psctl.home import ClusterDir
from psctl.launch.base import ProcessHandle
from psctl.launch.hostset import Placement
from psctl.operations import _tear_down
from psctl.proto import psctl_pb2 as pb
from psctl.render import status_view
from psctl.spec import load_spec_text, make_plan
from psctl.supervisor.daemon import HeartbeatServicer, Supervisor
from psctl.supervisor.hosts import HostBench, Occupant, restart_host
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, save_state

SPEC = """\
name: pools
hosts:
  - {name: h1, address: 10.9.0.1}
  - {name: h2, address: 10.9.0.2}
  - {name: h3, address: 10.9.0.3}
roles:
  chief: {host: h1, port: 7000}
  ps: {host: h3, port: 7010}
  worker: {replicas: 3, hosts: [h1, h2, h3], port: 7020,
           restart: {max_restarts: 10, backoff_seconds: 1, max_backoff_seconds: 1}}
training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
supervision: {heartbeat_interval: 1s, heartbeat_timeout: 5s, startup_grace: 20s,
              bench_after_failures: 2, bench_window: 60s, bench_cooloff: 100s}
"""


#: The chief gets a pool: its checkpoints are on storage every host shares.
SHARED_CHECKPOINTS = SPEC.replace("chief: {host: h1, port: 7000}", "chief: {hosts: [h1, h2], port: 7000}").replace(
    "steps: 10}", "steps: 10, checkpoint: {dir: shared-checkpoints}}")


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    return supervisor_of(SPEC, tmp_path)


def supervisor_of(text: str, tmp_path: Path, *, own_folders: bool = False) -> Supervisor:
    """A supervisor of the spec ``text`` over fake hosts h1..h3, every role started (``own_folders``: each host
    has a cluster folder of its own, as SSH hosts do; else they share the local one)."""
    spec = load_spec_text(text, filename=str(tmp_path / "pools.yaml"))
    plan = make_plan(spec, check_ports=False)
    record = ClusterRecord(
        name="pools", cluster_id="pools-test", spec_path="", tls=False,
        roles=[RoleRecord(i.name, i.role, i.index, i.host, i.address, i.port) for i in plan.instances],
    )
    cdir = ClusterDir(tmp_path / "home" / "pools")
    cdir.create()
    folders = {h.name: ClusterDir(tmp_path / "hosts" / h.name / "pools") if own_folders else cdir for h in spec.hosts}
    for folder in folders.values():
        folder.create()
    places = {
        h.name: Placement(h.name, FakeRunner(h.name), "python3", folders[h.name], str(tmp_path), {}, 2, remote=True,
                          address=h.address)
        for h in spec.hosts
    }
    supervisor = Supervisor(cdir, spec, record, places, get_time=Clock())
    with supervisor.lock:
        for role in record.roles:
            supervisor.start_role(role)
    settle()
    return supervisor


def settle() -> None:
    """Wait for the supervisor's start, stop and sweep threads (SSH hosts are handled off the loop)."""
    deadline = time.monotonic() + 10
    for thread in threading.enumerate():
        if thread.name.startswith(("psctl-start-", "psctl-stop-", "psctl-sweep-")):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), f"{thread.name} did not finish"


def host(sup: Supervisor, name: str) -> FakeRunner:
    runner = sup.runners[name]
    assert isinstance(runner, FakeRunner)
    return runner


def step(sup: Supervisor, seconds: float, *, silent: tuple[str, ...] = ()) -> None:
    """Advance the clock, heartbeat every live role but the ``silent`` ones, run one pass of the loop."""
    assert isinstance(sup.time, Clock)
    sup.time.now += seconds
    for role in sup.record.roles:
        if role.name not in silent and not role.state.terminal and role.state != RoleState.RESTARTING:
            sup.on_heartbeat(pb.HeartbeatRequest(task=f"{role.role}:{role.index}", incarnation=role.incarnation))
    with sup.lock:
        sup.step()
    settle()


def shown(sup: Supervisor) -> str:
    """What ``psctl status`` prints for the cluster."""
    console = Console(width=200, record=True)
    console.print(status_view(sup.cdir, sup.record, stale=False))
    return console.export_text()


def events(sup: Supervisor) -> list[dict[str, str]]:
    return [json.loads(line) for line in sup.cdir.events_file.read_text().splitlines()]


def chief_is_told(sup: Supervisor) -> dict[str, str]:
    chief = sup.record.role("chief-0")
    request = pb.HeartbeatRequest(task="chief:0", incarnation=chief.incarnation)
    return dict(HeartbeatServicer(sup).Heartbeat(request, None).addresses)  # type: ignore[arg-type]


def test_a_worker_on_a_cut_off_host_restarts_on_the_least_loaded_host_of_its_pool(sup: Supervisor) -> None:
    step(sup, 1)
    worker = sup.record.role("worker-2")
    assert (worker.host, worker.address) == ("h3", "10.9.0.3")
    old = sup.live["worker-2"].handle
    host(sup, "h3").last_error = "host h3: timed out"
    step(sup, 6, silent=("worker-2", "ps-0"))  # h3 silent past heartbeat_timeout: its roles are lost
    step(sup, 1.5)  # past the backoff: the worker restarts, the ps (which cannot move) tries h3 again
    worker = sup.record.role("worker-2")
    # h1 holds chief-0 and worker-0, h2 only worker-1: the worker goes to h2
    assert (worker.host, worker.address, worker.state, worker.attempt) == ("h2", "10.9.0.2", RoleState.STARTING, 2)
    assert sup.live["worker-2"].handle is not None and sup.live["worker-2"].handle.host == "h2"
    assert worker.hosts_by_attempt == [[1, "h3"], [2, "h2"]]  # where each attempt's log is
    assert (worker.host_of(1), worker.host_of(2), worker.host_of(3)) == ("h3", "h2", "h2")
    assert sup.record.role("ps-0").host == "h3"
    assert any(e["role"] == "worker-2" and e["reason"] == "moves from h3 to h2 (host h3: timed out)"
               for e in events(sup))
    assert chief_is_told(sup) == {"ps:0": "10.9.0.3:7010", "worker:0": "10.9.0.1:7020",
                                  "worker:1": "10.9.0.2:7021", "worker:2": "10.9.0.2:7022"}
    # status shows what is wrong with the host while it lasts; roles lost with it do not bench it
    assert sup.record.host_problems == {"h3": "unreachable: host h3: timed out"}
    assert "host h3: unreachable: host h3: timed out" in shown(sup)
    # the ps, which cannot move, waits for its host: the outage uses up none of its restarts
    for _ in range(5):
        step(sup, 1.5, silent=("ps-0",))
    ps = sup.record.role("ps-0")
    assert (ps.state, ps.attempt, ps.reason) == (RoleState.RESTARTING, 1, "waiting for h3 to answer")
    # The old process could not be stopped on the cut-off host; once h3 answers again it is.
    assert old is not None and old in sup.live["worker-2"].stale
    host(sup, "h3").last_error = None
    step(sup, 0.5)
    assert sup.live["worker-2"].stale == []
    assert host(sup, "h3").exit_codes[old.pid] is not None
    assert sup.record.host_problems == {} and "host h3" not in shown(sup)
    step(sup, 1.5, silent=("ps-0",))  # and the ps starts there again
    assert (sup.record.role("ps-0").state, sup.record.role("ps-0").attempt) == (RoleState.STARTING, 2)


def test_the_cluster_finishing_stops_old_processes_left_on_a_host_that_answers_again(sup: Supervisor) -> None:
    step(sup, 1)
    old = sup.live["worker-2"].handle
    host(sup, "h3").last_error = "host h3: timed out"
    step(sup, 6, silent=("worker-2", "ps-0"))
    step(sup, 1.5)
    assert sup.record.role("worker-2").host == "h2" and old in sup.live["worker-2"].stale
    host(sup, "h3").last_error = None  # h3 answers again, and training ends before the next sweep
    with sup.lock:
        sup.finish(ClusterState.SUCCEEDED, "training finished")
    settle()
    assert old is not None and host(sup, "h3").exit_codes[old.pid] is not None
    left = {(name, pid) for name in sup.runners for pid, code in host(sup, name).exit_codes.items() if code is None}
    assert left == set(), (left, {r.name: (r.host, r.pid, r.state) for r in sup.record.roles})


def test_a_host_where_roles_keep_failing_is_benched_then_released(sup: Supervisor) -> None:
    step(sup, 1)
    h2 = host(sup, "h2")
    for _ in (1, 2):  # worker-1 exits badly twice on h2 (bench_after_failures: 2)
        assert sup.record.role("worker-1").host == "h2"
        h2.exit_codes[sup.record.role("worker-1").pid] = 1
        step(sup, 0.1)
        step(sup, 1.5)
    benched = [e for e in events(sup) if e["role"] == "host h2"]
    assert [(e["from"], e["to"]) for e in benched] == [("available", "benched")]
    assert "2 role failures within 60s" in benched[0]["reason"]
    assert sup.record.host_problems["h2"].startswith("benched until ")
    worker = sup.record.role("worker-1")
    assert (worker.host, worker.attempt) == ("h1", 3)  # h1 and h3 hold two roles each: pool order decides
    # After the cooling-off, h2 takes roles again.
    step(sup, 100)
    assert [(e["from"], e["to"]) for e in events(sup) if e["role"] == "host h2"][-1] == ("benched", "available")
    assert sup.usable("h2")
    assert "h2" not in sup.record.host_problems


def test_a_ps_with_a_pool_moves_and_the_chief_and_workers_are_told(tmp_path: Path) -> None:
    sup = supervisor_of(SPEC.replace("ps: {host: h3, port: 7010}", "ps: {hosts: [h3, h1], port: 7010}"), tmp_path)
    step(sup, 1)
    host(sup, "h3").last_error = "host h3: timed out"
    step(sup, 6, silent=("worker-2", "ps-0"))
    step(sup, 2.5)  # past any backoff (ps: 1 s by default, ± 20 %)
    ps = sup.record.role("ps-0")
    assert (ps.host, ps.address, ps.attempt) == ("h1", "10.9.0.1", 2)  # the only other host of its pool
    for task in ("chief:0", "worker:0"):
        role = sup.record.role(task.replace(":", "-"))
        reply = HeartbeatServicer(sup).Heartbeat(
            pb.HeartbeatRequest(task=task, incarnation=role.incarnation), None)  # type: ignore[arg-type]
        assert reply.addresses["ps:0"] == "10.9.0.1:7010"
        # the chief follows workers too; a worker only the ps (it talks to no other worker)
        assert any(t.startswith("worker:") for t in reply.addresses) == (task == "chief:0"), dict(reply.addresses)
    ps_reply = HeartbeatServicer(sup).Heartbeat(
        pb.HeartbeatRequest(task="ps:0", incarnation=ps.incarnation), None)  # type: ignore[arg-type]
    assert dict(ps_reply.addresses) == {}  # a ps talks to no other role


def test_a_chief_with_a_pool_moves_off_a_cut_off_host_and_its_metrics_and_checkpoints_follow(tmp_path: Path) -> None:
    sup = supervisor_of(SHARED_CHECKPOINTS, tmp_path, own_folders=True)
    step(sup, 1)
    folder = sup.spec.training["checkpoint"]["dir"]
    assert sup.record.checkpoint_dir == f"h1:{folder}"
    first_incarnation = sup.record.role("chief-0").incarnation
    (sup.places["h1"].dirs.run_dir / "metrics.jsonl").write_text('{"global_step": 5}\n')
    sup.mirror_metrics()
    host(sup, "h1").last_error = "host h1: timed out"
    step(sup, 6, silent=("chief-0", "worker-0"))
    step(sup, 2.5)  # past the chief's backoff
    chief = sup.record.role("chief-0")
    assert (chief.host, chief.address, chief.attempt) == ("h2", "10.9.0.2", 2)
    assert sup.live["chief-0"].handle is not None and sup.live["chief-0"].handle.host == "h2"
    assert any(e["role"] == "chief-0" and e["reason"] == "moves from h1 to h2 (host h1: timed out)"
               for e in events(sup))
    assert sup.record.checkpoint_dir == f"h2:{folder}"  # where export and restores find them now
    # The ps and the workers are told of the new chief, so that they refuse the old one (see fencing).
    for task in ("ps:0", "worker-1"):
        role = sup.record.role(task.replace(":", "-"))
        reply = HeartbeatServicer(sup).Heartbeat(
            pb.HeartbeatRequest(task=f"{role.role}:{role.index}", incarnation=role.incarnation), None)  # type: ignore[arg-type]
        assert reply.chief_incarnation == chief.incarnation > first_incarnation
    # What the chief writes on h2 is mirrored from the start of that host's file.
    (sup.places["h2"].dirs.run_dir / "metrics.jsonl").write_text('{"global_step": 6}\n')
    sup.mirror_metrics()
    mirrored = (sup.cdir.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in mirrored] == [5, 6]


def test_a_role_stays_on_its_host_when_its_pool_has_no_other_usable_one() -> None:
    def up(h: str) -> bool:
        return h != "h3"

    occupants = [Occupant("ps-0", "h3", 7010)]
    assert restart_host("ps-0", "h3", 7010, ("h3",), occupants, up) == "h3"
    assert restart_host("worker-0", "h3", 7020, ("h3",), occupants, up) == "h3"  # no other host
    assert restart_host("chief-0", "h3", 7000, ("h3", "h4"), occupants, lambda h: False) == "h3"  # none usable
    assert restart_host("chief-0", "h3", 7000, ("h3", "h1"), occupants, up) == "h1"  # a chief with a pool moves


def test_a_move_avoids_hosts_where_the_port_is_taken_and_breaks_ties_by_pool_order() -> None:
    occupants = [Occupant("worker-0", "h1", 7020), Occupant("evaluator-0", "h2", 7022),
                 Occupant("worker-2", "h3", 7022)]
    assert restart_host("worker-2", "h3", 7022, ("h1", "h2", "h3"), occupants, lambda h: h != "h3") == "h1"
    assert restart_host("worker-2", "h3", 7022, ("h2", "h4", "h3"), [], lambda h: h != "h3") == "h2"
    assert restart_host("worker-2", "h3", 7022, ("h1", "h2", "h3"), occupants, lambda h: True) == "h3"


def test_failures_spread_wider_than_the_window_do_not_bench() -> None:
    bench = HostBench(failures=3, window=10, cooloff=50)
    assert [bench.record_failure("h1", t) for t in (0, 6, 17, 23)] == [False, False, False, False]
    assert [bench.record_failure("h1", t) for t in (30, 31)] == [False, True]  # 23, 30, 31: three within 10 s
    assert bench.is_benched("h1", 80) and not bench.is_benched("h1", 81)
    assert bench.released(80) == [] and bench.released(81) == ["h1"] and bench.released(82) == []
    never = HostBench(failures=0, window=10, cooloff=50)
    assert not any(never.record_failure("h1", t) for t in range(10))


def test_a_role_may_run_on_its_planned_host_then_the_rest_of_its_pool(tmp_path: Path) -> None:
    plan = make_plan(load_spec_text(SHARED_CHECKPOINTS, filename=str(tmp_path / "pools.yaml")), check_ports=False)
    assert [(i.name, plan.hosts_of(i)) for i in plan.instances] == [
        ("chief-0", ("h1", "h2")), ("ps-0", ("h3",)),
        ("worker-0", ("h1", "h2", "h3")), ("worker-1", ("h2", "h1", "h3")), ("worker-2", ("h3", "h1", "h2")),
    ]
    assert [i.name for i in plan.may_run_on("h2")] == ["chief-0", "worker-0", "worker-1", "worker-2"]


class SilentHost(FakeRunner):
    """A host that does not answer at all."""

    def cluster_processes(self, cluster_id: str) -> list[ProcessHandle]:
        raise PsctlError(f"host {self.host}: timed out")


def test_down_is_not_failed_by_a_silent_spare_host_no_role_ever_ran_on(tmp_path: Path) -> None:
    cdir = ClusterDir(tmp_path / "home" / "pools")
    cdir.create()
    h1, h2 = FakeRunner("h1"), SilentHost("h2")
    handle = h1.start(argv=["x"], env={}, cwd=".", log_path=tmp_path / "w.log")
    worker = RoleRecord("worker-0", "worker", 0, "h1", "10.9.0.1", 7020, pid=handle.pid, state=RoleState.RUNNING,
                        hosts_by_attempt=[[1, "h1"]])  # fmt: skip
    record = ClusterRecord(name="pools", cluster_id="pools-test", spec_path="", tls=False, roles=[worker])
    save_state(cdir.state_file, record)
    report = _tear_down(cdir, record, {"h1": h1, "h2": h2}, grace=0.5, purge=False)
    assert h1.exit_codes[handle.pid] is not None  # what ran was stopped
    assert (report.stopped, report.unanswered_spares) == (1, ("h2",))
    # a silent host where an attempt did run is still an error: something of the cluster may be left there
    worker.hosts_by_attempt = [[1, "h2"], [2, "h1"]]
    save_state(cdir.state_file, record)
    with pytest.raises(LaunchError, match="cannot verify that nothing of cluster 'pools' is left on 1 host"):
        _tear_down(cdir, record, {"h1": h1, "h2": h2}, grace=0.5, purge=False)

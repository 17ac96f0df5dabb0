"""Benching hosts and moving roles within their pool: the policy's decisions over simulated agents and a clock.

The hosts' agents are simulated (see policy_driver): what is under test is where a role restarts, what the
events say and what the chief is told, not SSH, which tests/test_ssh_cluster.py covers with real hosts.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from cluster_helpers import wait_until
from policy_driver import FakeCluster
from rich.console import Console
from supervisor_fakes import Clock, FakeRunner

from psctl.agent.core import Agent, RoleProcess
from psctl.errors import LaunchError, PsctlError
from psctl.home import ClusterDir
from psctl.launch.base import ProcessHandle
from psctl.launch.hostset import Placement
from psctl.operations import _tear_down
from psctl.proto import psctl_pb2 as pb
from psctl.render import status_view
from psctl.spec import load_spec_text, make_plan
from psctl.supervisor import policy
from psctl.supervisor.daemon import MIN_PASS_GAP, Supervisor
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
def c(tmp_path: Path) -> FakeCluster:
    cluster = FakeCluster(SPEC, tmp_path)
    cluster.step()  # every host's agent says hello: every role starts where the plan put it
    cluster.step(1)
    return cluster


def told(c: FakeCluster, task: str) -> pb.HeartbeatResponse:
    """What a role's agent answers its heartbeat with, given the view the supervisor sends the agents."""

    class Running:
        pid = 1

        def poll(self) -> int | None:
            return None

    role = c.role(task.replace(":", "-"))
    agent = Agent("h", "127.0.0.1:1", cluster_id=c.record.cluster_id, serve_heartbeats=False)
    agent.roles[role.name] = RoleProcess(role.name, role.incarnation, role.attempt, "log", process=Running())
    agent.view = policy.cluster_view(c.state)
    return agent.on_heartbeat(pb.HeartbeatRequest(task=task, incarnation=role.incarnation))


def shown(c: FakeCluster, tmp_path: Path) -> str:
    """What ``psctl status`` prints for the cluster."""
    console = Console(width=200, record=True)
    console.print(status_view(ClusterDir(tmp_path / "home" / "pools"), c.record, stale=False))
    return console.export_text()


SILENT = "agent silent for 6.0s (host down or cut off)"


def test_a_worker_on_a_cut_off_host_restarts_on_the_least_loaded_host_of_its_pool(
        c: FakeCluster, tmp_path: Path) -> None:
    worker = c.role("worker-2")
    assert (worker.host, worker.address) == ("h3", "10.9.0.3")
    old = c.process("worker-2")
    c.cut.add("h3")
    c.step(6)  # h3 silent past heartbeat_timeout: its agent is detached, its roles are lost
    actions = c.step(1.5)  # past the backoff: the worker restarts, the ps (which cannot move) waits for h3
    worker = c.role("worker-2")
    # both hosts' roles changed: their agents are told the CPU slots of their roles now (h3's is cut off: that
    # command finds no agent attached and is dropped, so h3's agent is told again once it answers; below)
    assert {a.host for a in actions if isinstance(a, policy.RebindCpus)} == {"h2", "h3"}
    # h1 holds chief-0 and worker-0, h2 only worker-1: the worker goes to h2
    assert (worker.host, worker.address, worker.state, worker.attempt) == ("h2", "10.9.0.2", RoleState.STARTING, 2)
    assert worker.hosts_by_attempt == [[1, "h3"], [2, "h2"]]  # where each attempt's log is
    assert (worker.host_of(1), worker.host_of(2), worker.host_of(3)) == ("h3", "h2", "h2")
    assert c.role("ps-0").host == "h3"
    assert any(e.reason == f"moves from h3 to h2 ({SILENT})" for e in c.events("worker-2"))
    assert dict(told(c, "chief:0").addresses) == {"ps:0": "10.9.0.3:7010", "worker:0": "10.9.0.1:7020",
                                                  "worker:1": "10.9.0.2:7021", "worker:2": "10.9.0.2:7022"}
    # status shows what is wrong with the host while it lasts; roles lost with it do not bench it
    assert c.record.host_problems == {"h3": f"unreachable: {SILENT}"}
    assert f"host h3: unreachable: {SILENT}" in shown(c, tmp_path)
    # the ps, which cannot move, waits for its host: the outage uses up none of its restarts
    for _ in range(5):
        c.step(1.5)
    ps = c.role("ps-0")
    assert (ps.state, ps.attempt, ps.reason) == (RoleState.RESTARTING, 1, "waiting for h3 to answer")
    # The old worker could not be stopped on the cut-off host; once h3's agent reports it again, it is (it was
    # replaced). The ps' process, still running there and beating, is taken back as it is: a new one would have
    # been restored from the last checkpoint, losing the updates since.
    assert old.exit_code is None
    ps_process = c.process("ps-0")
    c.cut.clear()
    actions = c.step(0.5)
    assert old.exit_code == -9
    assert policy.RebindCpus("h3") in actions  # the CPU slots of the roles h3 has now
    assert c.record.host_problems == {} and "host h3" not in shown(c, tmp_path)
    c.step(1.5)
    ps = c.role("ps-0")
    assert (ps.state, ps.attempt, ps.restarts, ps_process.exit_code) == (RoleState.RUNNING, 1, 0, None)
    assert c.events("ps-0")[-1].reason == "h3 answers again and its process still runs: taken back, not restarted"
    assert not [a for a in actions if isinstance(a, policy.StopRole) and a.name == "ps-0"]
    assert [(e.was, e.to) for e in c.events("host h3")] == [
        ("starting", "reachable"), ("reachable", "unreachable"), ("unreachable", "reachable")]


def test_the_old_process_on_a_host_that_answers_again_after_the_cluster_finished_is_stopped(c: FakeCluster) -> None:
    old = c.process("worker-2")
    c.cut.add("h3")
    c.step(6)
    c.step(1.5)
    assert c.role("worker-2").host == "h2" and old.exit_code is None
    c.process("chief-0").exit_code = 0  # training ends while h3 is cut off
    c.step()
    assert c.record.state == ClusterState.SUCCEEDED
    c.cut.clear()  # h3's agent reports the old worker: it is stopped
    c.act(policy.decide(c.state, [policy.Report("h3", c.now, c.report("h3"))], c.now))
    assert old.exit_code == -9  # moved away: killed
    assert c.process("ps-0").exit_code == -15  # stopped with the cluster: with the stop's grace
    assert c.running() == set(), c.running()


def test_a_host_where_roles_keep_failing_is_benched_then_released(c: FakeCluster) -> None:
    for _ in (1, 2):  # worker-1 exits badly twice on h2 (bench_after_failures: 2)
        assert c.role("worker-1").host == "h2"
        c.process("worker-1").exit_code = 1
        c.step(0.1)
        c.step(1.5)
    benched = c.events("host h2")[1:]
    assert [(e.was, e.to) for e in benched] == [("available", "benched")]
    assert "2 role failures within 60s" in benched[0].reason
    assert c.record.host_problems["h2"].startswith("benched for ")
    worker = c.role("worker-1")
    assert (worker.host, worker.attempt) == ("h1", 3)  # h1 and h3 hold two roles each: pool order decides
    # After the cooling-off, h2 takes roles again.
    c.step(100)
    assert [(e.was, e.to) for e in c.events("host h2")][-1] == ("benched", "available")
    assert not c.state.bench.is_benched("h2", c.now)
    assert "h2" not in c.record.host_problems


def test_preemptions_do_not_bench_a_host(c: FakeCluster) -> None:
    for _ in (1, 2, 3):  # bench_after_failures: 2
        c.process("worker-1").exit_code = policy.EXIT_PREEMPTED
        c.step(0.1)
        c.step(1.5)
        assert c.role("worker-1").host == "h2"
    assert [(e.was, e.to) for e in c.events("host h2")] == [("starting", "reachable")]


def test_an_ssh_host_s_silent_agent_is_replaced_and_a_host_that_does_not_answer_is_detached_at_the_timeout(
        c: FakeCluster) -> None:
    """A host's agent silent for half the heartbeat timeout may hang on a host that answers: another is started
    over SSH in its place (it adopts the roles). Where the host does not answer that either (down, cut off), it is
    detached at the timeout as before, and its roles are lost."""
    c.cut.add("h2")
    assert not [a for a in c.step(2.0) if isinstance(a, policy.StartAgent)]  # 2 s of the 5 s timeout: not yet
    assert [a for a in c.step(1.0) if isinstance(a, policy.StartAgent)] == [policy.StartAgent("h2", replace=True)]
    c.step(0.5, observations=[policy.AgentStartFailed("h2", "cannot connect to 10.9.0.2:22: timed out")])
    assert c.role("worker-1").state == RoleState.RUNNING  # (on h2: not judged before the timeout)
    c.step(2.0)  # 5.5 s
    assert c.role("worker-1").state != RoleState.RUNNING
    assert [e.to for e in c.events("host h2")][-1] == "unreachable"


def test_a_role_lost_with_its_host_that_is_silent_when_the_host_answers_is_not_taken_back(c: FakeCluster) -> None:
    """Only a process that beats is taken back: one silent past the heartbeat timeout (hung) when its host
    answers again is killed and restarted."""
    process = c.process("ps-0")
    c.cut.add("h3")
    c.step(6)
    c.step(1.5)
    assert c.role("ps-0").reason == "waiting for h3 to answer"
    c.cut.clear()
    c.step(0.5, silent=("ps-0",))
    assert process.exit_code == -9
    c.step(1.5)
    assert (c.role("ps-0").state, c.role("ps-0").attempt) == (RoleState.STARTING, 2)


def test_a_ps_with_a_pool_moves_and_the_chief_and_workers_are_told(tmp_path: Path) -> None:
    c = FakeCluster(SPEC.replace("ps: {host: h3, port: 7010}", "ps: {hosts: [h3, h1], port: 7010}"), tmp_path)
    c.step()
    c.step(1)
    c.cut.add("h3")
    c.step(6)
    actions = c.step(2.5)  # past any backoff (ps: 1 s by default, ± 20 %)
    ps = c.role("ps-0")
    assert (ps.host, ps.address, ps.attempt) == ("h1", "10.9.0.1", 2)  # the only other host of its pool
    assert policy.SendView() in actions  # every agent is told
    for task in ("chief:0", "worker:0"):
        reply = told(c, task)
        assert reply.addresses["ps:0"] == "10.9.0.1:7010"
        # the chief follows workers too; a worker only the ps (it talks to no other worker)
        assert any(t.startswith("worker:") for t in reply.addresses) == (task == "chief:0"), dict(reply.addresses)
    assert dict(told(c, "ps:0").addresses) == {}  # a ps talks to no other role


def test_a_chief_with_a_pool_moves_off_a_cut_off_host_and_its_metrics_and_checkpoints_follow(tmp_path: Path) -> None:
    c = FakeCluster(SHARED_CHECKPOINTS, tmp_path)
    c.step()
    c.step(1)
    first_incarnation = c.role("chief-0").incarnation
    c.cut.add("h1")
    c.step(6)
    c.step(2.5)  # past the chief's backoff
    chief = c.role("chief-0")
    assert (chief.host, chief.address, chief.attempt) == ("h2", "10.9.0.2", 2)
    assert any(e.reason == f"moves from h1 to h2 ({SILENT.replace('6.0', '6.0')})" for e in c.events("chief-0"))
    # The ps and the workers are told of the new chief, so that they refuse the old one (see fencing).
    for task in ("ps:0", "worker:1"):
        assert told(c, task).chief_incarnation == chief.incarnation > first_incarnation
    assert told(c, "chief:0").chief_incarnation == 0  # the chief itself is not fenced by its own incarnation


@dataclasses.dataclass
class Shell:
    """The supervisor's I/O shell over fake runners, its record, its folder and each host's."""

    supervisor: Supervisor
    record: ClusterRecord
    cdir: ClusterDir
    folders: dict[str, ClusterDir]


def make_shell(tmp_path: Path, text: str = SPEC, cpus: int = 2, **training: object) -> Shell:
    """A supervisor for ``text``'s hosts of ``cpus`` CPUs each (``training``: keys of the spec's training to
    override)."""
    spec = load_spec_text(text, filename=str(tmp_path / "pools.yaml"))
    if training:
        spec = dataclasses.replace(spec, training={**spec.training, **training})
    plan = make_plan(spec, check_ports=False)
    record = ClusterRecord(
        name="pools", cluster_id="pools-test", spec_path="", tls=False,
        roles=[RoleRecord(i.name, i.role, i.index, i.host, i.address, i.port) for i in plan.instances],
    )
    cdir = ClusterDir(tmp_path / "home" / "pools")
    cdir.create()
    folders = {h.name: ClusterDir(tmp_path / "hosts" / h.name / "pools") for h in spec.hosts}
    for folder in folders.values():
        folder.create()
    places = {
        h.name: Placement(h.name, FakeRunner(h.name), "python3", folders[h.name], str(tmp_path), {}, cpus, remote=True,
                          address=h.address)
        for h in spec.hosts
    }
    return Shell(Supervisor(cdir, spec, record, places, get_time=Clock()), record, cdir, folders)


def test_the_chief_s_metrics_and_checkpoints_are_followed_to_the_host_it_moved_to(tmp_path: Path) -> None:
    made = make_shell(tmp_path, SHARED_CHECKPOINTS)
    shell, record, cdir, folders, spec = made.supervisor, made.record, made.cdir, made.folders, made.supervisor.spec
    chief = record.role("chief-0")
    folder = spec.training["checkpoint"]["dir"]
    shell.role_env(chief)
    assert record.checkpoint_dir == f"h1:{folder}"
    (folders["h1"].run_dir / "metrics.jsonl").write_text('{"global_step": 5}\n')
    shell.mirror_metrics()
    chief.host = "h2"  # moved (the policy's decision, tested above)
    env = shell.role_env(chief)
    assert record.checkpoint_dir == f"h2:{folder}"  # where export and restores find them now
    assert env["PSCTL_AGENT_HOST"] == "h2"
    # What the chief writes on h2 is mirrored from the start of that host's file.
    (folders["h2"].run_dir / "metrics.jsonl").write_text('{"global_step": 6}\n')
    shell.mirror_metrics()
    mirrored = (cdir.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in mirrored] == [5, 6]


def test_a_role_s_blas_threads_are_its_host_s_cpus_shared_among_the_roles_there(tmp_path: Path) -> None:
    # h1 runs the chief and worker-0, h2 worker-1 alone, h3 the ps (threads: 3 in the spec) and worker-2
    shell = make_shell(tmp_path, SPEC.replace("ps: {host: h3, port: 7010}", "ps: {host: h3, port: 7010, threads: 3}"),
                       cpus=16)
    threads = {r.name: shell.supervisor.role_env(r)["OPENBLAS_NUM_THREADS"] for r in shell.record.roles}
    assert threads == {"chief-0": "8", "ps-0": "3", "worker-0": "8", "worker-1": "16", "worker-2": "8"}
    few = make_shell(tmp_path / "few", cpus=1)  # more roles than CPUs: one thread each, never none
    assert {few.supervisor.role_env(r)["OMP_NUM_THREADS"] for r in few.record.roles} == {"1"}


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


def test_each_role_gets_its_cpu_slot_among_its_host_s_roles_unless_it_must_not_be_bound(tmp_path: Path) -> None:
    made = make_shell(tmp_path)
    shell, record = made.supervisor, made.record
    slots = {r.name: shell.cpu_slot(r) for r in record.roles}
    # h1: worker-0 and the chief (workers first); h2: worker-1 alone; h3: ps-0, then worker-2
    assert slots == {"chief-0": (1, 2), "worker-0": (0, 2), "worker-1": (0, 1), "ps-0": (0, 2), "worker-2": (1, 2)}
    record.roles[-1].retired = True  # (worker-2, scaled away) no longer counts on h3
    assert shell.cpu_slot(record.role("ps-0")) == (0, 1)

    record.backend = "slurm"  # a role is a job step there, bound (or not) by Slurm
    assert shell.cpu_slot(record.role("ps-0")) == (0, 0)

    no_workers = SPEC.replace("port: 7020,", "port: 7020, cpu_binding: none,")
    unbound = make_shell(tmp_path / "none", no_workers)
    assert [unbound.supervisor.cpu_slot(r) for r in unbound.record.roles if r.role == "worker"] == [(0, 0)] * 3
    assert unbound.supervisor.cpu_slot(unbound.record.role("ps-0")) == (0, 2)
    # a framework's program sizes its thread pools by the CPUs it may use (TensorFlow's hangs on one): never bound
    tensorflow = make_shell(tmp_path / "tf", framework="tensorflow")
    assert {tensorflow.supervisor.cpu_slot(r) for r in tensorflow.record.roles} == {(0, 0)}


def test_the_supervisor_starts_the_agents_at_its_first_pass_without_waiting_a_poll_interval(tmp_path: Path) -> None:
    """``psctl up`` waits for the agents before anything else: the first pass must not wait a poll interval."""
    made = make_shell(tmp_path)
    shell = made.supervisor
    shell.poll_interval = 120.0  # a first pass that waited would start no agent within the bound below
    shell.finish_wait = 0.1
    runner = threading.Thread(target=shell.run, name="supervisor", daemon=True)
    runner.start()
    try:
        hosts = set(shell.places)
        wait_until(lambda: hosts <= {h for h, a in made.record.agents.items() if a.get("pid")}, timeout=30,
                   what="every host's agent started")
    finally:
        shell.poll_interval = 0.01
        shell.request_stop()
        runner.join(timeout=30)
    assert not runner.is_alive()


def test_a_change_from_an_agent_wakes_the_supervisor_before_its_poll_interval_but_passes_stay_apart(
        tmp_path: Path) -> None:
    shell = make_shell(tmp_path).supervisor
    shell.poll_interval = 120.0  # only a wake-up ends the wait below within the test's bound
    passed = time.monotonic()
    shell.drain(wait=False)  # a pass, now (it began no sooner than ``passed``)
    woken: list[float] = []
    waiting = threading.Thread(target=lambda: (shell.drain(), woken.append(time.monotonic())), daemon=True)
    waiting.start()
    shell.hub.on_change()  # what the hub calls when an agent attaches, goes, or reports a role start or exit
    waiting.join(timeout=30)
    assert woken and woken[0] - passed >= MIN_PASS_GAP  # at once, but not sooner than the gap after the last
    waiting = threading.Thread(target=lambda: (shell.drain(), woken.append(time.monotonic())), daemon=True)
    waiting.start()
    shell.request_stop()  # psctl down: the finish begins at the next pass, which comes at once
    waiting.join(timeout=30)
    assert len(woken) == 2 and shell.stop_requested.is_set()

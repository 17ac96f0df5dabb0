"""psctl scale: the policy's side (replicas added and retired, a retired ps stopped only once the chief has
resharded without it, min_replicas), the command's checks, and the spec's bounds. The runtime's side (the
chief resharding, workers joining and leaving) is tested with real processes in test_scale_local.py."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from policy_driver import FakeCluster

from psctl.errors import SpecError, UsageError
from psctl.home import ClusterDir
from psctl.scaling import check_request, parse_targets, scale
from psctl.spec import ClusterSpec, load_spec, load_spec_text, make_plan
from psctl.supervisor import policy
from psctl.supervisor.policy import ScaleRequested, Slot, members
from psctl.supervisor.state import (
    ClusterRecord,
    ClusterState,
    RoleState,
    keep_spec,
    load_state,
    new_record,
    save_state,
)

SPEC = """\
name: elastic
roles:
  chief: {}
  ps: {replicas: 2, max_replicas: 3}
  worker: {replicas: 2, min_replicas: 2, max_replicas: 4, restart: {max_restarts: 0}}
training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
supervision: {heartbeat_interval: 1s, heartbeat_timeout: 5s, preemption_grace: 25s}
security: {tls: false}
"""


@pytest.fixture
def c(tmp_path: Path) -> FakeCluster:
    cluster = FakeCluster(SPEC, tmp_path)
    cluster.step()
    cluster.step(1)
    assert set(cluster.states().values()) == {RoleState.RUNNING}
    return cluster


def slots(role: str, *indexes: int) -> tuple[Slot, ...]:
    return tuple(Slot(i, "localhost", "127.0.0.1", 9000 + i) for i in indexes)


def chief_view(c: FakeCluster) -> dict[str, str]:
    return dict(policy.cluster_view(c.state).addresses["chief"].addresses)


def test_scaling_workers_up_starts_the_new_ones_and_tells_the_chief(c: FakeCluster) -> None:
    actions = c.step(observations=[ScaleRequested("worker", 4, slots("worker", 2, 3))])
    assert [r.name for r in members(c.record, "worker")] == ["worker-0", "worker-1", "worker-2", "worker-3"]
    # listed after the other workers (status shows them together), started at once, on their slot's port
    assert [r.name for r in c.record.roles] == ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "worker-2",
                                                "worker-3"]
    starts = {a.name for a in actions if isinstance(a, policy.StartRole)}
    assert starts == {"worker-2", "worker-3"}
    assert c.role("worker-3").port == 9003
    assert any(isinstance(a, policy.SendView) for a in actions)
    # the host's roles changed: its agent is told their CPU slots now (the running ones may move)
    assert [a for a in actions if isinstance(a, policy.RebindCpus)] == [policy.RebindCpus("localhost")]
    assert {"worker:2", "worker:3"} <= set(chief_view(c))
    assert [e.reason for e in c.events("cluster")][-1] == "psctl scale worker=4: worker 2 -> 4"
    added = c.events("worker-3")[0]  # (its "from" was empty: `psctl events` showed "-> pending")
    assert (added.was, added.to, added.reason) == ("new", "pending", "psctl scale worker=4: added on localhost")
    c.step(1)
    assert c.role("worker-3").state == RoleState.RUNNING


def test_scaling_workers_down_drains_the_highest_with_the_preemption_grace_and_never_restarts_them(
    c: FakeCluster,
) -> None:
    actions = c.step(observations=[ScaleRequested("worker", 1)])  # below min_replicas: the command refuses that
    stops = [a for a in actions if isinstance(a, policy.StopRole)]
    assert {(a.name, a.grace) for a in stops} == {("worker-1", 25.0)}  # (sent again: the agent keeps the first)
    assert c.role("worker-1").state == RoleState.STOPPED and c.role("worker-1").retired
    assert "worker:1" not in chief_view(c) and "worker:0" in chief_view(c)
    assert [a for a in actions if isinstance(a, policy.RebindCpus)] == [policy.RebindCpus("localhost")]
    c.process("worker-1").exit_code = 75  # it drained and left
    for _ in range(5):
        actions = c.step(2)
        assert not [a for a in actions if isinstance(a, policy.StartRole)]
    assert c.role("worker-1").pid is None  # gone: the slot may be scaled up again
    assert c.record.state == ClusterState.RUNNING

    c.step(observations=[ScaleRequested("worker", 2, slots("worker", 1))])
    assert [(e.was, e.to) for e in c.events("worker-1") if "added on" in e.reason][-1] == ("stopped", "pending")
    again = c.role("worker-1")
    assert not again.retired and again.attempt == 2  # its attempts go on: the first one's log stays
    c.step(1)
    assert again.state == RoleState.RUNNING


def test_a_retired_ps_is_stopped_only_once_the_chief_has_resharded_without_it(c: FakeCluster) -> None:
    c.step(observations=[ScaleRequested("ps", 3, slots("ps", 2))])
    c.step(1)
    assert c.role("ps-2").state == RoleState.RUNNING
    c.process("chief-0").metrics = {"ps_layout": 3.0}
    c.step(1)

    actions = c.step(observations=[ScaleRequested("ps", 2)])
    assert "ps:2" not in chief_view(c)
    assert not [a for a in actions if isinstance(a, policy.StopRole)]  # the chief still reads it
    for _ in range(3):
        c.step(1)
    assert c.role("ps-2").state == RoleState.RUNNING
    c.process("chief-0").metrics = {"ps_layout": 2.0}
    actions = c.step(1)
    assert [a.name for a in actions if isinstance(a, policy.StopRole)] == ["ps-2"]
    assert c.role("ps-2").state == RoleState.STOPPED
    assert c.role("ps-2").reason == "resharded onto 2 ps: scaled down"


def test_a_ps_scaled_down_while_the_chief_is_away_waits_for_the_next_chief_to_reshard(c: FakeCluster) -> None:
    """A chief lost before it resharded: the leaving ps was stopped at once, and the next chief restored the
    latest checkpoint onto the new layout (the steps since it trained again). The ps stays; the next chief starts
    on the layout the last one left (with it: ``chief_ps_layout``), resumes from the ps, and reshards."""
    c.process("chief-0").metrics = {"ps_layout": 2.0}
    c.step(1)
    c.step(observations=[ScaleRequested("ps", 3, slots("ps", 2))])
    c.step(1)
    # added, not resharded onto yet: a chief starting now starts on the two that hold the variables
    assert [r.name for r in policy.chief_ps_layout(c.record) or []] == ["ps-0", "ps-1"]
    c.process("chief-0").metrics = {"ps_layout": 3.0}
    c.step(1)
    assert policy.chief_ps_layout(c.record) is None
    c.step(observations=[ScaleRequested("ps", 2)])
    assert [r.name for r in policy.chief_ps_layout(c.record) or []] == ["ps-0", "ps-1", "ps-2"]
    c.process("chief-0").exit_code = -9  # lost before it resharded
    for _ in range(5):
        c.step(1)
    assert c.role("chief-0").attempt == 2 and c.role("chief-0").state == RoleState.RUNNING
    assert c.role("ps-2").state == RoleState.RUNNING  # still holding its part of the layout
    c.process("chief-0").metrics = {"ps_layout": 3.0}  # the next chief on the old layout...
    c.step(1)
    assert c.role("ps-2").state == RoleState.RUNNING
    c.process("chief-0").metrics = {"ps_layout": 2.0}  # ...resharded
    actions = c.step(1)
    assert [a.name for a in actions if isinstance(a, policy.StopRole)] == ["ps-2"]
    assert c.role("ps-2").reason == "resharded onto 2 ps: scaled down"
    assert policy.chief_ps_layout(c.record) is None


def test_workers_failing_for_good_end_the_cluster_below_min_replicas(tmp_path: Path) -> None:
    c = FakeCluster(SPEC.replace("min_replicas: 2", "min_replicas: 1"), tmp_path)
    c.step()
    c.step(1)
    c.process("worker-1").exit_code = 1  # max_restarts 0: failed for good
    c.step(1)
    assert c.role("worker-1").state == RoleState.FAILED
    assert c.record.state == ClusterState.RUNNING  # one worker left, min_replicas 1: training goes on

    c = FakeCluster(SPEC, tmp_path)
    c.step()
    c.step(1)
    c.process("worker-1").exit_code = 1
    c.step(1)
    assert c.record.state == ClusterState.FAILED
    assert "1 worker(s) left, fewer than min_replicas (2)" in c.record.reason


def record_for(tmp_path: Path, text: str) -> tuple[ClusterSpec, ClusterRecord]:
    spec = load_spec_text(text, filename=str(tmp_path / "spec.yaml"))
    plan = make_plan(spec, check_ports=False)
    cluster = FakeCluster(text, tmp_path)
    cluster.record.spec_path = str(tmp_path / "spec.yaml")
    cluster.record.supervisor_pid = os.getpid()
    cluster.record.supervisor_create_time = psutil.Process().create_time()
    cluster.record.state = ClusterState.RUNNING
    assert plan.spare_slots() == [("ps-2", ()), ("worker-2", ()), ("worker-3", ())]
    return spec, cluster.record


@pytest.mark.parametrize(("targets", "message"), [
    ([], "say what to scale, e.g. `psctl scale NAME worker=4` (or ps=3)"),
    (["worker"], "'worker' is not ROLE=N; write e.g. worker=4 or ps=3"),
    (["chief=2"], "chief cannot be scaled: only worker and ps have replicas to change"),
    (["worker=2", "worker=3"], "worker is given twice; give it once"),
])
def test_scale_targets_that_are_not_role_equals_n_are_usage_errors(targets: list[str], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_targets(targets)
    assert caught.value.format_message() == message
    assert caught.value.exit_code == 2


def test_scale_requests_outside_the_specs_bounds_name_the_line_to_change(tmp_path: Path) -> None:
    spec, record = record_for(tmp_path, SPEC)
    check_request(ClusterDir(tmp_path), spec, record, {"worker": 4, "ps": 3})  # within bounds: no error
    cases = {
        "worker=5": ({"worker": 5}, f"worker=5 is more than roles.worker.max_replicas (4) in {tmp_path}/spec.yaml:5 "
                     "(raise max_replicas there and `psctl up` again: every replica's certificate and port are "
                     "made at up)"),
        "worker=1": ({"worker": 1}, f"worker=1 is fewer than roles.worker.min_replicas (2) in {tmp_path}/spec.yaml:5"
                     " (scale to at least 2)"),
    }
    for name, (wanted, message) in cases.items():
        with pytest.raises(UsageError) as caught:
            check_request(ClusterDir(tmp_path), spec, record, wanted)
        assert str(caught.value) == message, name

    record.supervisor_pid = None
    with pytest.raises(UsageError, match=r"no supervisor running.*psctl supervise elastic"):
        check_request(ClusterDir(tmp_path), spec, record, {"worker": 3})
    record.state = ClusterState.SUCCEEDED
    record.spec_path, record.spec_overrides = "/specs/el.yaml", ["name=s2"]
    with pytest.raises(UsageError, match="has succeeded; there is nothing to scale") as done:
        check_request(ClusterDir(tmp_path), spec, record, {"worker": 3})
    # its run's overrides too (without them, `up` of the spec alone starts the spec's own name)
    assert done.value.hint == "start it again with `psctl up /specs/el.yaml --set name=s2`"


def test_a_scale_while_the_last_scale_down_s_workers_finish_their_steps_says_so(tmp_path: Path) -> None:
    """It said to try again once `psctl status` no longer showed them running, while status showed them stopped
    (told to go) from the moment of the scale-down."""
    spec, record = record_for(tmp_path, SPEC)
    leaving = next(r for r in record.roles if r.name == "worker-1")
    leaving.retired, leaving.state, leaving.pid = True, RoleState.STOPPED, 4242  # its process still finishing
    with pytest.raises(UsageError) as caught:
        check_request(ClusterDir(tmp_path), spec, record, {"worker": 3})
    assert str(caught.value) == ("worker-1 of the last scale-down are still finishing their steps (try again in a "
                                 "moment: they leave within supervision.preemption_grace (25s))")
    leaving.pid = None  # gone
    check_request(ClusterDir(tmp_path), spec, record, {"worker": 3})


@pytest.mark.parametrize("distinct", [False, True])
def test_synchronous_workers_scale_below_the_replicas_aggregated_unless_each_must_give_one(
    tmp_path: Path, distinct: bool
) -> None:
    """Fewer workers than replicas_to_aggregate compute several batches a step (the spec lets one start so):
    `scale worker=1` was refused as "no synchronous step could complete"; with distinct_replicas it could not."""
    text = SPEC.replace("min_replicas: 2, ", "").replace(
        "steps: 10}", f"steps: 10, mode: sync, replicas_to_aggregate: 2, distinct_replicas: {str(distinct).lower()}}}")
    spec, record = record_for(tmp_path, text)
    if not distinct:
        check_request(ClusterDir(tmp_path), spec, record, {"worker": 1})
        return
    with pytest.raises(UsageError, match=r"^worker=1 is fewer than training.replicas_to_aggregate \(2\), and "
                                         r"distinct_replicas takes one gradient from each worker per step"):
        check_request(ClusterDir(tmp_path), spec, record, {"worker": 1})


def test_spec_bounds_are_checked_where_they_are_written(tmp_path: Path) -> None:
    def error(roles: str) -> str:
        text = (f"name: b\nroles:\n  chief: {{}}\n  {roles}\n"
                "training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}\n")
        with pytest.raises(SpecError) as caught:
            load_spec_text(text, filename="b.yaml")
        return str(caught.value)

    assert error("ps: {replicas: 2, max_replicas: 1}\n  worker: {}") == (
        "b.yaml:4: roles.ps.max_replicas: 1 is fewer than replicas (2); write at least 2, or lower replicas")
    assert error("ps: {}\n  worker: {replicas: 2, min_replicas: 3}") == (
        "b.yaml:5: roles.worker.min_replicas: 3 is more than replicas (2); write at most 2, or raise replicas")
    assert error("ps: {}\n  worker: {}\n  evaluator: {max_replicas: 2}") == (
        "b.yaml:6: roles.evaluator.max_replicas: the evaluator has exactly one replica and is never scaled; "
        "remove it (only roles.ps and roles.worker have max_replicas)")
    assert error("ps: {}\n  worker: {max_replicas: 3, ports: [7001, 7002]}") == (
        "b.yaml:5: roles.worker: 3 replicas (max_replicas) but 2 ports; list 3 ports or give a base `port:`")


def test_a_clusters_set_overrides_bound_its_scaling_as_they_bound_its_start(tmp_path: Path) -> None:
    """`psctl up SPEC --set roles.worker.max_replicas=6`: the record keeps the override, and `psctl scale` reads
    the spec the cluster started with (its text as it was at `up`, the file alone allows 4) with the override,
    naming the --set where a request passes the bound."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC, encoding="utf-8")
    spec = load_spec(spec_path, ["roles.worker.max_replicas=6"])
    record = new_record(spec, make_plan(spec, check_ports=False))
    assert record.spec_overrides == ["roles.worker.max_replicas=6"]
    record.supervisor_pid, record.supervisor_create_time = os.getpid(), psutil.Process().create_time()
    record.state = ClusterState.RUNNING
    cdir = ClusterDir(tmp_path / "home" / "elastic")
    cdir.create()
    keep_spec(cdir.spec_file, spec)
    save_state(cdir.state_file, record)
    assert load_state(cdir.state_file).spec_overrides == ["roles.worker.max_replicas=6"]
    # the file edited since `up` (for the next run) changes nothing for this cluster
    spec_path.write_text("name: elastic\nroles: [unfinished\n", encoding="utf-8")
    with pytest.raises(UsageError) as caught:
        scale(cdir, {"worker": 7}, timeout=0.1)
    assert str(caught.value).startswith("worker=7 is more than roles.worker.max_replicas (6) in --set "
                                        "roles.worker.max_replicas=6 ")
    check_request(cdir, spec, record, {"worker": 6})  # beyond the file's 4: allowed by the override

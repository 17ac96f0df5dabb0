"""The supervisor's policy (psctl.supervisor.policy.decide), driven step by step with an injected clock over
simulated agents (see policy_driver): restart policy, backoff, permanent exits, fencing, stalls, completion,
adoption after a supervisor restart, and the transition tables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from policy_driver import FakeCluster

from psctl.runtime.exits import EXIT_TRAINING_OVER
from psctl.supervisor import policy
from psctl.supervisor.state import ClusterState, RoleRecord, RoleState

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
def c(tmp_path: Path) -> FakeCluster:
    cluster = FakeCluster(SPEC, tmp_path)
    cluster.step()  # the agent says hello: every role is started
    return cluster


def running(c: FakeCluster) -> None:
    c.step(1)
    assert set(c.states().values()) == {RoleState.RUNNING}


def test_roles_start_once_their_agent_attached_and_run_once_they_heartbeat(tmp_path: Path) -> None:
    c = FakeCluster(SPEC, tmp_path)
    c.cut.add("localhost")
    actions = c.step()
    assert [a for a in actions if isinstance(a, policy.StartRole)] == []  # no agent yet: nothing starts
    assert [a.host for a in actions if isinstance(a, policy.StartAgent)] == ["localhost"]
    c.cut.clear()
    starts = [a for a in c.step(0.5) if isinstance(a, policy.StartRole)]
    assert sorted(a.name for a in starts) == ["chief-0", "ps-0", "worker-0", "worker-1"]
    assert all(a.attempt == 1 for a in starts)
    assert set(c.states().values()) == {RoleState.STARTING}
    c.step(1)
    assert set(c.states().values()) == {RoleState.RUNNING}
    assert c.record.state == ClusterState.RUNNING
    assert c.role("worker-0").pid == c.process("worker-0").pid


def test_a_silent_role_is_lost_killed_and_restarted_after_its_backoff(c: FakeCluster) -> None:
    running(c)
    first = c.process("worker-1")
    c.step(6, silent=("worker-1",))  # silent for longer than heartbeat_timeout (5 s); the others keep beating
    assert c.role("worker-1").state == RoleState.RESTARTING
    assert first.exit_code == -9, "the silent process was not killed"
    assert any(e.to == "lost" and e.reason == "no heartbeat for 6.0s (hung or cut off)" for e in c.events("worker-1"))
    c.step(0.5)  # backoff is 1 s ± 20% jitter: not yet
    assert c.role("worker-1").state == RoleState.RESTARTING
    c.step(1.0)
    worker = c.role("worker-1")
    assert (worker.state, worker.attempt, worker.restarts) == (RoleState.STARTING, 2, 1)
    assert c.process("worker-1").pid != first.pid and worker.incarnation > first.incarnation


def test_restarts_stop_at_max_restarts_and_backoff_grows(c: FakeCluster) -> None:
    running(c)
    backoffs = []
    for _ in range(2):  # max_restarts: 2
        c.process("worker-0").exit_code = 1
        c.step()
        assert c.role("worker-0").state == RoleState.RESTARTING
        due = c.state.roles["worker-0"].restart_at
        assert due is not None
        backoffs.append(due - c.now)
        c.step(due - c.now + 0.01)
        c.step(0.1)
    assert backoffs[1] > backoffs[0]  # 1 s then 2 s (each ±20%, within backoff_seconds..max_backoff_seconds)
    assert 1.0 <= backoffs[0] <= 1.2 and 1.6 <= backoffs[1] <= 2.4, backoffs  # (0.8 s was below the 1 s floor)
    c.process("worker-0").exit_code = 1
    c.step()
    assert c.role("worker-0").state == RoleState.FAILED
    assert "not restarted: restarted 2 times in a row, the limit (max_restarts)" in c.role("worker-0").reason
    assert c.record.state == ClusterState.RUNNING  # one worker left: training goes on


def test_a_role_whose_last_beat_said_it_exits_is_given_time_to_end(c: FakeCluster) -> None:
    """A preempted role that took longer to end than the heartbeat timeout (its program's threads, a loaded
    machine) was killed as hung and counted as a failure: its last beat says it exits, and its silence counts
    EXIT_ALLOWANCE longer; its end, when its agent reports it, is what it was."""
    running(c)
    c.process("worker-1").status = "exiting"
    c.step(0.5)
    c.step(6, silent=("worker-1",))  # past the 5 s heartbeat timeout: not taken for hung
    assert c.role("worker-1").state == RoleState.RUNNING
    c.process("worker-1").exit_code = 75  # preempted
    c.step()
    assert [e.reason for e in c.events("worker-1") if e.to == "lost"] == [
        "preempted (stopped by SIGTERM)"]
    # and one that never ends after all is taken for hung, only later
    c.step(2)
    c.process("worker-0").status = "exiting"
    c.step(0.5)
    c.step(policy.EXIT_ALLOWANCE + 4, silent=("worker-0",))
    assert not [e for e in c.events("worker-0") if e.to == "lost"]
    c.step(2, silent=("worker-0",))
    assert next(e.reason for e in c.events("worker-0") if e.to == "lost").startswith("no heartbeat for")


def test_an_exit_is_reported_with_its_code_and_the_last_lines_of_its_log(c: FakeCluster) -> None:
    running(c)
    c.process("worker-0").exit_code = -9
    c.step()
    assert re.fullmatch(r"killed by SIGKILL; restart 1 in [0-9.]+s", c.role("worker-0").reason), c.role("worker-0")
    assert any(e.to == "lost" and e.reason == "killed by SIGKILL" for e in c.events("worker-0"))


LOGGED = "2026-11-27 10:00:0{},000 {} {}"


@pytest.mark.parametrize(("code", "tail", "said"), [
    # the runtime's own refusal, logged at ERROR after other lines
    (3, " | ".join([LOGGED.format(1, "INFO", "training mlp: 4 variables"), LOGGED.format(
        2, "ERROR", "training failed: worker:0: program error: ValueError: shapes (100,64) and (32,10)"),
        LOGGED.format(3, "INFO", "stopped")]),
     "exit code 3: training failed: worker:0: program error: ValueError: shapes (100,64) and (32,10)"),
    # an uncaught exception: its traceback's last line, not the frames above it
    (1, 'Traceback (most recent call last): | File "prog.py", line 3, in build | raise KeyError(\'lr\') | '
        "KeyError: 'lr'", "exit code 1: KeyError: 'lr'"),
    (-9, "RuntimeError | (a bare exception line names no message)", "killed by SIGKILL: RuntimeError"),
    # a native crash: the agent's one line of the fault handler's report (psctl.agent.logs)
    (-6, "loading | Check failed: 1 == NumElements() (1 vs. 2) (tensorflow/core/framework/tensor.cc:669); then "
         "Fatal Python error: Aborted in quick_execute (tensorflow/python/eager/execute.py:53)",
     "killed by SIGABRT: Check failed: 1 == NumElements() (1 vs. 2) (tensorflow/core/framework/tensor.cc:669); "
     "then Fatal Python error: Aborted in quick_execute (tensorflow/python/eager/execute.py:53)"),
    (-11, "step 12 | Fatal Python error: Segmentation fault in string_at (ctypes/__init__.py:519), called from "
          "step (/home/me/train.py:42)", "killed by SIGSEGV: Fatal Python error: Segmentation fault in string_at "
                                         "(ctypes/__init__.py:519), called from step (/home/me/train.py:42)"),
    # a gRPC error: its first line says only that it is one; its status and details are on the lines after it
    (1, 'Traceback (most recent call last): | grpc._channel._InactiveRpcError: <_InactiveRpcError of RPC that '
        'terminated with: | \tstatus = StatusCode.UNAVAILABLE | \tdetails = "failed to connect to all addresses" | '
        '\tdebug_error_string = "UNKNOWN:Error received from peer" | >',
     "exit code 1: grpc._channel._InactiveRpcError: UNAVAILABLE: failed to connect to all addresses"),
    # nothing that gives a cause: the last lines as they are
    (1, "loading | step 7", "exit code 1; last log lines: loading | step 7"),
    (-9, "", "killed by SIGKILL"),
])
def test_an_exit_says_the_cause_its_log_gives(code: int, tail: str, said: str) -> None:
    assert policy.exit_text(code, tail) == said


def test_a_failed_role_s_reason_leads_with_the_error_its_log_ends_with(c: FakeCluster) -> None:
    running(c)
    ps = c.process("ps-0")
    ps.log_tail = " | ".join([LOGGED.format(1, "INFO", "serving"),
                              LOGGED.format(2, "ERROR", "configuration error: checkpoint dir /x is not writable")])
    ps.exit_code = 2
    c.step()
    assert c.role("ps-0").state == RoleState.FAILED
    said = "ps-0 failed: exit code 2: configuration error: checkpoint dir /x is not writable; not restarted"
    assert c.record.reason.startswith(said), c.record.reason


TRACEBACK = 'Traceback (most recent call last): | File "train.py", line 88, in <module> | {}'


@pytest.mark.parametrize(("raised", "restarted"), [
    ("NameError: name 'lr_schedule' is not defined", False),
    ("  File \"train.py\", line 9 | SyntaxError: invalid syntax", False),
    ("ModuleNotFoundError: No module named 'tensorflow_addons'", False),
    ("UnboundLocalError: cannot access local variable 'loss' where it is not associated with a value", False),
    # what a restart may not meet again: the data, the cluster, the machine
    ("ValueError: could not convert string to float: 'n/a'", True),
    ("tensorflow.python.framework.errors_impl.UnavailableError: failed to connect to all addresses", True),
    ("MemoryError", True),
    # the interpreter's complaints as it shut down (a module's globals gone), after whatever ended the role
    ("OSError: [Errno 5] Input/output error | Exception ignored in: <function Pool.__del__> | NameError: name "
     "'open' is not defined", True),
])
def test_a_role_that_ends_twice_with_the_same_error_of_the_program_s_text_is_not_restarted_again(
        c: FakeCluster, raised: str, restarted: bool) -> None:
    """A NameError (a typo on a path first taken at step 100), SyntaxError or missing module is raised again by
    every restart: a TensorFlow chief's cost ~10 restarts (minutes, TensorFlow's start each time) before
    max_restarts ended it. Restarted once (an ImportError can be one moment's file system), not twice."""
    running(c)
    for attempt in (1, 2):
        chief = c.process("chief-0")
        chief.log_tail = TRACEBACK.format(raised)
        chief.exit_code = 1
        c.step()
        role = c.role("chief-0")
        if attempt == 1 or restarted:
            assert role.state == RoleState.RESTARTING, role.reason
            for _ in range(10):  # (its backoff, then running again)
                c.step(1)
            assert role.state == RoleState.RUNNING and role.attempt == attempt + 1, role.reason
    if restarted:
        return
    line = raised.rsplit(" | ", 1)[-1]
    assert role.state == RoleState.FAILED and c.record.state == ClusterState.FAILED
    assert c.record.reason == (f"chief-0 failed: exit code 1: {line}; not restarted: a {line.split(':')[0]} is the "
                               "program's own error, raised again by the restart; fix the program, then psctl up "
                               "again"), c.record.reason


def test_a_permanent_exit_code_is_not_restarted_and_a_failed_ps_fails_the_cluster(c: FakeCluster) -> None:
    running(c)
    c.process("ps-0").exit_code = 2  # bad configuration
    c.step()
    assert c.role("ps-0").state == RoleState.FAILED
    assert "permanent" in c.role("ps-0").reason
    assert c.record.state == ClusterState.FAILED
    assert all(r.state.terminal for r in c.record.roles)
    assert c.running() == set(), "a failed cluster left processes running"
    # the others were stopped because the cluster failed, and say so (not "cluster finished")
    assert c.role("worker-0").reason == f"the cluster failed: {c.record.reason}", c.role("worker-0").reason


def test_a_process_of_a_replaced_incarnation_is_stopped_when_its_agent_reports_it(c: FakeCluster) -> None:
    running(c)
    old = c.process("worker-0")
    stale = c.processes["localhost"]["worker-9"] = type(old)("worker-9", 1, 1, 4242)  # unknown to the cluster
    c.role("worker-0").incarnation += 1  # replaced (the supervisor restarted it elsewhere, say)
    actions = c.step()
    stops = {(a.name, a.incarnation) for a in actions if isinstance(a, policy.StopRole)}
    assert ("worker-0", old.incarnation) in stops and ("worker-9", 1) in stops
    assert old.exit_code == stale.exit_code == -9


def test_a_role_whose_step_stops_while_others_progress_is_stalled_then_running_again(c: FakeCluster) -> None:
    running(c)
    for step in range(1, 40):  # worker-0 stuck at local step 5, worker-1 advancing
        c.process("chief-0").global_step = step
        c.process("worker-0").local_step = 5
        c.process("worker-1").local_step = step
        c.step(1)
    assert c.role("worker-0").state == RoleState.STALLED
    assert "has not moved" in c.role("worker-0").reason
    assert c.role("worker-1").state == RoleState.RUNNING
    c.process("worker-0").local_step = 6
    c.step(1)
    assert c.role("worker-0").state == RoleState.RUNNING


def test_a_restarted_worker_s_steps_count_from_its_start_not_its_last_attempt_s(c: FakeCluster) -> None:
    """A worker stuck at step 0, killed and restarted, is at step 0 again when it starts: its new attempt was
    called stalled at once, judged by when the last attempt last moved."""
    running(c)
    for step in range(1, 40):
        c.process("worker-1").local_step = step
        c.step(1)
    assert c.role("worker-0").state == RoleState.STALLED
    c.process("worker-0").exit_code = -9
    for step in range(40, 60):  # restarted after its backoff; 20 s, within the 30 s stall timeout
        c.process("worker-1").local_step = step
        c.step(1)
    assert (c.role("worker-0").attempt, c.role("worker-0").state) == (2, RoleState.RUNNING), c.role("worker-0")


def test_the_chief_finishing_stops_everyone_and_succeeds(c: FakeCluster) -> None:
    running(c)
    c.process("chief-0").exit_code = 0
    actions = c.step()
    assert c.record.state == ClusterState.SUCCEEDED
    assert c.role("chief-0").state == RoleState.SUCCEEDED
    assert all(c.role(n).state == RoleState.STOPPED for n in ("ps-0", "worker-0", "worker-1"))
    assert {a.name for a in actions if isinstance(a, policy.StopRole)} == {"ps-0", "worker-0", "worker-1"}
    assert c.running() == set()


def test_ps_and_workers_that_end_by_themselves_before_the_chief_is_seen_finishing_are_not_restarted(
    c: FakeCluster,
) -> None:
    """psctl's ps and workers exit 0 only once the chief said training is over and nothing stopped them (their
    supervisor had died): a new supervisor may see them end before the chief does. Not losses: nothing is
    restarted, and the chief's end finishes the cluster."""
    running(c)
    for name in ("ps-0", "worker-1"):
        c.process(name).exit_code = EXIT_TRAINING_OVER
    actions = c.step()
    assert [c.role(n).state for n in ("ps-0", "worker-1")] == [RoleState.SUCCEEDED] * 2
    assert c.role("ps-0").reason == "training is over: it ended by itself"
    assert not [a for a in actions if isinstance(a, policy.StartRole)] and c.record.state == ClusterState.RUNNING
    later = [a for _ in range(5) for a in c.step(1)]
    assert not [a for a in later if isinstance(a, policy.StartRole)], later
    c.process("chief-0").exit_code = 0
    c.step()
    assert c.record.state == ClusterState.SUCCEEDED and c.role("worker-0").state == RoleState.STOPPED


def test_a_ps_exit_0_is_not_taken_for_the_training_s_end(c: FakeCluster) -> None:
    """Only the runtime's own code says training is over: a program that calls sys.exit(0) as a ps loads it,
    say, is a ps lost, and restarted."""
    running(c)
    c.process("ps-0").exit_code = 0
    c.step()
    assert c.role("ps-0").state == RoleState.RESTARTING and c.record.state == ClusterState.RUNNING


def test_the_step_a_role_reports_as_it_exits_is_its_last(c: FakeCluster) -> None:
    """A watched program's step is read from its log, also from the lines it printed just before it exited; the
    report that says it exited carries that step, and it counts (it was lost, and the chief showed an old step)."""
    running(c)
    chief = c.process("chief-0")
    chief.global_step = 250
    c.step(1)
    assert c.role("chief-0").global_step == 250
    chief.global_step, chief.exit_code = 300, 0
    c.step()
    assert c.role("chief-0").state == RoleState.SUCCEEDED
    assert c.role("chief-0").global_step == 300


def test_the_heartbeat_a_role_sends_as_it_exits_is_its_last_word(c: FakeCluster) -> None:
    """A role on its way out sends one last heartbeat (an evaluator's last evaluation comes after its last
    periodic one); the report that says it exited carries it, and its metrics and steps are the role's."""
    running(c)
    chief = c.process("chief-0")
    chief.metrics, chief.local_step = {"accuracy": 0.90}, 40
    c.step(1)
    assert (c.role("chief-0").metrics, c.role("chief-0").local_step) == ({"accuracy": 0.90}, 40)
    chief.metrics, chief.local_step, chief.beat, chief.exit_code = {"accuracy": 0.98}, 50, c.now + 0.5, 0
    c.step(0.5)
    assert c.role("chief-0").state == RoleState.SUCCEEDED
    assert (c.role("chief-0").metrics, c.role("chief-0").local_step) == ({"accuracy": 0.98}, 50)


def test_the_last_heartbeat_of_a_role_stopped_at_the_end_of_training_counts(c: FakeCluster) -> None:
    """The workers are stopped once the chief is done; each beats once more on its way out with the steps it ran
    since its last periodic beat. Those count (status once showed the workers' steps short of the total), but
    a report of a replaced attempt does not."""
    running(c)
    worker = c.process("worker-0")
    worker.local_step = 4
    c.step(1)
    worker.local_step, c.process("chief-0").exit_code = 6, 0
    c.step()  # the chief's exit: the others are stopped (here they exit at once, before beating again)
    assert c.role("worker-0").state == RoleState.STOPPED and c.role("worker-0").local_step == 4
    worker.beat = c.now + 0.2  # the last beat, reported with its exit
    c.step(0.5)
    assert (c.role("worker-0").state, c.role("worker-0").local_step) == (RoleState.STOPPED, 6)
    stale = c.process("worker-1")
    stale.incarnation, stale.local_step, stale.beat = stale.incarnation + 1, 99, c.now + 0.2
    c.step(0.5)
    assert c.role("worker-1").local_step != 99


def test_a_role_a_new_agent_adopted_is_given_its_heartbeat_timeout_from_that_agent_s_hello(c: FakeCluster) -> None:
    """While a host has no agent its roles' heartbeats go nowhere; a new agent that adopted them says so in its
    hello, and their silence counts from there (they were lost and restarted while the new agent dialled in)."""
    running(c)
    everyone = [r.name for r in c.record.roles]
    c.cut.add("localhost")  # the agent died: no report, no heartbeat reaches anyone
    c.step(observations=[policy.Detached("localhost", 1, "its agent's stream ended")])
    c.step(4.0, silent=everyone)
    c.cut.clear()
    c.hello.add("localhost")  # its successor adopted every role; their first beats to it are yet to come
    c.step(0.5, silent=everyone)
    c.step(2.0, silent=everyone)  # 6.5 s since their last beat, past the 5 s timeout: 2 s since the hello
    assert set(c.states().values()) == {RoleState.RUNNING}
    c.step(3.1, silent=["worker-1"])  # one still silent 5.1 s after the hello: hung
    assert c.role("worker-1").state != RoleState.RUNNING
    assert all(c.role(n).state == RoleState.RUNNING for n in ("chief-0", "ps-0", "worker-0"))


def test_psctl_down_stops_every_role_with_its_grace(c: FakeCluster) -> None:
    running(c)
    actions = c.step(observations=[policy.StopRequested(12.0)])
    assert {(a.name, a.grace) for a in actions if isinstance(a, policy.StopRole)} == {
        (n, 12.0) for n in ("chief-0", "ps-0", "worker-0", "worker-1")}
    assert c.record.state == ClusterState.STOPPED
    assert all(r.reason == "stopped by psctl down" for r in c.record.roles)


def test_a_restarted_supervisor_adopts_the_roles_its_agents_report_without_restarting_them(
        c: FakeCluster, tmp_path: Path) -> None:
    running(c)
    pids = {name: c.process(name).pid for name in c.states()}
    incarnations = {r.name: r.incarnation for r in c.record.roles}
    # A new supervisor: the same record (as read from the state file), new policy state, a clock of its own.
    restarted = FakeCluster(SPEC, tmp_path)
    restarted.record.roles = c.record.roles
    restarted.record.state = c.record.state
    restarted.state = policy.PolicyState(restarted.record, restarted.spec, restarted.state.hosts, wall_offset=0.0)
    restarted.processes = c.processes
    restarted.state.adopt(restarted.now)
    actions = restarted.step(0.5)  # the agent dials in: its hello reports every role
    assert [a for a in actions if isinstance(a, (policy.StartRole, policy.StopRole))] == []
    restarted.step(1)
    assert set(restarted.states().values()) == {RoleState.RUNNING}
    assert {n: restarted.process(n).pid for n in pids} == pids
    assert {r.name: r.incarnation for r in restarted.record.roles} == incarnations
    assert all(r.restarts == 0 for r in restarted.record.roles)


def test_roles_of_an_agent_that_never_comes_back_are_lost_after_the_heartbeat_timeout(tmp_path: Path) -> None:
    c = FakeCluster(SPEC, tmp_path)
    c.step()
    running(c)
    c.cut.add("localhost")
    actions = c.step(6)
    assert any(e.subject == "host localhost" and e.to == "unreachable" for e in c.events())
    assert any(isinstance(a, policy.StartAgent) for a in actions)
    assert {r.state for r in c.record.roles} == {RoleState.RESTARTING}


def test_an_agent_restarted_without_its_roles_has_them_restarted_at_once(c: FakeCluster) -> None:
    running(c)
    c.processes["localhost"].clear()  # a new agent: the old one's roles are gone (it swept them)
    c.hello.add("localhost")
    c.step(0.1)
    assert {r.state for r in c.record.roles} == {RoleState.RESTARTING}
    assert all("agent restarted without it" in e.reason for e in c.events() if e.to == "lost")


def test_an_agent_that_cannot_be_started_during_up_fails_the_cluster_with_the_reason(tmp_path: Path) -> None:
    c = FakeCluster(SPEC, tmp_path)
    c.cut.add("localhost")
    c.step(observations=[policy.AgentStartFailed("localhost", "python3 not found")])
    assert c.record.state == ClusterState.FAILED
    assert "cannot start on localhost: python3 not found" in c.record.reason


def test_transitions_outside_the_table_are_refused() -> None:
    role = RoleRecord("worker-0", "worker", 0, "localhost", "127.0.0.1", 7000, state=RoleState.STOPPED)
    with pytest.raises(policy.IllegalTransition, match="stopped -> running"):
        policy.transition(role, RoleState.RUNNING)
    role.state = RoleState.PENDING
    with pytest.raises(policy.IllegalTransition):
        policy.transition(role, RoleState.RESTARTING)
    assert policy.transition(role, RoleState.STARTING, "attempt 1") is not None
    for state in RoleState:  # terminal states go nowhere; every other state can be stopped
        assert (policy.ROLE_TRANSITIONS[state] == frozenset()) == state.terminal
        assert state.terminal or RoleState.STOPPED in policy.ROLE_TRANSITIONS[state]


def test_the_policy_module_does_no_io_and_reads_no_clock() -> None:
    source = Path(policy.__file__).read_text()
    for forbidden in ("import time", "import threading", "import os", "open(", "import grpc", "socket"):
        assert forbidden not in source, forbidden


def test_a_preempted_role_s_reason_says_how_it_left(c: FakeCluster) -> None:
    """(It said "left within its grace" also of a worker whose grace ran out with steps running, re-run.)"""
    running(c)
    worker = c.process("worker-0")
    worker.log_tail = ("2026-11-28 06:20:01,000 INFO worker:0 stopping: 2 step(s) still running after 0.5s | "
                       "2026-11-28 06:20:01,100 INFO worker:0 stopped")
    worker.exit_code = policy.EXIT_PREEMPTED
    c.step()
    assert [e.reason for e in c.events("worker-0") if e.to == "lost"] == [
        "preempted (stopped by SIGTERM): 2 step(s) still running after 0.5s"]


def test_a_preempted_role_is_restarted_without_counting_it_as_a_failure(tmp_path: Path) -> None:
    c = FakeCluster(SPEC.replace("max_restarts: 2", "max_restarts: 0"), tmp_path)
    c.step()
    running(c)
    for attempt in (2, 3):  # preempted twice: restarted twice, although no failure may be restarted
        c.process("worker-0").exit_code = policy.EXIT_PREEMPTED
        c.step()
        worker = c.role("worker-0")
        assert worker.state == RoleState.RESTARTING and worker.reason.endswith("(preempted)"), worker.reason
        assert c.state.roles["worker-0"].failures_in_a_row == 0
        c.step(1.01)  # its policy's first backoff (1 s), no jitter
        assert (c.role("worker-0").state, c.role("worker-0").attempt) == (RoleState.STARTING, attempt)
        c.step(0.1)
    lost = [e for e in c.events("worker-0") if e.to == "lost"]
    assert [e.reason for e in lost] == ["preempted (stopped by SIGTERM)"] * 2
    c.process("worker-0").exit_code = 1  # a real failure is still one
    c.step()
    assert c.role("worker-0").state == RoleState.FAILED


def test_a_tensorflow_program_s_workers_are_never_called_stalled(tmp_path: Path) -> None:
    """A TensorFlow program's worker prints no step of its own (its step stays 0): the one whose first heartbeat
    came first was reported "stalled ... while others progress" after the stall timeout, every run."""
    (tmp_path / "train.py").write_text("")
    spec = SPEC.replace("training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}",
                        "training: {framework: tensorflow, command: 'python train.py'}")
    c = FakeCluster(spec, tmp_path)
    c.step()
    c.step(0.5, silent=["worker-1"])  # worker-0's first heartbeat, then worker-1's
    for step in range(1, 80):
        c.process("chief-0").global_step = step  # (the chief prints the global step)
        c.step(1)
    assert {n: c.role(n).state for n in ("chief-0", "worker-0", "worker-1")} == dict.fromkeys(
        ("chief-0", "worker-0", "worker-1"), RoleState.RUNNING)
    # nor its chief, which prints its step when it will (at a checkpoint, say), when a worker restarts meanwhile
    # (its start counted as the others' progress: "stalled ... while others progress")
    c.process("worker-1").exit_code = -9
    for _ in range(60):
        c.step(1)
    assert c.role("worker-1").attempt == 2
    assert not [e for e in c.events("chief-0") if e.to == "stalled"], c.events("chief-0")


def test_a_tensorflow_chief_restarts_with_a_lost_ps_once_the_ps_runs_again(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    spec = SPEC.replace("training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}",
                        "training: {framework: tensorflow, command: 'python train.py'}")
    c = FakeCluster(spec, tmp_path)
    c.step()
    running(c)
    c.process("chief-0").global_step = 300  # (as it printed)
    c.step(0.5)
    c.process("ps-0").exit_code = -9
    c.step()
    chief = c.role("chief-0")
    assert chief.state == RoleState.RESTARTING and chief.reason.endswith("(with the ps)")
    assert c.process("chief-0").exit_code == -9  # its coordinator cannot outlive the ps: stopped at once
    assert c.state.roles["chief-0"].failures_in_a_row == 0
    order = []
    for _ in range(12):  # 3.6 s: the ps restarts after its backoff (1 s +- 20%), the chief only once it runs
        c.step(0.3)
        order.append((c.role("ps-0").state, chief.state))
    assert (RoleState.STARTING, RoleState.RESTARTING) in order  # the ps started, the chief still waited
    assert all(chief_state == RoleState.RESTARTING for ps_state, chief_state in order if ps_state != RoleState.RUNNING)
    assert (c.role("ps-0").state, chief.state, chief.attempt) == (RoleState.RUNNING, RoleState.RUNNING, 2)
    # the new chief has printed nothing yet: the step its predecessor printed stands (not 0), until it prints
    assert c.process("chief-0").global_step == 0 and chief.global_step == 300
    c.process("chief-0").global_step = 250  # restored from its checkpoint at 250
    c.step(0.5)
    assert chief.global_step == 250


def test_a_stalled_supervisor_judges_silence_from_its_resumption_not_from_before(c: FakeCluster) -> None:
    """The supervisor stopped for 15 s (SIGSTOP, a paused VM) while its roles went on and beat to their agent:
    its first pass after, before it has taken in what the agents sent meanwhile, restarts nothing; a role
    that is silent from then on is still lost one heartbeat timeout later."""
    running(c)
    c.now += 15.0  # the supervisor did not run; the roles did
    for p in c.processes["localhost"].values():
        p.beat = c.now
    resumed = policy.decide(c.state, [policy.SupervisorStalled(15.0)], c.now)  # the reports are still on their way
    c.act(resumed)
    assert set(c.states().values()) == {RoleState.RUNNING}, c.events()
    assert not [a for a in resumed if isinstance(a, (policy.StopRole, policy.StartRole))]
    c.step(0.2)  # the reports come in
    assert set(c.states().values()) == {RoleState.RUNNING}
    assert all(r.attempt == 1 for r in c.record.roles)
    c.step(4.0, silent=("worker-1",))  # silent for 4 s of the timeout's 5 after the stall: not yet
    assert c.role("worker-1").state == RoleState.RUNNING
    c.step(1.5, silent=("worker-1",))
    assert c.role("worker-1").state == RoleState.RESTARTING
    assert any(e.to == "lost" and e.reason.startswith("no heartbeat for 5.5s") for e in c.events("worker-1"))


def test_a_silent_agent_on_this_machine_is_replaced_before_its_roles_count_as_silent(c: FakeCluster) -> None:
    """This machine is not cut off from itself: an agent of it that goes silent hangs (or was stopped). At half
    the heartbeat timeout another is started in its place (it adopts the roles and vouches for them), once per
    AGENT_RETRY; the roles are not judged lost meanwhile."""
    running(c)
    c.cut.add("localhost")  # its agent says nothing (its roles beat to it all the same: they are not cut)
    assert not [a for a in c.step(2.0) if isinstance(a, policy.StartAgent)]  # 2 s of the 5 s timeout: not yet
    replaced = [a for a in c.step(1.0) if isinstance(a, policy.StartAgent)]
    assert replaced == [policy.StartAgent("localhost", replace=True)]
    assert not [a for a in c.step(1.0) if isinstance(a, policy.StartAgent)]  # asked once per AGENT_RETRY
    assert set(c.states().values()) == {RoleState.RUNNING}
    c.cut.clear()
    c.hello.add("localhost")  # the new agent dials in with its hello, adopting every role
    c.step(0.5)
    c.step(2.0)  # past the old agent's timeout: nothing was lost or restarted
    assert set(c.states().values()) == {RoleState.RUNNING}
    assert all(r.attempt == 1 for r in c.record.roles)


def test_a_role_that_ended_unwatched_shows_no_metrics_of_an_older_step_as_its_last(c: FakeCluster) -> None:
    """A role that ended while no agent watched it is reported by the next agent with the step its exit file
    left, but no heartbeat: the metrics of an older heartbeat are not shown as that step's (status showed an
    evaluator's older evaluation beside its last step, after `psctl supervise`)."""
    running(c)
    chief = c.process("chief-0")
    chief.metrics, chief.global_step = {"accuracy": 0.90}, 100
    c.step(1)
    assert (c.role("chief-0").metrics, c.role("chief-0").global_step) == ({"accuracy": 0.90}, 100)
    chief.metrics, chief.global_step, chief.beat, chief.exit_code = {}, 300, None, 0  # no last heartbeat
    c.step(0.5)
    assert c.role("chief-0").state == RoleState.SUCCEEDED
    assert (c.role("chief-0").metrics, c.role("chief-0").global_step) == ({}, 300)

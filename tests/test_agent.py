"""The per-host agent against the supervisor's real endpoint (AgentHub, gRPC on loopback), starting real
processes: it starts, watches (waitpid), signals and reports roles; answers their heartbeats and fences a
replaced incarnation; keeps its roles when the supervisor goes and reports them to the next one."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from cluster_helpers import autogroup_nice, wait_until

from psctl.agent import core
from psctl.agent.core import Agent, RoleProcess, printed_step_rate
from psctl.agent.exits import ExitWaiter
from psctl.agent.orphans import find_orphans, find_records, kill_orphans
from psctl.launch.cpus import CPUS_VARIABLE, YIELD_NICE, allowed_cpus
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.rpc import make_channel
from psctl.supervisor import policy
from psctl.supervisor.agents import AgentHub

SLEEPER = [sys.executable, "-c", "import sys, time; print('up', flush=True); time.sleep(120)"]


class Endpoint:
    """A supervisor's agent endpoint and what came in through it."""

    def __init__(self, port: int = 0, on_change: Callable[[], None] = lambda: None) -> None:
        self.inbox: queue.SimpleQueue[policy.Observation] = queue.SimpleQueue()
        self.hub = AgentHub(self.inbox, on_change=on_change)
        self.port = self.hub.start(f"127.0.0.1:{port}")
        self.seen: list[policy.Observation] = []

    def report(self, host: str, *, hello: bool | None = None, timeout: float = 15.0) -> pb.AgentReport:
        """The next report of ``host`` (a hello, if asked) that arrives."""

        def next_report() -> pb.AgentReport | None:
            while True:
                try:
                    obs = self.inbox.get_nowait()
                except queue.Empty:
                    return None
                self.seen.append(obs)
                if isinstance(obs, policy.Report) and obs.host == host and hello in (None, obs.report.hello):
                    return obs.report

        return wait_until(next_report, timeout=timeout, interval=0.02, what=f"a report of {host}")  # type: ignore[no-any-return]

    def role_report(self, host: str, name: str, *, until: object, timeout: float = 15.0) -> pb.RoleReport:
        """The first report of role ``name`` for which ``until(report)`` holds."""

        def matching() -> pb.RoleReport | None:
            report = self.report(host, timeout=timeout)
            role = next((r for r in report.roles if r.name == name), None)
            return role if role is not None and until(role) else None  # type: ignore[operator]

        return wait_until(matching, timeout=timeout, interval=0.0, what=f"{name} in {host}'s report")  # type: ignore[no-any-return]


@pytest.fixture
def started() -> Iterator[list[object]]:
    """Agents and endpoints a test starts: stopped (and their roles killed) whatever happens."""
    things: list[object] = []
    yield things
    for thing in things:
        if isinstance(thing, Agent):
            thing.stop()
            for role in thing.roles.values():
                role.signal(signal.SIGKILL)
                if isinstance(role.process, subprocess.Popen):
                    role.process.wait(timeout=10)
        elif isinstance(thing, Endpoint):
            thing.hub.stop()


def attached(started: list[object], interval: float = 0.2) -> tuple[Endpoint, Agent, pb.AgentReport]:
    """A supervisor's endpoint and an agent of host h1 dialled into it (both stopped by ``started``), and the
    agent's hello."""
    endpoint = Endpoint()
    started.append(endpoint)
    agent = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=interval)
    started.append(agent)
    agent.start()
    return endpoint, agent, endpoint.report("h1", hello=True)


def start_command(name: str, incarnation: int, tmp_path: Path, argv: list[str] = SLEEPER,
                  env: dict[str, str] | None = None) -> pb.AgentCommand:
    return pb.AgentCommand(start=pb.StartRole(
        name=name, incarnation=incarnation, attempt=1, argv=argv, cwd=str(tmp_path),
        env={"PSCTL_ROLE": name, **(env or {})}, log_path=str(tmp_path / "logs" / f"{name}.1.log"),
        files={str(tmp_path / "tls" / f"{name}.key"): b"secret"}))


def test_an_agent_starts_watches_and_stops_roles_on_the_supervisor_s_word(
        tmp_path: Path, started: list[object]) -> None:
    endpoint, agent, hello = attached(started)
    assert (hello.agent_pid, hello.roles, hello.heartbeat_address) == (os.getpid(), [], agent.heartbeat_address)

    assert endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 7, tmp_path))
    running = endpoint.role_report("h1", "worker-0", until=lambda r: r.pid > 0)
    assert (running.incarnation, running.exited, running.heartbeat_age) == (7, False, -1.0)
    key = tmp_path / "tls" / "worker-0.key"
    assert key.read_bytes() == b"secret" and key.stat().st_mode & 0o777 == 0o600  # written before the start
    wait_until(lambda: "up" in (tmp_path / "logs" / "worker-0.1.log").read_text(), timeout=10, what="its log")

    # its heartbeats go to the agent: the current incarnation is answered, another one is fenced
    with make_channel(agent.heartbeat_address) as channel:
        stub = pb_grpc.SupervisorStub(channel)
        assert not stub.Heartbeat(pb.HeartbeatRequest(task="worker:0", incarnation=7, local_step=3), timeout=5).fenced
        assert stub.Heartbeat(pb.HeartbeatRequest(task="worker:0", incarnation=6), timeout=5).fenced
    beating = endpoint.role_report("h1", "worker-0", until=lambda r: r.heartbeat_age >= 0)
    assert beating.last.local_step == 3

    # a SIGKILL is seen by waitpid and reported at once, with the log's last lines
    os.kill(running.pid, signal.SIGKILL)
    dead = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=5)
    assert (dead.exit_code, dead.log_tail) == (-signal.SIGKILL, "up")

    # a start of the next incarnation replaces it; a stop with grace sends SIGTERM (the sleeper dies of it)
    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 8, tmp_path))
    second = endpoint.role_report("h1", "worker-0", until=lambda r: r.incarnation == 8 and r.pid > 0)
    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(stop=pb.StopRole(name="worker-0", grace_seconds=5)))
    stopped = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=10)
    assert (stopped.pid, stopped.exit_code) == (second.pid, -signal.SIGTERM)


#: A role that crashes in native code (as a bug in an extension would) once told to.
CRASHES_WHEN_TOLD = [sys.executable, "-c", "import ctypes, os, sys, time\nprint('up', flush=True)\n"
                     "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\nctypes.string_at(0)\n"]
#: The agent's report of that crash: where it happened, in Python's library and in the role's own code.
SEGFAULT_TAIL = (r"up \| Fatal Python error: Segmentation fault in string_at \(ctypes/__init__\.py:\d+\), called "
                 r"from <module> \(<string>:4\)")


def test_a_native_crash_is_reported_as_its_signal_and_where_it_happened(
        tmp_path: Path, started: list[object]) -> None:
    """The agent runs its roles with Python's fault handler on: a role killed by SIGSEGV leaves its stacks in
    its log, and the report of its exit says the crash and where in one line, not the stacks' last lines."""
    endpoint, _, hello = attached(started)
    crash = tmp_path / "crash"
    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 7, tmp_path, [*CRASHES_WHEN_TOLD, str(crash)]))
    endpoint.role_report("h1", "worker-0", until=lambda r: r.pid > 0)
    log = tmp_path / "logs" / "worker-0.1.log"
    wait_until(lambda: log.is_file() and "up" in log.read_text(), timeout=10, what="worker-0 to start")
    crash.touch()
    dead = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=10)
    assert dead.exit_code == -signal.SIGSEGV
    assert re.fullmatch(SEGFAULT_TAIL, dead.log_tail), dead.log_tail
    assert "Current thread" in log.read_text()  # the whole report is in the log


def test_an_exit_is_reported_the_moment_it_happens_not_at_the_next_look(
        tmp_path: Path, started: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    # a look every minute and a report every minute: only the child's pidfd can bring its exit out sooner
    monkeypatch.setattr(core, "WATCH_INTERVAL", 60.0)
    endpoint, _, hello = attached(started, interval=60.0)
    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 7, tmp_path))
    running = endpoint.role_report("h1", "worker-0", until=lambda r: r.pid > 0, timeout=10)
    os.kill(running.pid, signal.SIGKILL)
    dead = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=10)
    assert dead.exit_code == -signal.SIGKILL


def test_a_shutdown_stops_every_role_reports_their_exits_and_ends_the_agent(
        tmp_path: Path, started: list[object], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(core, "WATCH_INTERVAL", 60.0)  # the exits and the SIGKILL's deadline must wake the agent
    endpoint, agent, hello = attached(started, interval=60.0)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(120)"]
    for name, argv in (("worker-0", SLEEPER), ("worker-1", stubborn)):
        endpoint.hub.send("h1", hello.agent_pid, start_command(name, 1, tmp_path, argv))
        log = tmp_path / "logs" / f"{name}.1.log"
        wait_until(lambda log=log: log.is_file() and "up" in log.read_text(), timeout=10, what=f"{name} to start")
    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(shutdown=pb.Shutdown(grace_seconds=0.5)))
    assert agent.wait(10), "the agent did not end after its roles did"

    def last_report() -> pb.AgentReport | None:
        report = endpoint.report("h1")
        return report if all(r.exited for r in report.roles) else None

    final = wait_until(last_report, timeout=10, interval=0.0, what="the report of both exits")
    assert final.changed
    assert {r.name: r.exit_code for r in final.roles} == {"worker-0": -signal.SIGTERM, "worker-1": -signal.SIGKILL}
    # the one that had to be killed is named in the agent's log (a `down` said only how many it stopped)
    killed = [r.getMessage() for r in caplog.records if "SIGKILL (it did not end on SIGTERM)" in r.getMessage()]
    assert killed == ["worker-1: still running at the end of its stop's grace: SIGKILL (it did not end on SIGTERM)"]


def _waiting(waiter: ExitWaiter, timeout: float) -> threading.Thread:
    thread = threading.Thread(target=waiter.wait, args=(timeout,), daemon=True)
    thread.start()
    return thread


def test_an_exit_waiter_wakes_for_a_watched_child_s_exit_and_for_a_wake() -> None:
    waiter = ExitWaiter()
    child = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL)
    try:
        assert waiter.watch(child.pid) and not waiter.blind()
        waiter.wait(0)  # the watch's own wake
        sleeping = _waiting(waiter, 60.0)
        sleeping.join(0.3)
        assert sleeping.is_alive()  # nothing happened: it sleeps on
        child.kill()
        wait_until(lambda: not sleeping.is_alive(), timeout=10, what="the exit to end the wait")
        child.wait(timeout=10)
        waiter.forget(child.pid)
        woken = _waiting(waiter, 60.0)  # the collected child's pidfd no longer counts: only a wake ends it
        woken.join(0.3)
        assert woken.is_alive()
        waiter.wake()
        wait_until(lambda: not woken.is_alive(), timeout=10, what="the wake to end the wait")
    finally:
        child.kill()
        child.wait(timeout=10)
        waiter.close()


def test_an_exit_waiter_says_when_a_process_must_be_looked_at_and_is_inert_once_closed() -> None:
    waiter = ExitWaiter()
    waiter.look_only(10_000_000)  # a stand-in, as the benchmarks' fake roles are
    assert waiter.blind()
    waiter.forget(10_000_000)
    assert not waiter.blind()
    assert not waiter.watch(2**22 + 12345) and waiter.blind()  # no such process (no pid exceeds 2**22): looked at
    waiter.close()
    waiter.wake()  # its pipe is closed: nothing is written anywhere
    assert not waiter.watch(os.getpid())


def test_reports_sent_for_a_change_are_marked_and_wake_the_supervisor_periodic_ones_do_not(
        tmp_path: Path, started: list[object]) -> None:
    wakes: list[float] = []
    endpoint = Endpoint(on_change=lambda: wakes.append(time.monotonic()))
    started.append(endpoint)
    agent = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.1)
    started.append(agent)
    agent.start()
    hello = endpoint.report("h1", hello=True)
    wait_until(lambda: len(wakes) == 1, timeout=5, what="the attach to wake the supervisor")
    periodic = [endpoint.report("h1") for _ in range(3)]  # nothing changed: the interval's reports
    assert not any(r.changed for r in periodic) and len(wakes) == 1
    # a new cluster view is reported promptly but changes no role: it wakes nothing (a thousand agents answer it)
    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(view=pb.ClusterView(chief_incarnation=3)))
    wait_until(lambda: agent.view.chief_incarnation == 3, timeout=5, what="the view to arrive")
    assert not any(endpoint.report("h1").changed for _ in range(2)) and len(wakes) == 1

    def report_where(until: Callable[[pb.AgentReport], bool]) -> pb.AgentReport:
        def matching() -> pb.AgentReport | None:
            report = endpoint.report("h1")
            return report if until(report) else None

        return wait_until(matching, timeout=10, interval=0.0, what="a report of h1")  # type: ignore[no-any-return]

    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 7, tmp_path))
    # (a report on the interval may show it running a moment before the one its start marks: wait for that one)
    running = report_where(lambda r: r.changed and any(role.pid > 0 for role in r.roles))
    wait_until(lambda: len(wakes) == 2, timeout=5, what="the start to wake the supervisor")
    os.kill(running.roles[0].pid, signal.SIGKILL)
    dead = report_where(lambda r: r.roles[0].exited)
    assert dead.changed
    wait_until(lambda: len(wakes) == 3, timeout=5, what="the exit to wake the supervisor")
    agent.stop()  # its stream ends: the supervisor learns the agent went
    wait_until(lambda: len(wakes) == 4, timeout=10, what="the detach to wake the supervisor")


def test_an_agent_gives_a_role_its_slot_s_cpu_where_the_roles_outnumber_the_cpus(
        tmp_path: Path, started: list[object]) -> None:
    allowed = allowed_cpus()
    endpoint, _, hello = attached(started)
    command = start_command("worker-1", 1, tmp_path)
    command.start.cpu_slot, command.start.cpu_slots = 1, len(allowed) + 1  # one role more than CPUs here
    endpoint.hub.send("h1", hello.agent_pid, command)
    bound = endpoint.role_report("h1", "worker-1", until=lambda r: r.pid > 0)
    # the role binds itself to it once started (psctl.runtime does; this one only sleeps)
    assert psutil.Process(bound.pid).environ().get(CPUS_VARIABLE) == str(allowed[1 % len(allowed)])
    # and yields it once bound, its imports done: started at the usual priority, as fast as the others
    assert psutil.Process(bound.pid).nice() == 0

    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-2", 1, tmp_path))  # no slot: not bound
    free = endpoint.role_report("h1", "worker-2", until=lambda r: r.pid > 0)
    assert CPUS_VARIABLE not in psutil.Process(free.pid).environ()


def test_an_agent_starts_its_round_robin_on_the_cpu_other_clusters_load_least(
        tmp_path: Path, started: list[object]) -> None:
    allowed = allowed_cpus()
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to choose between")
    # another cluster's ps, bound to this machine's first CPU (a real process, with a bound role's environment)
    other = subprocess.Popen(SLEEPER, stdout=subprocess.DEVNULL, env={
        **os.environ, CPUS_VARIABLE: str(allowed[0]), "PSCTL_ROLE": "ps-0", "PSCTL_CLUSTER_ID": "another"})
    try:
        endpoint, _, hello = attached(started)
        slots = len(allowed) + 1  # one role more than CPUs here
        for slot, name in enumerate(("ps-0", "worker-0")):
            command = start_command(name, 1, tmp_path)
            command.start.cpu_slot, command.start.cpu_slots = slot, slots
            endpoint.hub.send("h1", hello.agent_pid, command)
        cpus = [psutil.Process(endpoint.role_report("h1", name, until=lambda r: r.pid > 0).pid).environ()
                .get(CPUS_VARIABLE) for name in ("ps-0", "worker-0")]
        # this cluster's ps goes to the CPU the other's ps leaves free, its worker round-robin after it
        assert cpus == [str(allowed[1]), str(allowed[2 % len(allowed)])]
    finally:
        other.kill()
        other.wait(timeout=10)


def test_an_agent_moves_its_running_roles_to_the_cpus_their_new_slots_name(
        tmp_path: Path, started: list[object]) -> None:
    allowed = allowed_cpus()
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to move between")
    endpoint, _, hello = attached(started)
    outnumbered = len(allowed) + 1
    roles = (("ps-0", 0, outnumbered), ("worker-0", 1, outnumbered), ("worker-1", len(allowed), outnumbered),
             ("chief-0", 0, 0))
    for name, slot, slots in roles:
        command = start_command(name, 1, tmp_path)
        command.start.cpu_slot, command.start.cpu_slots = slot, slots  # (the chief: cpu_binding none)
        endpoint.hub.send("h1", hello.agent_pid, command)
    pids = {name: endpoint.role_report("h1", name, until=lambda r: r.pid > 0).pid for name, _, _ in roles}

    def affinity(name: str) -> list[int]:
        return sorted(psutil.Process(pids[name]).cpu_affinity())

    # scaled: the ps's and worker 1's slots moved; worker 0's did not (it is left as it is: these sleepers never
    # bind themselves, so a move would show); the chief was never the agent's to bind
    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(cpus=pb.CpuSlots(
        cpu_slot={"ps-0": 1, "worker-0": 1, "worker-1": 1, "chief-0": 2}, cpu_slots=outnumbered)))
    # a worker the agent binds yields its CPU to the ps and the chief (all of it and its autogroup); a ps never
    wait_until(lambda: affinity("ps-0") == affinity("worker-1") == [allowed[1]]
               and psutil.Process(pids["worker-1"]).nice() == YIELD_NICE, timeout=10,
               what="ps-0 and worker-1 moved to their new slots' CPU, worker-1 yielding it")
    assert autogroup_nice(pids["worker-1"]) in (YIELD_NICE, None)
    assert affinity("worker-0") == affinity("chief-0") == allowed
    assert psutil.Process(pids["ps-0"]).nice() == 0

    # scaled down (worker 0 retired) until the roles no longer outnumber the CPUs: they run on every CPU again,
    # and worker 1 at the usual priority (its autogroup's, which needs no privilege to lower again; its
    # threads', as root)
    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(cpus=pb.CpuSlots(
        cpu_slot={"ps-0": 0, "worker-1": 1}, cpu_slots=len(allowed))))
    wait_until(lambda: affinity("ps-0") == affinity("worker-1") == allowed, timeout=10, what="both unbound")
    # (its autogroup is set first, then its threads: waited for together, as root, where both can be lowered)
    wait_until(lambda: autogroup_nice(pids["worker-1"]) in (0, None)
               and (os.geteuid() != 0 or psutil.Process(pids["worker-1"]).nice() == 0), timeout=10,
               what="worker-1 at the usual priority")

    # the file of a role's moves (for the role to read) goes with the role once it exited
    moves = tmp_path / "logs" / "worker-1.1.cpus"
    assert moves.is_file()
    os.kill(pids["worker-1"], signal.SIGKILL)
    endpoint.role_report("h1", "worker-1", until=lambda r: r.exited)
    assert not moves.exists()


def test_a_role_moved_before_it_bound_itself_binds_itself_where_it_was_moved(
        tmp_path: Path, started: list[object]) -> None:
    """A role binds itself only once its heartbeats run (~0.5 s after its start): a scale or a move in between
    must not be undone by that first bind to the CPU its start named."""
    allowed = allowed_cpus()
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to move between")
    go = tmp_path / "go"
    # a role slow to start: it binds itself as psctl.runtime does, once told to go, and says where it is
    late_binder = [sys.executable, "-c", (
        "import os, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
        "from psctl.launch.cpus import bind_self\n"
        "print('bound', bind_self(), sorted(os.sched_getaffinity(0)), flush=True)\n"
        "time.sleep(120)\n")]
    endpoint, _, hello = attached(started)
    outnumbered = len(allowed) + 1
    command = start_command("ps-0", 1, tmp_path, late_binder)
    command.start.cpu_slot, command.start.cpu_slots = 0, outnumbered
    endpoint.hub.send("h1", hello.agent_pid, command)
    pid = endpoint.role_report("h1", "ps-0", until=lambda r: r.pid > 0).pid
    assert psutil.Process(pid).environ()[CPUS_VARIABLE] == str(allowed[0])

    endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(cpus=pb.CpuSlots(
        cpu_slot={"ps-0": 1}, cpu_slots=outnumbered)))
    wait_until(lambda: sorted(psutil.Process(pid).cpu_affinity()) == [allowed[1]], timeout=10,
               what="the agent to move ps-0 to its new slot's CPU")
    go.touch()  # now the role binds itself
    log = tmp_path / "logs" / "ps-0.1.log"
    wait_until(lambda: "bound" in log.read_text(), timeout=30, what="ps-0 to bind itself")
    assert f"bound [{allowed[1]}] [{allowed[1]}]" in log.read_text()
    assert sorted(psutil.Process(pid).cpu_affinity()) == [allowed[1]]


@pytest.mark.parametrize("watched_only", [False, True])
def test_a_start_that_fails_is_reported_with_why(tmp_path: Path, started: list[object], watched_only: bool) -> None:
    """Also a framework's program, which runs under a keeper: the agent finds it missing before it starts one."""
    endpoint, _agent, hello = attached(started)
    for name, program in (("ps-0", "/nonexistent/python3"), ("ps-1", "no-such-program-psctl")):
        command = start_command(name, 1, tmp_path, argv=[program, "--flag"])
        command.start.watched_only = watched_only
        endpoint.hub.send("h1", hello.agent_pid, command)
        failed = endpoint.role_report("h1", name, until=lambda r: r.exited)
        assert failed.start_error.startswith(f"cannot start {program}: ") and "No such file" in failed.start_error


def test_roles_outlive_their_supervisor_and_are_reported_to_the_next_one(tmp_path: Path, started: list[object]) -> None:
    first, _agent, hello = attached(started)
    first.hub.send("h1", hello.agent_pid, start_command("chief-0", 5, tmp_path))
    pid = first.role_report("h1", "chief-0", until=lambda r: r.pid > 0).pid
    first.hub.stop()  # the supervisor is gone

    def detached() -> bool:
        while not first.inbox.empty():
            first.seen.append(first.inbox.get())
        return any(isinstance(o, policy.Detached) and o.agent_pid == hello.agent_pid for o in first.seen)

    wait_until(detached, timeout=10, what="the stream's end to be observed")

    second = Endpoint(first.port)  # a new supervisor where the last one listened
    started.append(second)
    again = second.report("h1", hello=True, timeout=20)
    assert [(r.name, r.pid, r.incarnation, r.exited) for r in again.roles] == [("chief-0", pid, 5, False)]
    os.kill(pid, 0)  # still the same process


def test_an_agent_with_the_certificate_of_another_host_is_refused(tmp_path: Path, started: list[object]) -> None:
    from psctl.pki import create_cluster_pki, member_files

    create_cluster_pki(tmp_path, "c1", [("supervisor", "127.0.0.1"), ("agent-h1", "127.0.0.1"),
                                        ("agent-h2", "127.0.0.1")])
    inbox: queue.SimpleQueue[policy.Observation] = queue.SimpleQueue()
    hub = AgentHub(inbox, tls=member_files(tmp_path, "supervisor"))
    port = hub.start("127.0.0.1:0")
    try:
        with make_channel(f"127.0.0.1:{port}", member_files(tmp_path, "agent-h2")) as channel:
            stub = pb_grpc.AgentLinkStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Attach(iter([pb.AgentReport(host="h1", agent_pid=1, hello=True)]), timeout=10))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
            calls = stub.Attach(iter([pb.AgentReport(host="h2", agent_pid=1, hello=True)]), timeout=10)
            wait_until(lambda: not inbox.empty(), timeout=10, what="h2's hello")
            assert isinstance(inbox.get(), policy.Report)
            calls.cancel()
    finally:
        hub.stop()


def test_a_new_agent_stops_the_roles_an_earlier_agent_of_its_host_left(tmp_path: Path) -> None:
    env = {**os.environ, "PSCTL_CLUSTER_ID": "c9", "PSCTL_AGENT_HOST": "h1", "PSCTL_ROLE": "worker-0"}
    orphan = subprocess.Popen(SLEEPER, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    other = subprocess.Popen(SLEEPER, env={**env, "PSCTL_AGENT_HOST": "h2"}, start_new_session=True,
                             stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: b"PSCTL_AGENT_HOST" in Path(f"/proc/{orphan.pid}/environ").read_bytes(), timeout=10,
                   what="the orphan's environment")
        assert kill_orphans(find_orphans("c9", "h1")) == [orphan.pid]
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None  # another host's role (agents of a test bed share a machine)
    finally:
        for proc in (orphan, other):
            proc.kill()
            proc.wait()


#: A role that ends when told (the file its argument names appears), leaving its exit code as the runtime does.
ENDS_WHEN_TOLD = [sys.executable, "-c", "import os, sys, time\nfrom psctl.runtime.__main__ import record_exit\n"
                  "print('up', flush=True)\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)\nrecord_exit(0)\n"]
#: What the supervisor puts in every role's environment that names its cluster and host.
OF_C1_ON_H1 = {"PSCTL_CLUSTER_ID": "c1", "PSCTL_AGENT_HOST": "h1"}


def test_a_new_agent_adopts_the_roles_its_host_s_last_agent_left_and_reports_how_they_end(
        tmp_path: Path, started: list[object]) -> None:
    """An agent that dies leaves its roles running (each leads a session of its own). The host's next agent
    takes them over instead of killing them: it serves their heartbeats on the port they beat to, and its hello
    names them as they are (same pids, incarnations, attempts: the supervisor restarts nothing, and no ps
    falls back to its last checkpoint). They are not its children: it reports each one's end with the exit code
    the role left in its exit file, or the signal of the native crash its log ends with, or SIGKILL's where
    neither says."""
    endpoint = Endpoint()
    started.append(endpoint)
    first = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
    started.append(first)
    first.start()
    hello = endpoint.report("h1", hello=True)
    done, crash = tmp_path / "done", tmp_path / "crash"
    allowed = allowed_cpus()
    roles = {"worker-0": [*ENDS_WHEN_TOLD, str(done)], "worker-1": SLEEPER,
             "worker-2": [*CRASHES_WHEN_TOLD, str(crash)]}
    for name, argv in roles.items():
        command = start_command(name, 4, tmp_path, argv, env=OF_C1_ON_H1)
        if name == "worker-1":  # given a CPU slot (more roles than CPUs here)
            command.start.cpu_slot, command.start.cpu_slots = 0, len(allowed) + 1
        endpoint.hub.send("h1", hello.agent_pid, command)
    pids = {name: endpoint.role_report("h1", name, until=lambda r: r.pid > 0).pid for name in roles}
    for name in pids:
        log = tmp_path / "logs" / f"{name}.1.log"
        wait_until(lambda log=log: log.is_file() and "up" in log.read_text(), timeout=10, what=f"{name} to start")
    os.sched_setaffinity(pids["worker-1"], allowed[-1:])  # it binds itself to its CPU (as psctl.runtime does)
    first.stop()  # as if it died: it serves no heartbeat and reports nothing more; its roles run on

    second = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
    started.append(second)
    second.start(find_orphans("c1", "h1"))
    assert second.heartbeat_address == first.heartbeat_address
    # it knows where the bound one is bound: a rebind to that CPU is no move
    assert second.roles["worker-1"].cpu_managed and not second.roles["worker-0"].cpu_managed
    assert second.roles["worker-1"].cpus == (allowed[-1:] if len(allowed) > 1 else None)
    again = endpoint.report("h1", hello=True)
    assert sorted((r.name, r.pid, r.incarnation, r.attempt, r.exited) for r in again.roles) == [
        (name, pids[name], 4, 1, False) for name in roles]
    with make_channel(second.heartbeat_address) as channel:  # where the roles' heartbeats have gone all along
        stub = pb_grpc.SupervisorStub(channel)
        assert not stub.Heartbeat(pb.HeartbeatRequest(task="worker:0", incarnation=4, local_step=9), timeout=5).fenced
        assert stub.Heartbeat(pb.HeartbeatRequest(task="worker:0", incarnation=3), timeout=5).fenced
    assert endpoint.role_report("h1", "worker-0", until=lambda r: r.heartbeat_age >= 0).last.local_step == 9

    done.touch()  # it ends by itself, exit code 0: training finished, not a failure to restart
    ended = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=10)
    assert ended.exit_code == 0 and ended.log_tail == "up"
    os.kill(pids["worker-1"], signal.SIGKILL)
    killed = endpoint.role_report("h1", "worker-1", until=lambda r: r.exited, timeout=10)
    assert killed.exit_code == -signal.SIGKILL
    # a native crash leaves no exit file: its log's crash report names the signal
    crash.touch()
    crashed = endpoint.role_report("h1", "worker-2", until=lambda r: r.exited, timeout=10)
    assert crashed.exit_code == -signal.SIGSEGV
    assert re.fullmatch(SEGFAULT_TAIL, crashed.log_tail), crashed.log_tail


#: A framework's program (no heartbeats, no exit file): prints its step as TensorFlow's logs do, and ends with the
#: exit code written to the file its argument names.
FRAMEWORK_PROGRAM = [sys.executable, "-c", "import os, sys, time\nprint('step 5', flush=True)\n"
                     "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
                     "time.sleep(0.05)\nsys.exit(int(open(sys.argv[1]).read()))\n"]


def test_a_new_agent_adopts_a_framework_s_programs_and_reports_how_they_end(
        tmp_path: Path, started: list[object]) -> None:
    """A TensorFlow program leaves no exit file, so its agent runs it under a keeper that does
    (psctl.agent.keeper): the host's next agent adopts it as it adopts the runtime's roles, instead of killing it
    (a TensorFlow ps killed costs the chief's restart from its last checkpoint). Adopted, it is still a watched
    program (alive while it runs, its step read from its log), and its end is reported with its exit code."""
    endpoint, first, hello = attached(started)
    ends = {name: tmp_path / f"{name}.end" for name in ("chief-0", "worker-0", "worker-1")}
    for name, end in ends.items():
        command = start_command(name, 2, tmp_path, [*FRAMEWORK_PROGRAM, str(end)], env=OF_C1_ON_H1)
        command.start.watched_only = True
        endpoint.hub.send("h1", hello.agent_pid, command)
    pids = {name: endpoint.role_report("h1", name, until=lambda r: r.pid > 0).pid for name in ends}
    for name in ends:
        log = tmp_path / "logs" / f"{name}.1.log"
        wait_until(lambda log=log: log.is_file() and "step 5" in log.read_text(), timeout=10, what=f"{name} to start")
    first.stop()  # as if it died

    second = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
    started.append(second)
    second.start(find_orphans("c1", "h1"))
    again = endpoint.report("h1", hello=True)
    assert sorted((r.name, r.pid, r.incarnation, r.exited) for r in again.roles) == [
        (name, pids[name], 2, False) for name in sorted(ends)]
    alive = endpoint.role_report("h1", "chief-0", until=lambda r: r.last.global_step == 5)
    assert 0 <= alive.heartbeat_age < 1.0  # alive while it runs: no heartbeat expected of it

    ends["chief-0"].write_text("0")  # finished: the training's end, not a failure
    assert endpoint.role_report("h1", "chief-0", until=lambda r: r.exited).exit_code == 0
    ends["worker-0"].write_text("3")
    assert endpoint.role_report("h1", "worker-0", until=lambda r: r.exited).exit_code == 3
    program = psutil.Process(pids["worker-1"]).children()[0]  # the program itself, under its keeper
    program.terminate()
    assert endpoint.role_report("h1", "worker-1", until=lambda r: r.exited).exit_code == -signal.SIGTERM


def test_a_new_agent_reports_the_roles_that_ended_while_no_agent_watched_them(
        tmp_path: Path, started: list[object]) -> None:
    """Between an agent's death and the next one's start a role can end: it is no process to adopt, but its agent
    left its adoption record beside its log, and the next agent's hello reports it as ended, with the code its
    exit file holds (SIGKILL's where it left none), instead of leaving it missing (the supervisor restarted it,
    a chief that had finished training too). Records of older attempts and of other clusters are not reported."""
    endpoint, first, hello = attached(started)
    done = tmp_path / "done"
    roles = {"worker-0": [*ENDS_WHEN_TOLD, str(done)], "worker-1": SLEEPER, "worker-2": SLEEPER}
    for name, argv in roles.items():
        endpoint.hub.send("h1", hello.agent_pid, start_command(name, 6, tmp_path, argv, env=OF_C1_ON_H1))
    pids = {name: endpoint.role_report("h1", name, until=lambda r: r.pid > 0).pid for name in roles}
    logs = tmp_path / "logs"
    for name in roles:
        wait_until(lambda name=name: "up" in (logs / f"{name}.1.log").read_text(), timeout=10, what=f"{name} up")
    stale = logs / "worker-1.0.role"  # an older attempt's, never collected
    stale.write_text((logs / "worker-1.1.role").read_text().replace('"attempt": 1', '"attempt": 0'))
    other = logs / "ps-0.1.role"  # another cluster's (a cluster of another name would have its own folder)
    other.write_text((logs / "worker-1.1.role").read_text().replace('"c1"', '"c2"').replace("worker-1", "ps-0"))
    first.stop()  # as if it died
    done.touch()  # worker-0 ends (exit code 0 in its exit file) while no agent watches
    os.kill(pids["worker-2"], signal.SIGKILL)  # worker-2 too, leaving no exit file
    for name in ("worker-0", "worker-2"):
        wait_until(lambda name=name: not psutil.pid_exists(pids[name]) or psutil.Process(pids[name]).status()
                   == psutil.STATUS_ZOMBIE, timeout=10, what=f"{name} to end")  # fmt: skip

    second = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
    started.append(second)
    second.start(find_orphans("c1", "h1"), find_records(str(logs), "c1"))
    again = endpoint.report("h1", hello=True)
    assert sorted((r.name, r.incarnation, r.attempt, r.exited, r.exit_code) for r in again.roles) == [
        ("worker-0", 6, 1, True, 0), ("worker-1", 6, 1, False, 0), ("worker-2", 6, 1, True, -signal.SIGKILL)]
    assert next(r for r in again.roles if r.name == "worker-0").log_tail == "up"
    # collected: the ended roles' records are gone (a third agent reports nothing twice), the running one's kept
    assert sorted(p.name for p in logs.glob("*.role")) == ["ps-0.1.role", "worker-1.1.role"]
    assert not stale.exists()


def test_a_new_agent_adopts_the_process_its_predecessor_started_not_one_that_inherited_its_environment(
        tmp_path: Path, started: list[object]) -> None:
    """A Slurm job step's task carries its srun's environment and leads a process group of its own: the new
    agent adopts the srun (the command line its predecessor started) and leaves the task to it, neither
    adopted nor killed (it killed the tasks, and with them every role, under Slurm)."""
    spawner = [sys.executable, "-c", "import subprocess, sys, time\n"
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
               "print('up', flush=True); time.sleep(120)"]
    endpoint, first, hello = attached(started)
    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 3, tmp_path, spawner, env=OF_C1_ON_H1))
    pid = endpoint.role_report("h1", "worker-0", until=lambda r: r.pid > 0).pid
    task = wait_until(lambda: psutil.Process(pid).children(), timeout=10, what="the role's own child")[0]
    try:
        first.stop()
        second = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
        started.append(second)
        second.start(find_orphans("c1", "h1"))
        assert [(r.name, r.process.pid if r.process else 0) for r in second.roles.values()] == [("worker-0", pid)]
        assert task.is_running() and task.status() != psutil.STATUS_ZOMBIE
    finally:
        task.kill()


def test_a_new_agent_stops_the_roles_it_cannot_adopt(tmp_path: Path, started: list[object]) -> None:
    """Roles whose heartbeats' port another agent still serves (that agent did not die), and roles with nothing
    to adopt them by, are SIGKILLed: nothing would report on them, and they hold their ports."""
    endpoint, first, hello = attached(started)
    endpoint.hub.send("h1", hello.agent_pid, start_command("worker-0", 2, tmp_path, env=OF_C1_ON_H1))
    pid = endpoint.role_report("h1", "worker-0", until=lambda r: r.pid > 0).pid
    second = Agent("h1", f"127.0.0.1:{endpoint.port}", cluster_id="c1", interval=0.2)
    started.append(second)
    second.start(find_orphans("c1", "h1"))
    assert second.heartbeat_address != first.heartbeat_address and not second.roles
    gone = endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=10)
    assert (gone.pid, gone.exit_code) == (pid, -signal.SIGKILL)


class SignalledProcess:
    """A running role's process that records the signals it gets (the agent's stop logic, without a child)."""

    pid = 4242

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def test_a_stop_sent_again_while_the_role_stops_neither_signals_it_again_nor_asks_for_a_report() -> None:
    # The supervisor repeats a stop with every report that shows the role still running. The agent once
    # answered each with a SIGTERM and an immediate report, which drew the next stop at once: a stream of
    # SIGTERMs for the whole grace period (a worker's handler, run in a burst of them, died of RecursionError).
    now = [100.0]
    agent = Agent("h1", "127.0.0.1:1", cluster_id="c1", get_time=lambda: now[0])
    process = SignalledProcess()
    agent.roles["worker-1"] = RoleProcess("worker-1", 3, 1, "/nonexistent.log", process=process)

    def stop(grace: float, incarnation: int = 3) -> bool:
        agent._report_now.clear()
        agent.handle(pb.AgentCommand(stop=pb.StopRole(name="worker-1", incarnation=incarnation, grace_seconds=grace)))
        return agent._report_now.is_set()

    assert stop(30.0) and process.signals == [signal.SIGTERM]
    assert agent.roles["worker-1"].kill_at == 130.0
    now[0] = 101.0
    assert not stop(30.0) and not stop(30.0) and process.signals == [signal.SIGTERM]  # later deadlines: nothing
    assert not stop(5.0, incarnation=2) and process.signals == [signal.SIGTERM]  # another incarnation's stop
    assert stop(5.0) and process.signals == [signal.SIGTERM]  # an earlier deadline: SIGKILL comes sooner...
    assert agent.roles["worker-1"].kill_at == 106.0  # ...without another SIGTERM
    assert stop(0.0) and process.signals == [signal.SIGTERM, signal.SIGKILL]  # a KILL goes at once
    assert not stop(0.0) and process.signals == [signal.SIGTERM, signal.SIGKILL]


def test_a_watched_role_s_step_is_read_from_its_log_while_it_runs_and_once_after_it_exits(tmp_path: Path) -> None:
    log_path = tmp_path / "chief-0.1.log"
    log_path.write_text("step 10\n")
    process = SignalledProcess()
    role = RoleProcess("chief-0", 1, 1, str(log_path), process=process, watched_only=True)
    assert role.report(1.0).last.global_step == 10 and role.report(1.0).heartbeat_age == 0.0
    with log_path.open("a") as f:
        f.write("step 20\n")
    assert role.report(2.0).last.global_step == 20  # running: read at each report
    with log_path.open("a") as f:  # more than the end read of other output (TensorFlow's warnings): still 20
        f.write("W tensorflow/core: a warning\n" * 300)
    assert role.report(2.0).last.global_step == 20
    with log_path.open("a") as f:  # Slurm's line as it cancels the step (job 7, step 2) is not a step of 7
        f.write("slurmstepd: error: *** STEP 7.2 ON node1 CANCELLED AT 2026-11-27T10:00:00 ***\n")
    assert role.report(2.0).last.global_step == 20

    role.exit_code = 0
    with log_path.open("a") as f:
        f.write("step 30\n")  # its last line, written just before it exited
    final = role.report(3.0)
    assert (final.exited, final.last.global_step, final.heartbeat_age) == (True, 30, 1.0)
    log_path.write_text("")  # read no more: an exited role's log is not read again at each report
    assert role.report(4.0).last.global_step == 30


def test_a_watched_role_s_cpu_memory_and_step_rate_are_measured_by_its_agent(tmp_path: Path) -> None:
    """A framework's program beats to no one: its agent reports what `psctl top` shows of it, from its processes
    (the keeper and the program below it) and the steps it prints."""
    log_path = tmp_path / "chief-0.1.log"
    busy = ("import subprocess, sys\n"  # a keeper-like parent, its program a busy child printing its steps
            "child = 'import time\\nstep = 0\\nwhile True:\\n    step += 1\\n    x = sum(range(20000))\\n"
            "    if step % 50 == 0: print(\"step\", step, flush=True)'\n"
            "subprocess.run([sys.executable, '-c', child])\n")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", busy], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        role = RoleProcess("chief-0", 1, 1, str(log_path), process=process, watched_only=True)
        wait_until(lambda: "step 50" in log_path.read_text(), timeout=30, what="its first steps")
        first = role.report(time.monotonic())
        assert first.last.rss_bytes > 5_000_000, first.last  # both pythons
        time.sleep(1.0)  # (the interval the rates are measured over, not a wait for anything)
        second = role.report(time.monotonic()).last
        # the busy child's CPU counts (the parent only waits: ~0 alone; the child gets less than its core on a
        # loaded machine)
        assert second.metrics["cpu"] > 0.05, second
        assert second.steps_per_second > 0 and second.global_step > first.last.global_step, second
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_watched_program_s_rate_is_taken_over_its_prints_not_one_report_s_interval() -> None:
    """A TensorFlow program printing its step every 500 steps at 170 steps/s, read each second: its rate read 0
    most seconds and ~500 the second a print came (top flipped between 0 and 499)."""
    moves: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
    rates = []
    for second in range(1, 61):
        printed = int(second * 170 // 500 * 500)  # the step as last printed
        rates.append(printed_step_rate(moves, float(second), printed))
    steady = rates[15:]
    assert all(140 <= r <= 200 for r in steady), steady
    # printing stops (hung, or between sparse prints for long): 0 after three of its usual gaps, 10 s at least
    assert printed_step_rate(moves, 65.0, printed) > 0 and printed_step_rate(moves, 80.0, printed) == 0.0
    # restarted from a checkpoint behind its last print: its rate starts again from there
    assert printed_step_rate(moves, 81.0, 6000) == 0.0 and printed_step_rate(moves, 84.0, 6500) == 500 / 3


#: Starts a child that ignores SIGTERM, in its group (``group``: the role's, or its program's under a keeper) or
#: in a session of its own (``session``), says its pid, then ends (``exits``) or ignores SIGTERM too (``hangs``).
LEAVES_BEHIND = [sys.executable, "-c", "import signal, subprocess, sys, time\n"
                 "child = subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nprint(1, flush=True)\\ntime.sleep(120)'], "
                 "stdout=subprocess.PIPE, start_new_session=sys.argv[1] == 'session')\n"
                 "child.stdout.readline()\nif sys.argv[2] == 'hangs': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "print('child', child.pid, flush=True)\nif sys.argv[2] == 'exits': sys.exit(0)\ntime.sleep(120)\n"]


@pytest.mark.parametrize(("child", "role", "watched_only", "code"), [
    ("session", "hangs", False, -signal.SIGKILL),  # a child that left the role's group: the SIGKILL finds it
    ("group", "hangs", True, -signal.SIGKILL),  # a framework's program's child, in its program's group
    ("group", "exits", False, 0),  # what a role that ended left in its group
])
def test_nothing_a_role_started_outlives_it(tmp_path: Path, started: list[object], child: str, role: str,
                                            watched_only: bool, code: int) -> None:
    """Its group's signal misses a process below the role in a group of its own, and nothing signals the group
    of a role that ended: the agent ends both (psctl.agent.leftovers), or they run until ``psctl down``."""
    endpoint, _agent, hello = attached(started)
    command = start_command("worker-0", 1, tmp_path, [*LEAVES_BEHIND, child, role])
    command.start.watched_only = watched_only
    endpoint.hub.send("h1", hello.agent_pid, command)
    log = tmp_path / "logs" / "worker-0.1.log"
    said = wait_until(lambda: re.search(r"child (\d+)", log.read_text()) if log.is_file() else None, timeout=15,
                      what="the role's child")
    left = psutil.Process(int(said.group(1)))
    try:
        if role == "hangs":
            endpoint.hub.send("h1", hello.agent_pid, pb.AgentCommand(stop=pb.StopRole(name="worker-0",
                                                                                      grace_seconds=0.3)))
        assert endpoint.role_report("h1", "worker-0", until=lambda r: r.exited, timeout=15).exit_code == code
        wait_until(lambda: not left.is_running() or left.status() == psutil.STATUS_ZOMBIE, timeout=10,
                   what="the role's child to end with it")
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            left.kill()

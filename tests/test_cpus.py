"""Binding roles to CPUs where they outnumber them (psctl.launch.cpus): the slot logic, and real processes
that bind themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from cluster_helpers import autogroup_nice, wait_until

from psctl.launch import cpus as cpus_module
from psctl.launch.cpus import (
    CPUS_FILE_VARIABLE,
    CPUS_VARIABLE,
    YIELD_NICE,
    BoundRole,
    ClusterCpus,
    Move,
    allowed_cpus,
    bind,
    bound_roles,
    cpus_for_slot,
    first_cpu,
    host_slots,
    other_clusters_load,
    set_yielding,
    yields,
)


def test_slots_go_to_ps_then_workers_then_chief_and_evaluator_by_index() -> None:
    roles = [("chief", 0), ("worker", 1), ("evaluator", 0), ("ps", 1), ("worker", 0), ("ps", 0)]
    assert host_slots(roles) == {("ps", 0): 0, ("ps", 1): 1, ("worker", 0): 2, ("worker", 1): 3, ("chief", 0): 4,
                                 ("evaluator", 0): 5}  # fmt: skip


def test_roles_outnumbering_the_cpus_get_one_each_round_robin() -> None:
    allowed = [2, 5]  # a cpuset need not start at 0 nor be contiguous
    # W1 on two CPUs: ps-0 and worker-1 share one, worker-0 and the chief the other
    assert [cpus_for_slot(slot, 4, allowed) for slot in range(4)] == [[2], [5], [2], [5]]


def test_a_cluster_s_round_robin_may_start_at_another_cpu() -> None:
    assert [cpus_for_slot(slot, 4, [2, 5], first=5) for slot in range(4)] == [[5], [2], [5], [2]]
    assert cpus_for_slot(0, 4, [2, 5], first=7) == [2]  # not one of its CPUs: from the lowest


def test_the_round_robin_starts_where_other_clusters_load_the_host_least() -> None:
    assert first_cpu({}, [3, 1, 2]) == 1  # a host's only cluster: from its first CPU, as before
    assert first_cpu({1: 2.0, 2: 1.1, 3: 1.1}, [3, 1, 2]) == 2  # least loaded, the lowest of equals
    assert first_cpu({0: 5.0}, []) is None


def test_a_cluster_looks_at_other_clusters_only_once_and_only_where_its_roles_are_bound() -> None:
    allowed = allowed_cpus()
    cpus = ClusterCpus("mine")
    assert cpus.for_slot(0, len(allowed)) is None and cpus.first is None  # a CPU each: nothing to look at
    second = cpus.for_slot(1, len(allowed) + 1)  # outnumbered: the start is chosen now
    ordered = sorted(allowed)
    assert cpus.first in ordered and second == [ordered[(ordered.index(cpus.first) + 1) % len(ordered)]]
    chosen = cpus.first
    assert cpus.for_slot(0, len(allowed) + 1) == [chosen] and cpus.first == chosen  # kept


def test_other_clusters_load_weighs_roles_by_kind_and_leaves_this_cluster_out() -> None:
    roles = [BoundRole(1, "a", "ps-0", (0,)), BoundRole(2, "a", "worker-1", (1,)), BoundRole(3, "a", "chief-0", (1,)),
             BoundRole(4, "a", "evaluator-0", (0, 1)), BoundRole(5, "mine", "ps-0", (1,))]
    assert other_clusters_load(roles, "mine") == pytest.approx({0: 1.05, 1: 1.15})


def test_bound_roles_are_read_from_the_processes_environments(
        children: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    def child(env: dict[str, str]) -> int:
        started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], text=True,
                                   env={**{k: v for k, v in os.environ.items() if not k.startswith("PSCTL_")}, **env})
        children.append(started)
        return started.pid

    ps = child({CPUS_VARIABLE: "0", "PSCTL_ROLE": "ps-0", "PSCTL_CLUSTER_ID": "other"})
    worker = child({CPUS_VARIABLE: "0,1", "PSCTL_ROLE": "worker-3"})
    not_a_role = child({CPUS_VARIABLE: "0"})
    unbound = child({"PSCTL_ROLE": "ps-1", "PSCTL_CLUSTER_ID": "other"})
    garbled = child({CPUS_VARIABLE: "zero", "PSCTL_ROLE": "ps-2"})
    (tmp_path / "worker-4.1.cpus").write_text(Move("1", yielding=True).text())  # its agent moved it from CPU 0 to 1
    moved = child({CPUS_VARIABLE: "0", CPUS_FILE_VARIABLE: str(tmp_path / "worker-4.1.cpus"), "PSCTL_ROLE": "worker-4"})
    never_moved = child({CPUS_VARIABLE: "0", CPUS_FILE_VARIABLE: str(tmp_path / "none.cpus"), "PSCTL_ROLE": "ps-3"})
    found = {r.pid: r for r in bound_roles()}
    assert found[ps] == BoundRole(ps, "other", "ps-0", (0,))
    assert found[worker] == BoundRole(worker, "", "worker-3", (0, 1))
    assert found[moved] == BoundRole(moved, "", "worker-4", (1,))
    assert found[never_moved] == BoundRole(never_moved, "", "ps-3", (0,))
    assert not {not_a_role, unbound, garbled} & set(found)


@pytest.mark.parametrize(("slot", "slots", "allowed"), [
    (0, 2, [0, 1]),  # a CPU for each role: the kernel places them
    (1, 1, [0, 1, 2, 3]),
    (0, 3, []),  # the platform cannot say which CPUs
    (5, 4, [0, 1]),  # not a slot of this host
])  # fmt: skip
def test_no_binding_where_a_role_has_a_cpu_of_its_own_or_nothing_is_known(
    slot: int, slots: int, allowed: list[int]
) -> None:
    assert cpus_for_slot(slot, slots, allowed) is None


def start_child(cpus: str | None, moved_file: Path | None = None, role: str = "ps-0") -> subprocess.Popen[str]:
    """A Python process with a second thread already running when it calls ``bind_self`` (``PSCTL_CPUS`` =
    ``cpus``, ``PSCTL_CPUS_FILE`` = ``moved_file``, ``PSCTL_ROLE`` = ``role``), then ``settle_priority``; it
    prints what each returned, a line each."""
    code = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,)).start()\n"
            "from psctl.launch.cpus import bind_self, settle_priority\n"
            "print(bind_self(), flush=True)\n"
            "print(settle_priority(), flush=True)\n"
            "time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCTL_")}
    env["PSCTL_ROLE"] = role
    if cpus is not None:
        env[CPUS_VARIABLE] = cpus
    if moved_file is not None:
        env[CPUS_FILE_VARIABLE] = str(moved_file)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # (a session of its own, as roles)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        child.kill()
        child.communicate(timeout=10)  # reaps it and closes its pipes


def thread_affinities(pid: int) -> list[list[int]]:
    return [sorted(psutil.Process(t.id).cpu_affinity()) for t in psutil.Process(pid).threads()]


def test_a_role_binds_every_thread_to_the_cpu_its_environment_names(children: list[subprocess.Popen[str]]) -> None:
    allowed = allowed_cpus()
    child = start_child(str(allowed[-1]))
    children.append(child)
    assert child.stdout is not None and child.stdout.readline() == f"[{allowed[-1]}]\n"
    affinities = thread_affinities(child.pid)
    assert len(affinities) == 2 and all(a == [allowed[-1]] for a in affinities), affinities


@pytest.mark.parametrize("cpus", [None, "", "one,two"])
def test_a_role_without_a_usable_cpu_list_runs_unbound(children: list[subprocess.Popen[str]], cpus: str | None) -> None:
    child = start_child(cpus)
    children.append(child)
    assert child.stdout is not None and child.stdout.readline() == "None\n"
    assert all(a == allowed_cpus() for a in thread_affinities(child.pid))


def test_a_role_its_agent_moved_before_it_bound_itself_binds_where_it_was_moved(
        children: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    allowed = allowed_cpus()
    moved = tmp_path / "evaluator-0.1.cpus"
    moved.write_text(Move(str(allowed[-1]), yielding=False).text())  # no longer yielding: as its agent said
    child = start_child(str(allowed[0]), moved, "evaluator-0")  # started for the first CPU, moved to the last
    children.append(child)
    assert child.stdout is not None and child.stdout.readline() == f"[{allowed[-1]}]\n"
    assert all(a == [allowed[-1]] for a in thread_affinities(child.pid))
    assert child.stdout.readline() == "False\n"
    assert psutil.Process(child.pid).nice() == 0


def test_a_bound_worker_yields_its_cpu_a_ps_does_not(children: list[subprocess.Popen[str]]) -> None:
    allowed = allowed_cpus()
    worker, ps = start_child(str(allowed[0]), role="worker-1"), start_child(str(allowed[0]), role="ps-0")
    children.extend((worker, ps))
    for child, yielding in ((worker, "True"), (ps, "False")):
        assert child.stdout is not None and child.stdout.readline() == f"[{allowed[0]}]\n"
        assert child.stdout.readline() == f"{yielding}\n"
    assert [psutil.Process(t.id).nice() for t in psutil.Process(worker.pid).threads()] == [YIELD_NICE] * 2
    assert autogroup_nice(worker.pid) in (YIELD_NICE, None)
    assert [psutil.Process(t.id).nice() for t in psutil.Process(ps.pid).threads()] == [0, 0]


def test_a_role_moved_while_it_binds_itself_ends_where_it_was_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent writes the file and binds the role between the role's reading its CPUs and its binding to
    them: the role's late bind to its old CPU must not stand (the binds are recorded, not done, in this unit)."""
    moved = tmp_path / "worker-0.1.cpus"
    monkeypatch.setenv(CPUS_VARIABLE, "0")
    monkeypatch.setenv(CPUS_FILE_VARIABLE, str(moved))
    binds: list[list[int]] = []

    def bind_racing_the_agent(pid: int, cpus: list[int]) -> bool:
        if not binds:  # the agent's move lands just before this first bind: every CPU
            moved.write_text(Move("0,1", yielding=False).text())
            binds.append([0, 1])  # (the agent's own bind of the role)
        binds.append(list(cpus))
        return True

    monkeypatch.setattr(cpus_module, "bind", bind_racing_the_agent)
    assert cpus_module.bind_self() == [0, 1]
    assert binds == [[0, 1], [0], [0, 1]]  # agent, the role's stale bind, the role again: the last is the move


def test_a_worker_unbound_while_it_starts_yielding_ends_at_the_usual_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race for the priority: the agent's move (unbound, no longer yielding) lands between the
    worker's reading its start's binding and its yielding (recorded, not done, in this unit)."""
    moved = tmp_path / "worker-0.1.cpus"
    monkeypatch.setenv(CPUS_VARIABLE, "0")
    monkeypatch.setenv(CPUS_FILE_VARIABLE, str(moved))
    monkeypatch.setenv("PSCTL_ROLE", "worker-0")
    priorities: list[bool] = []

    def yield_racing_the_agent(pid: int, yielding: bool) -> bool:
        if not priorities:
            moved.write_text(Move("0,1", yielding=False).text())
            priorities.append(False)  # (the agent's own setting)
        priorities.append(yielding)
        return True

    monkeypatch.setattr(cpus_module, "set_yielding", yield_racing_the_agent)
    assert cpus_module.settle_priority() is False
    assert priorities == [False, True, False]  # agent, the worker's stale yield, taken back


def test_workers_and_the_evaluator_yield_the_ps_and_the_chief_do_not() -> None:
    assert [yields(r) for r in ("worker-0", "evaluator-0", "ps-0", "chief-0", "worker-12")] == [
        True, True, False, False, True]


def test_a_yielding_role_runs_every_thread_and_its_group_at_the_lowest_priority(
        children: list[subprocess.Popen[str]]) -> None:
    child = start_child(None)  # a second thread already running
    children.append(child)
    assert child.stdout is not None and child.stdout.readline() == "None\n"
    assert set_yielding(child.pid, True)
    assert [t.nice() for t in map(psutil.Process, (t.id for t in psutil.Process(child.pid).threads()))] == [19, 19]
    assert autogroup_nice(child.pid) in (19, None)
    back = set_yielding(child.pid, False)  # (lowering a thread's nice again needs privilege)
    assert autogroup_nice(child.pid) in (0, None)
    if os.geteuid() == 0:
        assert back and psutil.Process(child.pid).nice() == 0


def test_binding_a_process_that_is_gone_says_so() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    wait_until(lambda: not psutil.pid_exists(child.pid), timeout=10, what="the child's pid to be free")
    assert bind(child.pid, allowed_cpus()[:1]) is False

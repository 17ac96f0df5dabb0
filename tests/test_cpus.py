"""Binding roles to CPUs where they outnumber them (psctl.launch.cpus): the slot logic, and real processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest
from cluster_helpers import wait_until

from psctl.launch.cpus import allowed_cpus, bind, bind_to_slot, cpus_for_slot, host_slots


def test_slots_go_to_ps_then_workers_then_chief_and_evaluator_by_index() -> None:
    roles = [("chief", 0), ("worker", 1), ("evaluator", 0), ("ps", 1), ("worker", 0), ("ps", 0)]
    assert host_slots(roles) == {("ps", 0): 0, ("ps", 1): 1, ("worker", 0): 2, ("worker", 1): 3, ("chief", 0): 4,
                                 ("evaluator", 0): 5}  # fmt: skip


def test_roles_outnumbering_the_cpus_get_one_each_round_robin() -> None:
    allowed = [2, 5]  # a cpuset need not start at 0 nor be contiguous
    # W1 on two CPUs: ps-0 and worker-1 share one, worker-0 and the chief the other
    assert [cpus_for_slot(slot, 4, allowed) for slot in range(4)] == [[2], [5], [2], [5]]


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


@pytest.fixture
def threaded_child() -> Iterator[subprocess.Popen[str]]:
    """A Python process with a second thread running before anything binds it."""
    code = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,)).start()\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        yield child
    finally:
        child.kill()
        child.communicate(timeout=10)  # reaps it and closes its pipe


def thread_affinities(pid: int) -> list[list[int]]:
    return [sorted(psutil.Process(t.id).cpu_affinity()) for t in psutil.Process(pid).threads()]


def test_bind_binds_every_thread_of_a_running_process(threaded_child: subprocess.Popen[str]) -> None:
    allowed = allowed_cpus()
    target = [allowed[-1]]
    assert bind(threaded_child.pid, target)
    affinities = thread_affinities(threaded_child.pid)
    assert len(affinities) == 2 and all(a == target for a in affinities), affinities


def test_bind_to_slot_binds_only_where_the_roles_outnumber_the_cpus(threaded_child: subprocess.Popen[str]) -> None:
    allowed = allowed_cpus()
    assert bind_to_slot(threaded_child.pid, 0, len(allowed)) is None  # a CPU for each: left alone
    assert all(a == allowed for a in thread_affinities(threaded_child.pid))
    slot = 1 % len(allowed)
    assert bind_to_slot(threaded_child.pid, slot, len(allowed) + 1) == [allowed[slot]]
    assert all(a == [allowed[slot]] for a in thread_affinities(threaded_child.pid))


def test_binding_a_process_that_is_gone_says_so() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    wait_until(lambda: not psutil.pid_exists(child.pid), timeout=10, what="the child's pid to be free")
    assert bind(child.pid, allowed_cpus()[:1]) is False

"""Binding roles to CPUs on a host that runs more roles than it has CPUs (``roles.<role>.cpu_binding: auto``).

Where roles outnumber CPUs, every step hands work between processes that the kernel keeps moving between CPUs:
each hand-off then wakes a thread on another CPU, with the caches of neither. Bound round-robin, a ps and a
worker share one CPU and the next pair the next: measured on 2 cores (benchmarks/README.md), W1 (a ps, two
workers and the chief) +25-28% steps/s with 20% less CPU per step, W2 +7-26%, W3 +4-5%. A host with a CPU for
each role is left to the kernel's scheduler (no measurement here says binding helps there).

The supervisor gives each role its slot among the host's roles (ps first, then workers, the chief, the
evaluator); the host's agent maps slots to the CPUs it may use itself (``sched_getaffinity``, so a cpuset or a
Slurm allocation is respected) and names the role's CPU in its environment (``PSCTL_CPUS``); the role binds
itself once its heartbeats run (``bind_self``), so that a role restarting onto a busy CPU still imports and
starts on whichever CPU is free, and comes back as fast as it would unbound.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence

log = logging.getLogger(__name__)

#: CPU binding per role: ``auto`` binds on hosts with more roles than CPUs, ``none`` never.
CPU_BINDINGS = ("auto", "none")
#: The CPUs a role binds itself to, comma-separated (set by its agent).
CPUS_VARIABLE = "PSCTL_CPUS"
#: Slots go to the heaviest roles first, so that round-robin spreads ps and workers evenly over the CPUs.
ROLE_ORDER = ("ps", "worker", "chief", "evaluator")


def host_slots(roles: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Each (role, index) of one host's roles -> its slot: ps first, then workers, chief, evaluator, by index.
    A role's slot stays its own as the others restart; it moves only when roles are added or retired."""
    ranked = sorted(set(roles), key=lambda r: (ROLE_ORDER.index(r[0]) if r[0] in ROLE_ORDER else len(ROLE_ORDER),
                                               r[0], r[1]))  # fmt: skip
    return {r: slot for slot, r in enumerate(ranked)}


def cpus_for_slot(slot: int, slots: int, allowed: Sequence[int]) -> list[int] | None:
    """The CPUs of slot ``slot`` of ``slots`` on a host whose roles may use ``allowed``: one CPU, round-robin,
    when the roles outnumber the CPUs; None (not bound) otherwise."""
    if not allowed or slots <= len(allowed) or not 0 <= slot < slots:
        return None
    return [sorted(allowed)[slot % len(allowed)]]


def slot_env(slot: int, slots: int) -> dict[str, str]:
    """The environment that binds a role, slot ``slot`` of ``slots`` on this host, to its CPU once it runs
    (``bind_self``): empty where the role is not to be bound."""
    cpus = cpus_for_slot(slot, slots, allowed_cpus())
    return {} if cpus is None else {CPUS_VARIABLE: cpu_list(cpus)}


def bind_self() -> list[int] | None:
    """Bind this process (every thread) to the CPUs ``PSCTL_CPUS`` names; the CPUs, or None if it names none or
    they cannot be used (said in a warning: the role runs unbound, which is only slower)."""
    text = os.environ.get(CPUS_VARIABLE, "").strip()
    if not text:
        return None
    try:
        cpus = sorted({int(part) for part in text.split(",")})
    except ValueError:
        log.warning("%s=%r is not a list of CPU numbers; running unbound", CPUS_VARIABLE, text)
        return None
    return cpus if bind(os.getpid(), cpus) else None


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (empty where the platform cannot say or bind)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return sorted(getaffinity(0)) if getaffinity is not None else []


def bind(pid: int, cpus: Sequence[int]) -> bool:
    """Bind process ``pid`` (every thread it has, and so every thread it starts later) to ``cpus``. False if it
    could not be bound (it exited, or the CPUs are not its to use): it then runs unbound, which is only slower."""
    try:
        os.sched_setaffinity(pid, cpus)  # the main thread first: threads it starts from now on inherit it
        threads = os.listdir(f"/proc/{pid}/task")
    except (ProcessLookupError, FileNotFoundError):
        return False
    except OSError as exc:
        log.warning("cannot bind pid %d to CPU(s) %s: %s; it runs unbound", pid, cpu_list(cpus), exc)
        return False
    for tid in (int(t) for t in threads if int(t) != pid):  # any started before that (none, when just spawned)
        with contextlib.suppress(ProcessLookupError):  # (one that ended meanwhile)
            os.sched_setaffinity(tid, cpus)
    return True


def cpu_list(cpus: Sequence[int]) -> str:
    """CPUs as ``PSCTL_CPUS`` and the logs write them: ``0,3``."""
    return ",".join(str(c) for c in cpus)

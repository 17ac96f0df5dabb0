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
starts on whichever CPU is free, and comes back as fast as it would unbound. When a host's roles change
(``psctl scale``, a role moved to or from it), the supervisor sends their new slots and the agent moves the
running roles (``bind``), writing where it moved each one first (the file ``PSCTL_CPUS_FILE`` names): a role
that has not bound itself yet binds where it was moved, not where it started (``bind_self``).

Where roles are bound, the workers (from their first step) and the evaluator run at the lowest priority
(``settle_priority``, ``set_yielding``): the ps and the chief serve every worker's steps, so a ps that waits
for its CPU behind a worker's computation stalls them all, while a worker that waits delays only its own step.
W1 on 2 cores, pipelined, 814-819 -> 924-972 steps/s (interleaved runs); W2 and W3 unchanged
(benchmarks/README.md).

Other psctl clusters on the same host are taken into account: an agent's round-robin starts at the CPU that
the roles other clusters have bound there load least (``first_cpu``), so that a second cluster's ps does not
land on the first one's (two W1-sized clusters at once on 2 cores: 20-21 s each from CPU 0, 15 s so; 15-16.5
unbound; benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: CPU binding per role: ``auto`` binds on hosts with more roles than CPUs, ``none`` never.
CPU_BINDINGS = ("auto", "none")
#: The CPUs a role binds itself to, comma-separated (set by its agent).
CPUS_VARIABLE = "PSCTL_CPUS"
#: A file where the role's agent writes the CPUs it moved the role to since it started (same form), if it did.
CPUS_FILE_VARIABLE = "PSCTL_CPUS_FILE"
#: How many times a role binds itself while its agent keeps moving it (each try after the first follows a move).
BIND_TRIES = 5
#: The roles that yield their CPU to the ps and the chief where roles are bound, and the nice value they run at.
YIELDING_ROLES = ("worker", "evaluator")
YIELD_NICE = 19
#: Slots go to the heaviest roles first, so that round-robin spreads ps and workers evenly over the CPUs.
ROLE_ORDER = ("ps", "worker", "chief", "evaluator")
#: A bound role's share of its CPU by kind, to balance clusters against each other: ps and workers run the
#: steps; the chief and the evaluator mostly wait (W1, CPU ms per step: ps 0.73, worker 0.64, chief 0.08).
ROLE_LOAD = {"ps": 1.0, "worker": 1.0, "chief": 0.1, "evaluator": 0.1}


def host_slots(roles: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Each (role, index) of one host's roles -> its slot: ps first, then workers, chief, evaluator, by index.
    A role's slot stays its own as the others restart; it moves only when roles are added or retired."""
    ranked = sorted(set(roles), key=lambda r: (ROLE_ORDER.index(r[0]) if r[0] in ROLE_ORDER else len(ROLE_ORDER),
                                               r[0], r[1]))  # fmt: skip
    return {r: slot for slot, r in enumerate(ranked)}


def cpus_for_slot(slot: int, slots: int, allowed: Sequence[int], first: int | None = None) -> list[int] | None:
    """The CPUs of slot ``slot`` of ``slots`` on a host whose roles may use ``allowed``: one CPU, round-robin
    from CPU ``first`` (default the lowest), when the roles outnumber the CPUs; None (not bound) otherwise."""
    if not allowed or slots <= len(allowed) or not 0 <= slot < slots:
        return None
    ordered = sorted(allowed)
    start = ordered.index(first) if first in ordered else 0
    return [ordered[(start + slot) % len(ordered)]]


def first_cpu(loads: Mapping[int, float], allowed: Sequence[int]) -> int | None:
    """Where a cluster's round-robin starts: the allowed CPU that ``loads`` (other clusters' bound roles) load
    least, the lowest of equals (so a host's only cluster starts at its first CPU); None if none is allowed."""
    return min(sorted(allowed), key=lambda cpu: loads.get(cpu, 0.0), default=None)


@dataclass(frozen=True)
class BoundRole:
    """A psctl role bound to CPUs on this host, as its environment (and its agent's moves) say."""

    pid: int
    cluster_id: str
    role: str  # its name: ps-0, worker-1, ...
    cpus: tuple[int, ...]


def bound_roles() -> list[BoundRole]:
    """Every psctl role on this host whose environment binds it (``PSCTL_CPUS``), of any cluster; processes this
    user may not read are not seen."""
    import psutil  # (here: the roles import this module to bind themselves, and need psutil nowhere else)

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        moved = read_move(env.get(CPUS_FILE_VARIABLE))
        cpus = parse_cpus(moved.cpus if moved is not None else env.get(CPUS_VARIABLE, ""))
        if cpus and env.get("PSCTL_ROLE"):
            found.append(BoundRole(proc.info["pid"], env.get("PSCTL_CLUSTER_ID", ""), env["PSCTL_ROLE"], cpus))
    return found


def other_clusters_load(roles: Iterable[BoundRole], cluster_id: str) -> dict[int, float]:
    """CPU -> the load (ROLE_LOAD by the role's kind) that ``roles`` of clusters other than ``cluster_id`` put
    on it."""
    loads: dict[int, float] = {}
    for role in roles:
        if role.cluster_id == cluster_id:
            continue
        share = ROLE_LOAD.get(_kind(role.role), 1.0) / len(role.cpus)
        for cpu in role.cpus:
            loads[cpu] = loads.get(cpu, 0.0) + share
    return loads


class ClusterCpus:
    """One cluster's CPUs on this host (its agent's, or a benchmark harness's): slot -> CPU, round-robin from the
    CPU that other clusters' bound roles load least, chosen at the first role that is bound and then kept, so
    that a role keeps its CPU across restarts. Other clusters are looked at only where roles are bound."""

    def __init__(self, cluster_id: str) -> None:
        self.cluster_id = cluster_id
        self.first: int | None = None

    def for_slot(self, slot: int, slots: int) -> list[int] | None:
        """The CPUs of slot ``slot`` of ``slots`` roles here; None where they do not outnumber the CPUs."""
        allowed = allowed_cpus()
        if cpus_for_slot(slot, slots, allowed) is None:
            return None
        if self.first is None:
            loads = other_clusters_load(bound_roles(), self.cluster_id)
            self.first = first_cpu(loads, allowed)
            if loads:
                log.info("other clusters' roles bound here (CPU: load): %s; this cluster's start at CPU %s",
                         ", ".join(f"{cpu}: {load:g}" for cpu, load in sorted(loads.items())), self.first)
        return cpus_for_slot(slot, slots, allowed, self.first)


def bind_self() -> list[int] | None:
    """Bind this process (every thread) to its CPUs: where its agent last moved it (the file ``PSCTL_CPUS_FILE``
    names), else those ``PSCTL_CPUS`` names. Returns the CPUs, or None if there are none or they cannot be used
    (said in a warning: the role runs unbound, which is only slower).

    An agent writes the file before it binds the role; the role reads it again after binding itself, and binds
    again if it changed meanwhile: whichever of the two binds last, the role ends where the agent moved it."""
    cpus = None
    for moved in _moves():
        text = moved.cpus if moved is not None else os.environ.get(CPUS_VARIABLE, "").strip()
        if not text:
            return None
        cpus = parse_cpus(text)
        if cpus is None:
            log.warning("%s=%r is not a list of CPU numbers; running unbound", CPUS_VARIABLE, text)
            return None
        if not bind(os.getpid(), cpus):
            return None
    return list(cpus) if cpus is not None else None


def settle_priority() -> bool:
    """Yield this role's CPU to the ps and the chief (``set_yielding``) if it is a worker or the evaluator that
    its agent bound, or as its agent's last move says; True if it yields. A worker calls it at its first step,
    the evaluator once bound: workers that yield from their start reach the first step ~0.25 s later (W1, 2
    cores: 0.81-0.88 s against 0.55-0.61). Like ``bind_self``, it reads the agent's move again after acting and
    acts again if it changed."""
    bound = bool(os.environ.get(CPUS_VARIABLE, "").strip()) and yields(os.environ.get("PSCTL_ROLE", ""))
    yielded = False  # (every role starts at the usual priority)
    for moved in _moves():
        wanted = moved.yielding if moved is not None else bound
        if wanted != yielded:
            set_yielding(os.getpid(), wanted)
            yielded = wanted
    return yielded


def _moves() -> Iterator[Move | None]:
    """This role's last move by its agent (None: it never moved it) to act on, then the next each time one landed
    while the role acted: the agent writes a move before it acts on the role itself, so whichever of the two acts
    last, the move stands (at most BIND_TRIES times, against an agent that keeps moving it)."""
    path = os.environ.get(CPUS_FILE_VARIABLE)
    moved = read_move(path)
    for _ in range(BIND_TRIES):
        yield moved
        landed = read_move(path)
        if landed == moved:
            return
        moved = landed


def parse_cpus(text: str) -> tuple[int, ...] | None:
    """CPUs as ``PSCTL_CPUS`` writes them (``0,3``), sorted; None if ``text`` is not such a list."""
    try:
        return tuple(sorted({int(part) for part in text.split(",")})) if text.strip() else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Move:
    """Where a role's agent moved it since it started: its CPUs (``PSCTL_CPUS``'s form; every CPU the agent may
    use where it is no longer bound), and whether it yields them (see ``set_yielding``)."""

    cpus: str
    yielding: bool

    def text(self) -> str:
        """As the agent writes it in the role's ``PSCTL_CPUS_FILE``: ``0,3`` then ``yield`` or ``run``."""
        return f"{self.cpus}\n{'yield' if self.yielding else 'run'}\n"


def read_move(path: str | None) -> Move | None:
    """The role's last move, or None if its agent never moved it (no such file) or the file cannot be read."""
    if not path:
        return None
    try:
        with open(path, encoding="ascii") as f:
            cpus, _, priority = f.read().strip().partition("\n")
    except (OSError, ValueError):
        return None
    return Move(cpus.strip(), priority.strip() == "yield")


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


def yields(role: str) -> bool:
    """Whether the role named ``role`` (``worker-3``) yields its CPU where roles are bound."""
    return _kind(role) in YIELDING_ROLES


def _kind(role: str) -> str:
    """A role's kind from its name: ``worker`` of ``worker-3``."""
    return role.rpartition("-")[0]


def set_yielding(pid: int, yielding: bool) -> bool:
    """Run process ``pid`` at YIELD_NICE (``yielding``) or at nice 0: every thread it has (the threads it starts
    later inherit it), and its autogroup, where the kernel has them: there each session (psctl starts every role
    in its own) is one scheduling group, whose nice is what weighs it against the other roles'. False if that
    could not be done in full (a nice lowered back needs privilege, except an autogroup's; the process exited).
    The autogroup is changed only where ``pid`` leads its session, as roles do."""
    nice = YIELD_NICE if yielding else 0
    done = True
    try:
        # only a session's leader has an autogroup of its own (psctl starts every role so): another process's
        # is its session's, shared with the shell or whatever started it
        if os.getsid(pid) == pid:
            with open(f"/proc/{pid}/autogroup", "w", encoding="ascii") as f:
                f.write(str(nice))
    except (FileNotFoundError, ProcessLookupError):  # no autogroups in this kernel, or the process is gone
        pass
    except OSError:
        done = False
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        threads = [pid]  # (no /proc: the process's main thread, as setpriority sees it)
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            done = done and tid != pid
        except OSError:
            done = False
    return done


def cpu_list(cpus: Sequence[int]) -> str:
    """CPUs as ``PSCTL_CPUS`` and the logs write them: ``0,3``."""
    return ",".join(str(c) for c in cpus)

"""What a role leaves behind: the processes it started that would outlive it.

An agent signals a role's process group, which holds the role's own children. Two kinds of process escape that
signal, and would run on (holding memory, devices, files) until ``psctl down`` finds them by their environment:

- those below the role in a group of their own: a framework's program under its keeper leads its own group
  (``psctl.agent.keeper``), and any program may call ``setsid``. A SIGKILL of the role (a stop whose grace ran
  out, a role replaced) goes to every process below it too (``kill_tree``), found by ``/proc`` and each stopped
  first, so that none starts another one unseen meanwhile;
- those still in the role's group when the role itself ended (a child that ignored the SIGTERM its group got,
  or one the role never waited for). Where the ended role is a child of the process that looks (an agent's
  role, a keeper's program), its exit shows before it is collected, while its pid still names its group (no
  later process can take it), and ``end_group`` SIGKILLs what is left there then.

What left both (a daemon that forked twice and whose parent ended) is found by its environment: by the agent once
its roles have all ended at the cluster's end (``psctl.agent.orphans.end_strays``), else by ``psctl down``.
"""

from __future__ import annotations

import contextlib
import os
import signal

from psctl.agent.procfs import descendants, still_running

#: Rounds of looking for processes below a role that are not stopped yet, before it is killed (each one
#: stopped can start no other, so a second round finds nothing new unless one was starting as the first ran).
_FREEZE_ROUNDS = 5


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads and every process below ``pid``, whatever its group.

    Each process below is SIGSTOPped as it is found, and looked for again until no new one shows: a stopped
    process starts no other, and SIGKILL ends a stopped one. Each is checked to be the process found (its start
    time) before it is signalled, so a pid reused meanwhile is left alone."""
    frozen: dict[int, float] = {}
    for _ in range(_FREEZE_ROUNDS):
        new = {p: t for p, t in descendants(pid).items() if frozen.get(p) != t}
        if not new:
            break
        for child, started in new.items():
            if still_running(child, started):
                _signal(child, signal.SIGSTOP)
        frozen.update(new)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child, started in frozen.items():
        if still_running(child, started):
            _signal(child, signal.SIGKILL)


def exited_uncollected(pid: int) -> bool:
    """Whether the child ``pid`` of this process has ended and its exit is not collected yet (it is a zombie,
    holding its pid and so its process group's id)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return False


def end_group(pid: int) -> None:
    """SIGKILL what is left in the process group of ``pid``, a child of this process that ended and is not
    collected yet (so that the group's id is still its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)

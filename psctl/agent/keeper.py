"""Keeps a framework's program's exit code for an agent that is not its parent (``python -m psctl.agent.keeper
ARGV...``).

psctl's runtime leaves its exit code in an exit file as it ends (``PSCTL_EXIT_FILE``), so that the agent that
adopts it after its own agent died can tell "finished" from "failed" without being its parent
(``psctl.agent.orphans``). A TensorFlow program writes none: the agent starts it under this keeper, which

- leads the role's process group (the process the agent signals, watches and a later agent adopts, and the pid
  ``psctl status`` shows) and starts the program in a process group of its own: each signal the keeper gets, from
  its group (an agent's stop) or alone (``kill PID``), it passes on to the program's group, so the program and its
  own children get it once;
- ties the program's life to its own (``PR_SET_PDEATHSIG``): a keeper killed outright (SIGKILL, which it cannot
  pass on) takes the program with it; what the program started is killed with it by the agent, which kills
  every process below a role it SIGKILLs (``psctl.agent.leftovers``);
- once the program ended, SIGKILLs what it left in its group (nothing else signals that group again);
- writes the program's exit code to the exit file as it ends (a signal as its negative number) and ends the
  same way itself, so an agent that is its parent reads the program's own status.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from psctl.agent.leftovers import end_group
from psctl.runtime.exits import EXIT_FILE_VARIABLE, write_exit_file
from psctl.signals import RECORDED_SIGNALS

#: The signals the keeper passes on to the program's group (it outlives them itself, to see how the program ends).
PASSED_ON = (signal.SIGTERM, signal.SIGINT, *RECORDED_SIGNALS)
_PR_SET_PDEATHSIG = 1


def keeper_argv(python: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` under a keeper with interpreter ``python``."""
    return [python, "-m", "psctl.agent.keeper", *argv]


def _in_own_group_dying_with(parent: int) -> None:
    """In the program's process, before it execs: a process group of its own, and SIGKILL once its keeper is
    gone (checked once set: the keeper may have died before)."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def run(argv: Sequence[str]) -> int:
    """Run ``argv`` kept; returns its exit code (negative: the signal that ended it; 127: it could not start)."""
    exit_file = os.environ.get(EXIT_FILE_VARIABLE, "")
    env = {k: v for k, v in os.environ.items() if k != EXIT_FILE_VARIABLE}  # the keeper's to write, not its
    me = os.getpid()
    try:
        program = subprocess.Popen(list(argv), env=env, preexec_fn=lambda: _in_own_group_dying_with(me))
    except OSError as exc:  # (its agent checks first: seen here only if the program went meanwhile)
        print(f"psctl.agent.keeper: cannot start {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        code = 127  # as a shell says it
    else:
        def pass_on(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(program.pid, signum)

        for signum in PASSED_ON:
            signal.signal(signum, pass_on)
        with contextlib.suppress(ChildProcessError):  # its end, left uncollected: its pid still names its group
            os.waitid(os.P_PID, program.pid, os.WEXITED | os.WNOWAIT)
        end_group(program.pid)  # what it left there (a child that outlived a SIGTERM, one never waited for)
        code = program.wait()
    if exit_file:
        try:
            write_exit_file(exit_file, code)
        except OSError as exc:
            print(f"psctl.agent.keeper: cannot write the exit file {exit_file}: {exc}", file=sys.stderr)
    return code


def end_as(code: int) -> None:
    """End this process as the program ended: with its exit code, or killed by its signal."""
    if code < 0:
        with contextlib.suppress(ValueError, OSError):  # (SIGKILL's cannot be set, nor need be)
            signal.signal(-code, signal.SIG_DFL)
        with contextlib.suppress(ValueError, OSError):
            os.kill(os.getpid(), -code)
        code = 128 - code  # (a signal that does not end a process by default: the shell's number for it)
    sys.exit(code)


def main(argv: Sequence[str]) -> None:
    if not argv:
        print("usage: python -m psctl.agent.keeper PROGRAM [ARG...]", file=sys.stderr)
        sys.exit(2)
    end_as(run(argv))


if __name__ == "__main__":
    main(sys.argv[1:])

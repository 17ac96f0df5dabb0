"""Exit codes of a role process (``python -m psctl.runtime``), shared with the supervisor that reads them, and the
exit file a role leaves its code in for an agent that is not its parent (the runtime, or a framework's program's
keeper, writes it; ``psctl.agent.orphans`` reads it)."""

from __future__ import annotations

import os

#: Done: the chief finished training, the evaluator evaluated the last checkpoint.
EXIT_OK = 0
#: An unexpected failure: restarting may help.
EXIT_FAILURE = 1
#: Bad configuration: permanent, restarting cannot help.
EXIT_CONFIG = 2
#: A non-retryable error in the program: permanent.
EXIT_TRAINING_FAILED = 3
#: Stopped by SIGTERM (a preemption's warning, or ``psctl down``) after leaving cleanly within its grace: a
#: worker finished its steps in flight and took no new one, a chief or ps stopped where a restart resumes.
#: Restarted, but never counted as a failure (sysexits' EX_TEMPFAIL: try again later).
EXIT_PREEMPTED = 75

#: A ps or worker that ended by itself once the chief had said training is over and nothing stopped it (its
#: supervisor died): the training's end, not a loss. Its own code, so that no other exit is taken for it.
EXIT_TRAINING_OVER = 80

#: Where a role leaves its exit code as it ends (read by an agent that adopted it, not its parent).
EXIT_FILE_VARIABLE = "PSCTL_EXIT_FILE"


def write_exit_file(path: str, code: int) -> None:
    """Leave ``code`` (a signal as its negative number) in ``path``, whole or not at all (a reader never sees
    half of it). OSError if it cannot be written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def read_exit_file(path: str) -> int | None:
    """The exit code a role wrote as it ended (None: it wrote none)."""
    if not path:
        return None
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None

#: The status of a role's last heartbeat as it exits: its supervisor then waits for its end, not for more beats.
EXITING = "exiting"

"""Exit codes of a role process (``python -m psctl.runtime``), shared with the supervisor that reads them."""

from __future__ import annotations

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

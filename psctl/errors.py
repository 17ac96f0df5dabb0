"""The errors that cross into the command line, and their exit codes.

Every user-facing failure is a :class:`PsctlError` subclass. The CLI prints its one-line message
(no traceback unless ``--debug``) and exits with the class's ``exit_code``.
"""

from __future__ import annotations

import click

#: Exit codes, in one place so the CLI, the docs and the tests agree.
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # usage and spec errors, like click's own usage errors
EXIT_TRAINING_FAILED = 3
EXIT_NOT_FOUND = 4
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class PsctlError(click.ClickException):
    """Base class: a message the user can act on, and an exit code."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")

    def format_message(self) -> str:
        return self.message


class SpecError(PsctlError):
    """The cluster spec is wrong: names the file, line, key path and the fix."""

    exit_code = EXIT_USAGE


class UsageError(PsctlError):
    """The command line is wrong (unknown role, cluster name needed, ...)."""

    exit_code = EXIT_USAGE


class NotFound(PsctlError):
    """What the command is about does not exist: a cluster, a checkpoint to export, or a role's log."""

    exit_code = EXIT_NOT_FOUND


class ClusterNotFound(NotFound):
    pass


class CheckpointNotFound(NotFound):
    pass


class LogNotFound(NotFound):
    pass


class LaunchError(PsctlError):
    """A role could not be started; nothing is left running when this is raised from ``up``."""

    exit_code = EXIT_FAILURE


class TrainingFailed(PsctlError):
    exit_code = EXIT_TRAINING_FAILED


class ClusterStopped(PsctlError):
    """An attached ``up`` whose cluster was stopped (``psctl down`` elsewhere, a signal to its supervisor) before
    training finished: not a success for a script that goes on to use the model."""

    exit_code = EXIT_FAILURE

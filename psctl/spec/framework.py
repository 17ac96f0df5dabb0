"""``training.framework: tensorflow``: the user's own TensorFlow program, run by psctl as its roles.

``training.command`` is the program the chief runs (and the evaluator, unless it has a ``command`` of its
own); ps and workers run ``roles.ps.command`` / ``roles.worker.command`` when given, else psctl's TensorFlow
server (``python -m psctl.tfserver``: a ``tf.distribute.Server`` for the task TF_CONFIG names). A command is
split like a shell command line (no shell runs it) and may name placeholders, filled in for each role:
"""

from __future__ import annotations

import shlex
import string
from pathlib import Path
from typing import Any

from psctl.spec.checks import Checker, show
from psctl.spec.loader import KeyPath

FRAMEWORKS = ("psctl", "tensorflow")
#: What a TensorFlow program's training section may hold.
TENSORFLOW_KEYS = ("framework", "command", "steps", "checkpoint")
#: The placeholders of a command, and what each becomes.
PLACEHOLDERS = {
    "role": "the role's job name: chief, ps, worker or evaluator",
    "index": "the role's index in its job (0 for the chief)",
    "task": "job:index, e.g. worker:1",
    "address": "where the role listens, host:port",
    "port": "the port the role listens on",
    "chief_host": "the chief's host:port",
    "ps_hosts": "every ps's host:port, comma-separated",
    "worker_hosts": "every worker's host:port, comma-separated",
    "evaluator_host": "the evaluator's host:port (empty without one)",
    "checkpoint_dir": "the folder for the program's checkpoints (training.checkpoint.dir, else the cluster's)",
    "run_dir": "the role's run folder (for its own output files)",
    "python": "the host's python (a command's first word python or python3 becomes it too)",
}
_PYTHONS = ("python", "python3")


def placeholders_in(text: str) -> list[str]:
    """The placeholder names in ``text`` (``{{`` and ``}}`` are literal braces); ValueError if malformed."""
    return [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]


def check_command(c: Checker, path: KeyPath, value: object, base_dir: Path) -> tuple[str, ...]:
    """A command line as its words, every placeholder known and every relative ``.py`` script present."""
    text = c.string(path, value, fix='write the command line, e.g. "python train.py --steps 300"')
    try:
        words = tuple(shlex.split(text))
    except ValueError as exc:
        c.fail(path, f"cannot split {show(text)} into words: {exc}", "close the quotes")
    if not words:
        c.fail(path, "is empty", 'write the command line, e.g. "python train.py"')
    for word in words:
        try:
            names = placeholders_in(word)
        except ValueError as exc:
            c.fail(path, f"bad placeholder in {show(word)}: {exc}", "write {name}, or {{ and }} for braces")
        for name in names:
            if name not in PLACEHOLDERS:
                known = ", ".join("{" + k + "}" for k in PLACEHOLDERS)
                c.fail(path, f"unknown placeholder {{{name}}}", f"use one of {known}")
    for word in scripts(words):
        if not (base_dir / word).is_file():
            c.fail(path, f"script {word!r} not found in {base_dir}", "give its path relative to the spec's folder")
    return words


def scripts(words: tuple[str, ...]) -> list[str]:
    """The command's relative ``.py`` files (copied to SSH hosts with the spec's other files)."""
    return [w for w in words if w.endswith(".py") and not Path(w).is_absolute() and "{" not in w
            and not w.startswith("-")]


def normalise_tensorflow(c: Checker, t: dict[str, Any], path: KeyPath, base_dir: Path,
                         checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The training section of a TensorFlow program."""
    for key in t:
        if key not in TENSORFLOW_KEYS:
            c.fail((*path, key), "is for psctl's own runtime, not used with training.framework: tensorflow",
                   f"remove {key} (the program's own flags say how it trains)", key=True)
    for key in t.get("checkpoint") or {}:  # (the folder is handed to the program; it saves by its own flags)
        if key != "dir":
            c.fail((*path, "checkpoint", key), "is for psctl's own runtime, not used with training.framework: "
                   "tensorflow", f"remove {key} (the program's own flags say when it checkpoints; psctl gives it "
                   "checkpoint.dir as {checkpoint_dir})", key=True)
    command = check_command(c, (*path, "command"),
                            c.require(path, t, "command", 'add command: "python train.py ..." (the chief runs it)'),
                            base_dir)
    steps = t.get("steps")
    if steps is not None:
        steps = c.integer((*path, "steps"), steps, minimum=1, fix="the step the program trains to, e.g. 300")
    return {"framework": "tensorflow", "command": list(command), "steps": steps, "checkpoint": checkpoint}


def fill(words: list[str] | tuple[str, ...], values: dict[str, str], python: str) -> list[str]:
    """The command for one role: placeholders filled, a leading ``python`` made the host's python."""
    argv = [word.format(**values) for word in words]
    if argv and argv[0] in _PYTHONS:
        argv[0] = python
    return argv

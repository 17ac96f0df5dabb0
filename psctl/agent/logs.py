"""What the end of a role's log says about how the role ended: its last lines, the last step it names, and a
native crash's report.

Every role runs with Python's fault handler on (``PYTHONFAULTHANDLER=1``, set by the agent): a role killed by
SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (a crash in numpy, gRPC, TensorFlow or a program's own extension)
first writes ``Fatal Python error: Segmentation fault`` and every thread's Python stack to its log. The agent
reports that crash in one line, where it happened (the crashing thread's innermost frame, and the innermost
frame of the program's own code when that is another), after what a C++ library said as it aborted
(TensorFlow's ``Check failed: ...``), instead of the report's last lines (its list of extension modules). An
adopted role is not the agent's child, so its exit status cannot be waited for: the crash report also tells
which signal ended it.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

#: The last lines of a role's log that go with the report of its exit.
TAIL_LINES = 5
#: How far back from a log's end its last lines are read.
TAIL_BYTES = 8192
#: A line a program logged with a time (Python's logging, TensorFlow's C++ log): not part of an exception.
_LOGGED = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d|[IWEF]\d{4} \d\d:\d\d")
#: What is kept of a raised exception's first line where it leads a log's tail.
RAISED_CHARS = 300
#: How far back a crash report's first line is looked for: the report lists every thread's stack, and a
#: TensorFlow program has dozens of threads.
CRASH_BYTES = 256 * 1024

#: The fault handler's words for the signals it handles.
FATAL_SIGNALS = {
    "Segmentation fault": signal.SIGSEGV,
    "Aborted": signal.SIGABRT,
    "Bus error": signal.SIGBUS,
    "Floating point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
}

_FATAL = re.compile(r"^Fatal Python error: (?P<message>.+)$", re.MULTILINE)
#: The lines of a report after its first: stacks (indented), their headers, the extension modules.
_REPORT_LINE = re.compile(r"(?:|  .*|(?:Current thread|Thread 0x|Stack|Extension modules|Python runtime state|<).*)")
_CURRENT_THREAD = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):$", re.MULTILINE)
_FRAME = re.compile(r'^  File "(?P<path>.+)", line (?P<line>\d+) in (?P<function>.+)$')
#: A C++ library's FATAL log line, which it writes just before it aborts: TensorFlow's own format
#: (``2026-11-27 10:00:01.123456: F tensorflow/core/framework/tensor.cc:669] Check failed: ...``) and absl's /
#: glog's (``F1127 10:00:01.123456   4242 tensor.cc:669] Check failed: ...``).
_NATIVE_FATAL = re.compile(r"(?:.*: F |F\d{4} [\d:.]+\s+\d+ )(?P<where>[\w./-]+:\d+)\] (?P<what>.+)")
#: A file of Python's own library or of an installed package, not of the program: shown from there on.
_LIBRARY = re.compile(r"/(?:site-packages|dist-packages|lib/python3\.\d+)/")
#: A line a program prints about its progress: "step 120", "Step: 120", "global_step=120" (the last one wins);
#: not Slurm's "*** STEP 7.2 ON node1 CANCELLED" (job 7's step 2).
_STEP = re.compile(rb"step[\s:=]+(\d+)(?!\.\d)", re.IGNORECASE)


@dataclass(frozen=True)
class Crash:
    """A fatal error the fault handler reported."""

    #: As the fault handler says it: "Segmentation fault".
    message: str
    #: Where: "in string_at (ctypes/__init__.py:519), called from step (/home/me/train.py:42)"; "" if unknown.
    where: str
    #: The log's lines before the report.
    before: list[str]
    #: What a C++ library said as it aborted (its FATAL line just before the report), with where: "Check
    #: failed: 1 == NumElements() (1 vs. 2) (tensorflow/core/framework/tensor.cc:669)"; "" if none.
    native: str = ""

    @property
    def signum(self) -> int:
        """The signal that ended the process (a fatal error of Python's own aborts)."""
        return FATAL_SIGNALS.get(self.message, signal.SIGABRT)

    def summary(self) -> str:
        fatal = f"Fatal Python error: {self.message}" + (f" {self.where}" if self.where else "")
        return f"{self.native}; then {fatal}" if self.native else fatal


def find_crash(text: str) -> Crash | None:
    """The fault handler's report that ``text`` (the end of a log) ends with, if it ends with one (not one of
    a child process that shared the log and crashed before its parent went on)."""
    fatal = next(reversed(list(_FATAL.finditer(text))), None)
    if fatal is None:
        return None
    report = text[fatal.end():]
    if not all(_REPORT_LINE.fullmatch(line) for line in report.splitlines()):
        return None
    current = _CURRENT_THREAD.search(report)
    frames = []
    if current is not None:
        for line in report[current.end():].lstrip("\n").splitlines():
            frame = _FRAME.match(line)
            if frame is None:
                break
            frames.append(frame)
    before = [line.strip() for line in text[:fatal.start()].splitlines() if line.strip()]
    native = _NATIVE_FATAL.fullmatch(before[-1]) if before else None
    said = f"{native.group('what').strip()} ({native.group('where')})" if native else ""
    return Crash(fatal.group("message").strip(), _where(frames), before[:-1] if native else before, said)


def _where(frames: list[re.Match[str]]) -> str:
    """The innermost frame, and the program's own innermost one where that is another."""
    if not frames:
        return ""
    innermost = frames[0]
    own = next((f for f in frames if not _LIBRARY.search(f.group("path"))), None)
    where = f"in {_frame_text(innermost)}"
    if own is not None and own is not innermost:
        where += f", called from {_frame_text(own)}"
    return where


def _frame_text(frame: re.Match[str]) -> str:
    path = frame.group("path")
    library = _LIBRARY.search(path)
    shown = path[library.end():] if library else path  # a library's file by its name within the library
    return f"{frame.group('function')} ({shown}:{frame.group('line')})"


def _read_end(path: str, size: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - size))
        return f.read().decode("utf-8", "replace")


def log_tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last lines of a log, joined into one line ("" if it cannot be read); a log that ends in a crash
    report: the lines before the report, then the crash in one line."""
    try:
        text = _read_end(path, TAIL_BYTES)
        crash = find_crash(_read_end(path, CRASH_BYTES)) if "(most recent call first):" in text else None
    except OSError:
        return ""
    if crash is not None:
        return " | ".join([*crash.before[-(lines - 1):], crash.summary()])
    last = [line.strip() for line in text.strip().splitlines()[-lines:]]
    raised = _raised(text)
    if raised is not None and raised not in last:  # a message of many lines (TensorFlow's) hid what was raised
        last = [raised if len(raised) <= RAISED_CHARS else f"{raised[:RAISED_CHARS]}...", *last[1:]]
    return " | ".join(last)


def _raised(text: str) -> str | None:
    """The first line of what a Python traceback that ends ``text`` raised (``InvalidArgumentError: ...``):
    the first line after its frames that is not indented. None where no traceback ends it: none, or one the
    program printed and went on from (a timestamped log line follows)."""
    at = text.rfind("Traceback (most recent call last):")
    if at < 0:
        return None
    after = text[at:].splitlines()[1:]
    raised = next((i for i, line in enumerate(after) if line.strip() and not line[0].isspace()), None)
    if raised is None or any(_LOGGED.match(line) for line in after[raised + 1:]):
        return None
    return after[raised].strip()


def crash_signal(path: str) -> int | None:
    """The signal a crash report at the end of the log names, if the log ends in one."""
    try:
        crash = find_crash(_read_end(path, CRASH_BYTES))
    except OSError:
        return None
    return crash.signum if crash is not None else None


def last_step(path: str) -> int | None:
    """The last step number the end of a program's log names (None if it names none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            found = _STEP.findall(f.read())
    except OSError:
        return None
    return int(found[-1]) if found else None

"""What the agent reads from the end of a role's log, on logs that real crashing Python processes wrote."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from psctl.agent.logs import crash_signal, find_crash, log_tail


def crashed(tmp_path: Path, code: str, name: str = "role.log") -> Path:
    """The log of a Python process that ran ``code`` with the fault handler on, as the agent starts roles."""
    log = tmp_path / name
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, timeout=60,
                       env={"PYTHONFAULTHANDLER": "1", "PATH": "/usr/bin:/bin"}, check=False)
    return log


SEGFAULT_IN_A_FUNCTION = """\
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
def step():
    print("step 12 loss 0.5", flush=True)
    ctypes.string_at(0)
step()
"""


def test_a_segfault_is_one_line_saying_where_in_the_library_and_in_the_program(tmp_path: Path) -> None:
    log = crashed(tmp_path, SEGFAULT_IN_A_FUNCTION)
    assert "Thread 0x" in log.read_text() and "Current thread" in log.read_text()  # every thread's stack
    assert re.fullmatch(r"step 12 loss 0\.5 \| Fatal Python error: Segmentation fault in string_at "
                        r"\(ctypes/__init__\.py:\d+\), called from step \(<string>:5\)", log_tail(str(log)))
    assert crash_signal(str(log)) == signal.SIGSEGV


def test_an_abort_names_sigabrt_and_a_crash_in_the_program_itself_names_one_frame(tmp_path: Path) -> None:
    log = crashed(tmp_path, "import os\nprint('loading', flush=True)\nos.abort()\n")
    assert log_tail(str(log)) == "loading | Fatal Python error: Aborted in <module> (<string>:3)"
    assert crash_signal(str(log)) == signal.SIGABRT


def test_an_abort_of_a_cpp_library_leads_with_what_it_said_as_it_aborted(tmp_path: Path) -> None:
    """TensorFlow's C++ writes its FATAL line (a failed CHECK) and aborts: the line says why, the fault handler
    where; both in the one line, the FATAL line no longer among the last lines before it."""
    fatal = ("2026-11-27 10:00:01.123456: F tensorflow/core/framework/tensor.cc:669] Check failed: 1 == "
             "NumElements() (1 vs. 2)Must have a one element tensor")
    log = crashed(tmp_path, f"import os, sys\nprint('step 3', flush=True)\nsys.stderr.write({fatal!r} + '\\n')\n"
                            "sys.stderr.flush()\nos.abort()\n")
    assert log_tail(str(log)) == (
        "step 3 | Check failed: 1 == NumElements() (1 vs. 2)Must have a one element tensor "
        "(tensorflow/core/framework/tensor.cc:669); then Fatal Python error: Aborted in <module> (<string>:5)")
    assert crash_signal(str(log)) == signal.SIGABRT


def test_a_crash_report_that_more_output_follows_is_not_how_the_log_ends(tmp_path: Path) -> None:
    """A child that shared the log crashed; its parent went on and failed otherwise: the parent's end counts."""
    child = "import ctypes; ctypes.string_at(0)"
    log = crashed(tmp_path, "import subprocess, sys\n"
                            f"subprocess.run([sys.executable, '-c', {child!r}])\n"
                            "raise SystemExit('gave up after the child crashed')\n")
    assert "Fatal Python error: Segmentation fault" in log.read_text()
    assert find_crash(log.read_text()) is None
    assert crash_signal(str(log)) is None
    assert log_tail(str(log)).endswith("gave up after the child crashed")


def test_a_log_without_a_crash_gives_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "role.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    assert log_tail(str(log)) == "line 5 | line 6 | line 7 | line 8 | line 9"
    assert crash_signal(str(log)) is None
    assert log_tail(str(tmp_path / "missing.log")) == "" and crash_signal(str(tmp_path / "missing.log")) is None


def test_an_exception_whose_message_runs_over_many_lines_is_named_by_what_was_raised(tmp_path: Path) -> None:
    """TensorFlow's errors print a message of many lines after the exception's name: the tail leads with the
    line that says what was raised (and the supervisor's reason with it), not with the message's last lines."""
    from psctl.supervisor.policy import exit_text

    log = tmp_path / "chief-0.1.log"
    program = ("import sys\n"
               "class InvalidArgumentError(Exception): pass\n"
               "raise InvalidArgumentError('assertion failed: [x < 3]\\n' + '\\n'.join(f'  detail {i}' if i % 2 "
               "else f'Condition x < y did not hold {i}' for i in range(12)))\n")
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-c", program], stdout=out, stderr=subprocess.STDOUT, check=False)
    tail = log_tail(str(log))
    assert tail.startswith("InvalidArgumentError: assertion failed: [x < 3] | "), tail
    assert exit_text(1, tail) == "exit code 1: InvalidArgumentError: assertion failed: [x < 3]"
    # a traceback the program printed and went on from (logging on) is not what ended it
    with open(log, "a") as out:
        out.write("2026-11-27 10:00:01,123 INFO chief: step 120\nW1127 10:00:02.000 other\nline\n")
    assert log_tail(str(log)) == ("Condition x < y did not hold 10 | detail 11 | 2026-11-27 10:00:01,123 INFO chief: "
                                  "step 120 | W1127 10:00:02.000 other | line")


@pytest.mark.parametrize("message", ["Segmentation fault", "Bus error", "Floating point exception",
                                     "Illegal instruction"])
def test_each_signal_the_fault_handler_names_is_the_one_that_ended_the_process(tmp_path: Path, message: str) -> None:
    number = {"Segmentation fault": signal.SIGSEGV, "Bus error": signal.SIGBUS,
              "Floating point exception": signal.SIGFPE, "Illegal instruction": signal.SIGILL}[message]
    log = crashed(tmp_path, f"import os\nos.kill(os.getpid(), {int(number)})\n")
    assert log.read_text().startswith(f"Fatal Python error: {message}")
    assert crash_signal(str(log)) == number

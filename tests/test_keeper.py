"""The keeper a framework's program runs under (``python -m psctl.agent.keeper``), with real processes: it passes
each signal it gets, from its group or alone, on to the program once, leaves the program's exit code in the exit
file and ends the same way, and takes the program with it when it is killed outright."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from cluster_helpers import wait_until

#: Counts the SIGTERMs it gets; after the first (and time for a second to arrive) says how many, and exits with
#: the code its argument gives.
COUNTS_TERMS = [sys.executable, "-c", "import os, signal, sys, time\ngot = []\n"
                "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
                "print('up', os.getpid(), os.environ.get('PSCTL_EXIT_FILE'), flush=True)\n"
                "while not got: time.sleep(0.01)\ntime.sleep(0.3)\n"
                "print('terms', len(got), flush=True)\nsys.exit(int(sys.argv[1]))\n"]
#: The programs the keepers started, by pid (killed after each test).
PROGRAMS: list[psutil.Process] = []
#: What each program printed of its environment's PSCTL_EXIT_FILE, by pid.
KEPT_ENV: dict[int, str] = {}
SLEEPS = [sys.executable, "-c", "import os, time\nprint('up', os.getpid(), flush=True)\ntime.sleep(120)"]


@pytest.fixture
def kept(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[str]], Path]]:
    """Keepers a test starts (each leads a session of its own, as an agent starts it), killed with their
    programs whatever happens; and the exit file they write."""
    keepers: list[subprocess.Popen[str]] = []
    yield keepers, tmp_path / "role.exit"
    for program in PROGRAMS:  # (even one its keeper failed to take with it; psutil checks it is the same)
        with contextlib.suppress(psutil.NoSuchProcess):
            program.kill()
    PROGRAMS.clear()
    for keeper in keepers:
        keeper.kill()
        keeper.wait(timeout=10)
        if keeper.stdout is not None:
            keeper.stdout.close()


def keep(keepers: list[subprocess.Popen[str]], exit_file: Path, argv: list[str]) -> tuple[subprocess.Popen[str], int]:
    """A keeper of ``argv`` and its program's pid (the program prints it first)."""
    keeper = subprocess.Popen([sys.executable, "-m", "psctl.agent.keeper", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, "PSCTL_EXIT_FILE": str(exit_file)})
    keepers.append(keeper)
    assert keeper.stdout is not None
    first = keeper.stdout.readline().split()
    assert first[:1] == ["up"], first
    PROGRAMS.append(psutil.Process(int(first[1])))
    if len(first) > 2:
        KEPT_ENV[int(first[1])] = first[2]
    return keeper, int(first[1])


def test_the_role_s_group_signalled_its_program_gets_the_signal_once_and_its_exit_code_is_kept(
        kept: tuple[list[subprocess.Popen[str]], Path]) -> None:
    keepers, exit_file = kept
    keeper, program = keep(keepers, exit_file, [*COUNTS_TERMS, "3"])
    assert os.getpgid(program) == program != keeper.pid  # a group of its own: its signals come from the keeper
    os.killpg(keeper.pid, signal.SIGTERM)  # what an agent's stop does
    assert keeper.wait(timeout=10) == 3
    assert keeper.stdout is not None and keeper.stdout.read().split() == ["terms", "1"]
    assert exit_file.read_text() == "3\n"


def test_the_keeper_signalled_alone_passes_the_signal_on(kept: tuple[list[subprocess.Popen[str]], Path]) -> None:
    """``kill PID`` with the pid ``psctl status`` shows (the keeper's) reaches the program."""
    keepers, exit_file = kept
    keeper, _ = keep(keepers, exit_file, [*COUNTS_TERMS, "4"])
    os.kill(keeper.pid, signal.SIGTERM)
    assert keeper.wait(timeout=10) == 4
    assert keeper.stdout is not None and keeper.stdout.read().split() == ["terms", "1"]


def test_the_exit_file_is_the_keeper_s_to_write_not_its_program_s(
        kept: tuple[list[subprocess.Popen[str]], Path]) -> None:
    keepers, exit_file = kept
    keeper, program = keep(keepers, exit_file, [*COUNTS_TERMS, "0"])
    assert keeper.stdout is not None
    os.kill(program, signal.SIGTERM)  # (the program itself, not its group: a user's kill)
    assert keeper.wait(timeout=10) == 0
    assert exit_file.read_text() == "0\n"
    assert keeper.stdout.read().split() == ["terms", "1"]
    assert KEPT_ENV[program] == "None"  # PSCTL_EXIT_FILE was not in its environment


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR1])
def test_a_program_killed_by_a_signal_ends_its_keeper_by_that_signal(
        kept: tuple[list[subprocess.Popen[str]], Path], sig: int) -> None:
    keepers, exit_file = kept
    keeper, program = keep(keepers, exit_file, SLEEPS)
    os.kill(program, sig)
    assert keeper.wait(timeout=10) == -sig  # what its agent, its parent, reads: the program's own status
    assert exit_file.read_text() == f"{-sig}\n"  # what an agent that adopted it reads


def test_a_keeper_killed_outright_takes_its_program_with_it(kept: tuple[list[subprocess.Popen[str]], Path]) -> None:
    keepers, exit_file = kept
    keeper, program = keep(keepers, exit_file, SLEEPS)
    os.kill(keeper.pid, signal.SIGKILL)
    assert keeper.wait(timeout=10) == -signal.SIGKILL
    wait_until(lambda: not psutil.pid_exists(program) or psutil.Process(program).status() == psutil.STATUS_ZOMBIE,
               timeout=10, what="the program to die with its keeper")
    assert not exit_file.exists()  # killed: nothing written, as a runtime killed by SIGKILL writes nothing


def test_a_program_that_cannot_start_ends_its_keeper_with_127(kept: tuple[list[subprocess.Popen[str]], Path],
                                                              tmp_path: Path) -> None:
    _, exit_file = kept
    missing = str(tmp_path / "no-such-program")
    done = subprocess.run([sys.executable, "-m", "psctl.agent.keeper", missing], capture_output=True, text=True,
                          env={**os.environ, "PSCTL_EXIT_FILE": str(exit_file)}, timeout=30, check=False)
    assert done.returncode == 127
    assert done.stderr.strip() == f"psctl.agent.keeper: cannot start {missing}: No such file or directory"
    assert exit_file.read_text() == "127\n"


#: Starts a child in its own group that ignores SIGTERM, says both pids, and ends with code 5.
LEAVES_A_CHILD = [sys.executable, "-c", "import os, subprocess, sys\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nprint(1, flush=True)\\ntime.sleep(120)'], "
                  "stdout=subprocess.PIPE)\nchild.stdout.readline()\n"
                  "print('up', os.getpid(), flush=True)\nprint('child', child.pid, flush=True)\nsys.exit(5)\n"]


def test_what_a_program_left_in_its_group_ends_with_it(kept: tuple[list[subprocess.Popen[str]], Path]) -> None:
    keepers, exit_file = kept
    keeper, _ = keep(keepers, exit_file, LEAVES_A_CHILD)
    assert keeper.stdout is not None
    said = keeper.stdout.readline().split()
    assert said[0] == "child"
    child = int(said[1])
    with contextlib.suppress(psutil.NoSuchProcess):
        PROGRAMS.append(psutil.Process(child))  # (killed after the test, should it outlive it)
    assert keeper.wait(timeout=10) == 5
    wait_until(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
               timeout=10, what="the program's child to end with it")

"""Shell completion of cluster names, spec files and role names, through the installed ``psctl`` and a real bash
running the completion script psctl prints."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import psctl_binary

from psctl.home import ClusterDir
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, RoleState, save_state


@pytest.fixture
def world(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Two clusters (one finished, one running) in a home, and a folder with a spec file and another file."""
    home = tmp_path / "home"
    for name, state, roles in (("digits", ClusterState.SUCCEEDED, ("chief-0", "worker-0")),
                               ("embed", ClusterState.RUNNING, ("chief-0", "ps-0", "worker-0", "worker-1"))):
        cdir = ClusterDir(home / name)
        cdir.create()
        save_state(cdir.state_file, ClusterRecord(name=name, cluster_id=f"{name}-1", state=state, roles=[
            RoleRecord(r, r.split("-")[0], int(r[-1]), "localhost", "127.0.0.1", 1, state=RoleState.RUNNING)
            for r in roles]))
    work = tmp_path / "work"
    (work / "specs").mkdir(parents=True)
    for name in ("dense.yaml", "specs/embed-big.yml", "notes.txt"):
        (work / name).write_text("name: x\n")
    return dict(os.environ, PSCTL_HOME=str(home)), work


def complete(env: dict[str, str], cwd: Path, line: str) -> list[str]:
    words = line.split(" ")
    result = subprocess.run([psctl_binary()], env={**env, "_PSCTL_COMPLETE": "bash_complete", "COMP_WORDS": line,
                                                   "COMP_CWORD": str(len(words) - 1)},
                            cwd=cwd, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not result.stderr, result
    return [item.split(",", 1)[1] for item in result.stdout.splitlines() if item]


def test_cluster_names_unfinished_first_then_spec_files(world: tuple[dict[str, str], Path]) -> None:
    env, work = world
    assert complete(env, work, "psctl status ") == ["embed", "digits", "dense.yaml"]
    assert complete(env, work, "psctl down d") == ["digits", "dense.yaml"]
    assert complete(env, work, "psctl events specs/") == ["specs/embed-big.yml"]
    assert complete(env, work, "psctl scale e") == ["embed"]


def test_role_names_of_the_cluster_a_command_would_use(world: tuple[dict[str, str], Path]) -> None:
    env, work = world
    # two clusters, one of them running: `psctl logs ROLE` reads the running one's
    assert complete(env, work, "psctl logs wor") == ["worker-0", "worker-1"]
    assert complete(env, work, "psctl logs ") == ["chief-0", "ps-0", "worker-0", "worker-1"]


def test_a_broken_state_file_completes_nothing_and_says_nothing(world: tuple[dict[str, str], Path]) -> None:
    env, work = world
    (Path(env["PSCTL_HOME"]) / "embed" / "state.json").write_text("{not json")
    assert complete(env, work, "psctl status ") == ["digits", "dense.yaml"]
    assert complete(env, work, "psctl logs ") == []  # (which cluster `psctl logs` would read is not known)


def test_bash_completes_with_the_script_psctl_prints(world: tuple[dict[str, str], Path]) -> None:
    env, work = world
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = subprocess.run([psctl_binary()], env={**env, "_PSCTL_COMPLETE": "bash_source"}, capture_output=True,
                            text=True, timeout=30, check=True).stdout
    probe = (f"{script}\nCOMP_WORDS=(psctl logs worker-); COMP_CWORD=2; _psctl_completion {psctl_binary()}; "
             "printf '%s\\n' \"${COMPREPLY[@]}\"")
    shown = subprocess.run([bash, "--norc", "-c", probe], env=env, cwd=work, capture_output=True, text=True,
                           timeout=30)
    assert shown.stdout.split() == ["worker-0", "worker-1"], shown

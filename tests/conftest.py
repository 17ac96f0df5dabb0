"""Shared fixtures for the command-line tests: a private ``PSCTL_HOME`` per test, and a teardown that leaves no
process behind.

:func:`psctl_env` gives each test its own ``PSCTL_HOME`` under ``tmp_path`` (set with monkeypatch, so click's
``CliRunner`` sees it, and in :attr:`PsctlEnv.env` for subprocesses). Its ``finally`` runs ``psctl down`` for
every cluster the test created, then SIGKILLs any process still carrying one of the test's ``PSCTL_CLUSTER_ID``
values (found through psutil, by environment) and fails the test if any survives or if ``down`` failed.
"""

from __future__ import annotations

import compileall
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile psctl's modules once, before the tests start their hundreds of processes (the CLI, supervisors,
    agents, roles). Where PYTHONDONTWRITEBYTECODE is set (as in some CI images) no process writes its bytecode,
    so each one would compile psctl from source again: ~0.1 s of CPU a start. compileall writes it regardless."""
    compileall.compile_dir(REPO_ROOT / "psctl", quiet=1)


def psctl_binary() -> str:
    """The installed ``psctl`` console script (``pip install -e .`` puts it on PATH)."""
    found = shutil.which("psctl")
    if found is None:
        pytest.fail("the psctl command is not on PATH; install the project with `pip install -e '.[test]'`")
    return found


def spec_text(
    name: str,
    *,
    steps: int = 300,
    ps: int = 1,
    workers: int = 2,
    program: str = "psctl.models.mlp",
    hidden_units: int = 32,
    worker_extra: str = "",
    chief_extra: str = "",
) -> str:
    """A small local cluster: 1 chief, ``ps`` ps, ``workers`` workers; an MLP on scikit-learn's digits."""
    chief = f"{{{chief_extra}}}"
    worker = f"{{replicas: {workers}{', ' + worker_extra if worker_extra else ''}}}"
    return textwrap.dedent(
        f"""\
        name: {name}
        roles:
          chief: {chief}
          ps: {{replicas: {ps}}}
          worker: {worker}
        training:
          program: {program}
          args: {{hidden_units: {hidden_units}}}
          data: {{name: digits}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.01}}
          mode: async
          steps: {steps}
        supervision: {{heartbeat_interval: 0.5s, heartbeat_timeout: 10s}}
        """
    )


WRAPPED_PROGRAM = textwrap.dedent("""\
    import os, sys, time
    from MODULE import build as build_model

    ROLE = os.environ.get("PSCTL_ROLE")

    def build(args, data, seed):
        model = build_model(args, data, seed)
        calls = [0]
        train = model.loss_and_grads

        def loss_and_grads(params, batch):
            calls[0] += 1
            if CONDITION:
    ACTION
            return train(params, batch)

        model.loss_and_grads = loss_and_grads
        return model
    """)


def misbehaving_program(path: Path, condition: str, *action: str, module: str = "psctl.models.mlp") -> int:
    """Write ``path``: ``module``'s program whose training step, while ``condition`` holds (Python over ``calls``,
    the steps this process computed, ``os`` and ``ROLE``), runs the ``action`` lines first (then the step, unless
    they return, raise or never end). Returns the line number of the action's first line (where a traceback
    points)."""
    text = WRAPPED_PROGRAM.replace("MODULE", module).replace("CONDITION", condition)
    path.write_text(text.replace("ACTION", "\n".join(" " * 12 + a for a in action)), encoding="utf-8")
    return WRAPPED_PROGRAM.splitlines().index("ACTION") + 1


class Hold:
    """A training program (``module``'s, unchanged) whose every step takes ``pause`` seconds longer while the
    test holds it (``with hold:``). A test that must act before training ends (kill a worker and see it
    restarted, scale, probe the roles) holds the run meanwhile: a run of fixed steps on a faster machine than
    the one the test was written on otherwise finished first, and the restart or the scale never came."""

    def __init__(self, folder: Path, module: str = "psctl.models.mlp", pause: float = 0.01) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.marker = folder / "held"
        self.program = folder / "held_program.py"
        misbehaving_program(self.program, f"os.path.exists({str(self.marker)!r})", f"time.sleep({pause!r})",
                            module=module)

    def start(self) -> None:
        self.marker.touch()

    def release(self) -> None:
        self.marker.unlink(missing_ok=True)

    def __enter__(self) -> Hold:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def readme_files(section: str) -> dict[str, str]:
    """The files a README section shows, by name: each fenced block whose first line is a comment naming its file
    (``# my_model.py``, ``# spec.yaml, beside ...``), so that the tests run what the README says."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"^```\w*\n(.*?)^```", body, flags=re.M | re.S):
        named = re.match(r"# ([\w.-]+\.\w+)\b", block)
        if named:
            files[named[1]] = block
    return files


def _environ(proc: psutil.Process) -> dict[str, str] | None:
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # dead already: nothing to stop, and its environment is gone
        return proc.environ()
    except psutil.Error:
        return None


class PsctlEnv:
    """One test's psctl world: its home folder, the environment for subprocesses, and process lookups."""

    def __init__(self, home: Path, tmp_path: Path) -> None:
        self.home = home
        self.tmp_path = tmp_path
        self.env = dict(os.environ, PSCTL_HOME=str(home), PYTHONUNBUFFERED="1")
        #: Every cluster id this test has seen (read from state files); teardown hunts their processes.
        self.cluster_ids: set[str] = set()

    # -- files ----------------------------------------------------------------------------------------
    def write_spec(self, name: str, filename: str | None = None, **kwargs: Any) -> Path:
        path = self.tmp_path / (filename or f"{name}.yaml")
        path.write_text(spec_text(name, **kwargs), encoding="utf-8")
        return path

    def state_file(self, name: str) -> Path:
        return self.home / name / "state.json"

    def state(self, name: str) -> dict[str, Any]:
        """The cluster's state.json as written by the supervisor (atomically replaced, so always whole)."""
        data: dict[str, Any] = json.loads(self.state_file(name).read_text(encoding="utf-8"))
        self.cluster_ids.add(data["cluster_id"])
        return data

    def role(self, name: str, role: str) -> dict[str, Any]:
        for record in self.state(name)["roles"]:
            if record["name"] == role:
                return record  # type: ignore[no-any-return]
        raise AssertionError(f"no role {role!r} in the state of cluster {name!r}")

    # -- commands -------------------------------------------------------------------------------------
    def run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the installed ``psctl`` with this test's PSCTL_HOME, from the repository root."""
        try:
            return subprocess.run(
                [psctl_binary(), *args],
                env=self.env,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"`psctl {' '.join(args)}` did not finish within {timeout:.0f}s\n"
                f"stdout: {exc.stdout!r}\nstderr: {exc.stderr!r}"
            ) from None

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [psctl_binary(), *args],
            env=self.env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )

    # -- processes ------------------------------------------------------------------------------------
    def processes(self, cluster_id: str | None = None) -> list[psutil.Process]:
        """Live (not zombie) processes of one of this test's clusters (all of them when ``cluster_id`` is
        None): by PSCTL_CLUSTER_ID in their environment, or PSCTL_HOME pointing at this test's home."""
        me = os.getpid()
        found = []
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            env = _environ(proc)
            if not env or "PSCTL_CLUSTER_ID" not in env:
                continue
            cid = env["PSCTL_CLUSTER_ID"]
            if cluster_id is not None:
                if cid == cluster_id:
                    found.append(proc)
            elif cid in self.cluster_ids or env.get("PSCTL_HOME") == str(self.home):
                found.append(proc)
        return found

    def describe(self, procs: list[psutil.Process]) -> str:
        out = []
        for proc in procs:
            try:
                out.append(f"pid {proc.pid} {proc.status()} {' '.join(proc.cmdline())}")
            except psutil.Error:
                out.append(f"pid {proc.pid} (gone)")
        return "; ".join(out)

    def teardown(self) -> list[str]:
        """``psctl down`` every cluster, then kill whatever still runs; returns the problems found."""
        problems: list[str] = []
        clusters = sorted(p.parent for p in self.home.glob("*/state.json")) if self.home.is_dir() else []
        for cdir in clusters:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.state(cdir.name)
            try:
                done = subprocess.run(
                    [psctl_binary(), "down", cdir.name, "--grace", "2"],
                    env=self.env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                    stdin=subprocess.DEVNULL,
                )
            except subprocess.TimeoutExpired:
                problems.append(f"`psctl down {cdir.name}` did not finish within 60s")
                continue
            if done.returncode != 0:
                problems.append(f"`psctl down {cdir.name}` exited {done.returncode}: {done.stderr.strip()}")
        left = self.processes()
        if left:
            problems.append(f"processes left after `psctl down`: {self.describe(left)}")
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(signal.SIGKILL)
            psutil.wait_procs(left, timeout=10)
            still = self.processes()
            if still:
                problems.append(f"processes survived SIGKILL: {self.describe(still)}")
        return problems


@pytest.fixture
def psctl_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[PsctlEnv]:
    home = tmp_path / "psctl-home"
    monkeypatch.setenv("PSCTL_HOME", str(home))
    penv = PsctlEnv(home, tmp_path)
    try:
        yield penv
    finally:
        problems = penv.teardown()
        if problems:
            pytest.fail("cleanup of the test's clusters: " + " | ".join(problems), pytrace=False)

"""``psctl up / status / logs / down`` across three real SSH hosts (tests/sshbed.py: real sshd in network
namespaces), run with the installed ``psctl`` binary as a user would.

Each host gets a workdir of its own (the test hosts share one filesystem; separate folders keep a file that
only one host received from being found on another). h1 and h2 run this virtualenv's python, which has psctl;
h3 runs a python that has numpy and grpc but no psctl, so ``up`` must copy psctl there. The launch machine
reads ``~/.ssh/known_hosts`` of a private ``HOME``, as a user's would be read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import wait_until
from sshbed import SSHBed, sshbed_fixture  # noqa: F401

from psctl import __version__

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

#: A small program file of the user's: copied to every host (a softmax regression on the given data).
PROGRAM = """\
from psctl.models.softmax import build  # noqa: F401  (the program interface: build(args, data, seed))
"""


@dataclass
class Remote:
    """A cluster spec over the bed's hosts, and how to run psctl against it."""

    bed: SSHBed
    name: str
    folder: Path
    spec: Path
    env: dict[str, str]
    workdirs: dict[str, Path]

    def psctl(self, *args: str, timeout: float = 240.0, check: int | None = 0) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["psctl", *args], env=self.env, cwd=self.folder, capture_output=True, text=True,
                              timeout=timeout)
        if check is not None:
            assert done.returncode == check, (
                f"psctl {' '.join(args)} exited {done.returncode}, expected {check}\n"
                f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}\n{self.supervisor_log()}"
            )
        return done

    def supervisor_log(self) -> str:
        path = Path(self.env["PSCTL_HOME"]) / self.name / "supervisor.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def status(self) -> dict[str, Any]:
        return json.loads(self.psctl("status", self.name, "--json").stdout)

    def processes(self, host: str, cluster_id: str) -> list[str]:
        """Processes on a test host whose environment carries the cluster's id (read with ps there)."""
        out = self.bed.exec(host, "ps axeww -o pid=,stat=,args=", check=True).stdout
        return [line for line in out.splitlines()
                if f"PSCTL_CLUSTER_ID={cluster_id}" in line.split() and " Z" not in line[:16]]


def python_without_psctl(folder: Path) -> Path:
    """A python that can import numpy, grpc and scikit-learn but not psctl: this interpreter without its
    site (so no .pth file installs the editable psctl), with the site-packages folder on its path."""
    site = sysconfig.get_paths()["purelib"]
    script = folder / "python-without-psctl"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n')
    script.chmod(0o755)
    return script


def write_spec(bed: SSHBed, folder: Path, name: str, *, steps: int, extra_hosts: str = "",
               roles: str | None = None, python3: str | None = None) -> tuple[Path, dict[str, Path]]:
    workdirs = {h: folder / "hosts" / h for h in bed.hosts}
    python3 = python3 or str(python_without_psctl(folder))
    pythons = {"h1": sys.executable, "h2": sys.executable, "h3": python3}
    hosts = "\n".join(
        f"  - {{name: {h}, address: {bed.hosts[h].address}, user: root, identity_file: {bed.client_key}, "
        f"python: '{pythons[h]}', workdir: '{workdirs[h]}'}}"
        for h in sorted(bed.hosts)
    )
    roles = roles or textwrap.dedent("""\
          chief: {host: h1, port: 7100}
          ps: {replicas: 2, hosts: [h2, h3], port: 7110}
          worker: {replicas: 3, hosts: [h1, h2, h3], port: 7120}
          evaluator: {host: h1, port: 7130}
        """)
    spec = folder / "cluster.yaml"
    spec.write_text(
        f"name: {name}\nhosts:\n{hosts}\n{extra_hosts}roles:\n{textwrap.indent(roles, '  ')}"
        + textwrap.dedent(f"""\
        training:
          program: program.py
          data: {{path: data/digits.npz, x: x, y: y}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.02}}
          steps: {steps}
          checkpoint: {{every_steps: 100}}
        supervision: {{heartbeat_interval: 0.5s, heartbeat_timeout: 10s, startup_grace: 60s}}
        """)
    )
    return spec, workdirs


@pytest.fixture
def remote(sshbed: SSHBed, tmp_path: Path) -> Iterator[Remote]:
    """A spec folder with a program file and a data file, and an environment whose HOME knows the hosts'
    keys; afterwards `psctl down` and a check that no process of the test's clusters is left on any host."""
    import numpy as np
    from sklearn.datasets import load_digits

    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "program.py").write_text(PROGRAM)
    digits = load_digits()
    np.savez(folder / "data" / "digits.npz", x=(digits.data / 16.0).astype(np.float32), y=digits.target)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "known_hosts").write_text(sshbed.known_hosts.read_text())
    env = dict(os.environ, HOME=str(home), PSCTL_HOME=str(tmp_path / "psctl-home"))
    name = f"ssh-{uuid.uuid4().hex[:6]}"
    spec, workdirs = write_spec(sshbed, folder, name, steps=300)
    r = Remote(sshbed, name, folder, spec, env, workdirs)
    try:
        yield r
    finally:
        state = Path(env["PSCTL_HOME"]) / name / "state.json"
        cluster_id = json.loads(state.read_text())["cluster_id"] if state.exists() else None
        r.psctl("down", name, check=None, timeout=120)
        if cluster_id is not None:
            left = {h: r.processes(h, cluster_id) for h in sshbed.hosts}
            for h, lines in left.items():
                for line in lines:
                    sshbed.exec(h, f"kill -9 {line.split()[0]}")
            assert not any(left.values()), f"processes left behind: {left}"


def test_a_cluster_over_three_hosts_trains_to_completion_and_leaves_nothing(remote: Remote) -> None:
    done = remote.psctl("up", str(remote.spec))
    assert "training finished: 300 steps" in " ".join(done.stdout.split()), done.stdout

    status = remote.status()
    cluster_id = status["cluster_id"]
    assert status["state"] == "succeeded"
    placed = {r["name"]: r["host"] for r in status["roles"]}
    assert placed == {"chief-0": "h1", "ps-0": "h2", "ps-1": "h3", "worker-0": "h1", "worker-1": "h2",
                      "worker-2": "h3", "evaluator-0": "h1"}
    assert status["roles"][0]["state"] == "succeeded"
    result = status["result"]
    assert result["global_step"] == 300
    assert result["metrics"]["accuracy"] >= 0.85, result  # softmax regression on digits: ~0.9 after 300 steps
    assert result["checkpoint"].startswith(f"h1:{remote.workdirs['h1']}/{remote.name}/checkpoints/")
    assert result["evaluation"]["accuracy"] >= 0.8
    # The chief's metrics reached this machine (status and plots read them here).
    metrics = Path(remote.env["PSCTL_HOME"]) / remote.name / "run" / "metrics.jsonl"
    assert any(json.loads(line).get("global_step") == 300 for line in metrics.read_text().splitlines())

    # The program, the data, the keys and (on h3 only) psctl were copied; keys are private.
    for host, workdir in remote.workdirs.items():
        root = workdir / remote.name
        assert (root / "files" / "program.py").read_text() == PROGRAM
        assert (root / "files" / "data" / "digits.npz").stat().st_size > 0
        keys = sorted(p.name for p in (root / "tls").iterdir())
        expected = {"h1": ["chief-0", "evaluator-0", "worker-0"], "h2": ["ps-0", "worker-1"],
                    "h3": ["ps-1", "worker-2"]}[host]
        assert keys == sorted(["ca.pem", *(f"{n}.key" for n in expected), *(f"{n}.pem" for n in expected)])
        assert {oct((root / "tls" / k).stat().st_mode & 0o777) for k in keys} == {"0o600"}
        copies = list(workdir.glob(f"psctl-{__version__}-*/.complete"))
        assert len(copies) == (1 if host == "h3" else 0), (host, copies)

    # worker-1's log (on h2) read over SFTP: that worker's own output.
    log = remote.psctl("logs", "worker-1", remote.name).stdout
    assert "worker:1 starting" in log and "worker:0" not in log
    assert remote.psctl("logs", "worker-1", remote.name, "--tail", "1").stdout.count("\n") == 1

    remote.psctl("down", remote.name, "--purge")
    for host, workdir in remote.workdirs.items():
        assert remote.processes(host, cluster_id) == []
        left = sorted(p.name for p in (workdir / remote.name).iterdir()) if (workdir / remote.name).exists() else []
        assert left == (["checkpoints"] if host == "h1" else []), (host, left)


def test_status_logs_follow_and_down_while_training(remote: Remote) -> None:
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=200_000)
    remote.psctl("up", str(spec), "--detach")

    def running() -> dict[str, Any] | None:
        status = remote.status()
        assert status["state"] not in ("failed", "succeeded", "stopped"), remote.supervisor_log()
        steps = [r["local_step"] for r in status["roles"] if r["role"] == "worker"]
        return status if status["state"] == "running" and all(s > 0 for s in steps) else None

    status = wait_until(running, timeout=120, what="every worker on every host to train")
    cluster_id = status["cluster_id"]
    table = " ".join(remote.psctl("status", remote.name).stdout.split())
    for role, host in (("chief-0", "h1"), ("ps-1", "h3"), ("worker-1", "h2")):
        assert f"{role} {host}" in table, table
    for host in remote.bed.hosts:
        assert remote.processes(host, cluster_id), f"nothing of the cluster runs on {host}"

    # logs -f follows the remote file: new lines keep arriving.
    follow = subprocess.Popen(["psctl", "logs", "-f", "chief-0", remote.name], env=remote.env, cwd=remote.folder,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        seen = [follow.stdout.readline() for _ in range(3)]
        assert all(seen), seen
    finally:
        follow.terminate()
        follow.wait(timeout=10)
        if follow.stdout is not None:
            follow.stdout.close()

    done = remote.psctl("down", remote.name)
    assert "no process of it is left" in " ".join(done.stdout.split())
    for host in remote.bed.hosts:
        assert remote.processes(host, cluster_id) == [], host
    assert remote.status()["state"] == "stopped"

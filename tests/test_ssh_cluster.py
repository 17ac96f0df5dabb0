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
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cluster_helpers import wait_until
from conftest import Hold
from sshbed import SUBNET, SSHBed, sshbed_fixture  # noqa: F401

from psctl import __version__
from psctl.pki import member_files
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.checkpoint import load_checkpoint
from psctl.runtime.rpc import make_channel

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

#: A small program file of the user's: copied to every host (a softmax regression on the given data).
@dataclass
class Remote:
    """A cluster spec over the bed's hosts, and how to run psctl against it."""

    bed: SSHBed
    name: str
    folder: Path
    spec: Path
    env: dict[str, str]
    workdirs: dict[str, Path]
    #: program.py's steps 50 ms slower while the test holds it (the hosts share this machine's files)
    hold: Hold

    def events(self) -> list[dict[str, Any]]:
        path = Path(self.env["PSCTL_HOME"]) / self.name / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

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

    def processes(self, host: str, cluster_id: str, *, role: str | None = None) -> list[str]:
        """Processes on a test host whose environment carries the cluster's id (read with ps there): its agent
        and roles, or only the processes of ``role``."""
        out = self.bed.exec(host, "ps axeww -o pid=,stat=,args=", check=True).stdout
        return [line for line in out.splitlines()
                if f"PSCTL_CLUSTER_ID={cluster_id}" in line.split() and " Z" not in line[:16]
                and (role is None or f"PSCTL_ROLE={role}" in line.split())]


def python_without_psctl(folder: Path) -> Path:
    """A python that can import numpy, grpc and scikit-learn but not psctl: this interpreter without its
    site (so no .pth file installs the editable psctl), with the site-packages folder on its path."""
    site = sysconfig.get_paths()["purelib"]
    script = folder / "python-without-psctl"
    script.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{site}" exec {sys.executable} -S "$@"\n')
    script.chmod(0o755)
    return script


def write_spec(bed: SSHBed, folder: Path, name: str, *, steps: int, roles: str | None = None,
               **host_keys: dict[str, str]) -> tuple[Path, dict[str, Path]]:
    """The spec: hosts h1..h3 (``h2={"python": ...}`` overrides a host's keys), roles spread over them."""
    workdirs = {h: folder / "hosts" / h for h in bed.hosts}
    pythons = {"h1": sys.executable, "h2": sys.executable, "h3": str(python_without_psctl(folder))}
    lines = []
    for h in sorted(bed.hosts):
        keys = {"name": h, "address": bed.hosts[h].address, "user": "root", "identity_file": str(bed.client_key),
                "python": pythons[h], "workdir": str(workdirs[h]), **host_keys.get(h, {})}
        lines.append("  - {" + ", ".join(f"{k}: '{v}'" for k, v in keys.items()) + "}")
    hosts = "\n".join(lines)
    roles = roles or textwrap.dedent("""\
          chief: {host: h1, port: 7100}
          ps: {replicas: 2, hosts: [h2, h3], port: 7110}
          worker: {replicas: 3, hosts: [h1, h2, h3], port: 7120}
          evaluator: {host: h1, port: 7130}
        """)
    spec = folder / "cluster.yaml"
    spec.write_text(
        f"name: {name}\nhosts:\n{hosts}\nroles:\n{textwrap.indent(roles, '  ')}"
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
    from sklearn.datasets import load_digits

    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    hold = Hold(tmp_path / "hold", "psctl.models.softmax", pause=0.05)
    (folder / "program.py").write_text(hold.program.read_text())
    digits = load_digits()
    np.savez(folder / "data" / "digits.npz", x=(digits.data / 16.0).astype(np.float32), y=digits.target)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    (home / ".ssh" / "known_hosts").write_text(sshbed.known_hosts.read_text())
    env = dict(os.environ, HOME=str(home), PSCTL_HOME=str(tmp_path / "psctl-home"))
    name = f"ssh-{uuid.uuid4().hex[:6]}"
    spec, workdirs = write_spec(sshbed, folder, name, steps=300)
    r = Remote(sshbed, name, folder, spec, env, workdirs, hold)
    try:
        yield r
    finally:
        for host in sshbed.hosts:  # a test that failed while a host was cut off or frozen must not leave it so
            sshbed.thaw(host)
            sshbed.heal(host)
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
        assert (root / "files" / "program.py").read_text() == (remote.folder / "program.py").read_text()
        assert (root / "files" / "data" / "digits.npz").stat().st_size > 0
        keys = sorted(p.name for p in (root / "tls").iterdir())
        # up copies each host its agent's key only; a role's key comes with its start, to the host it runs on
        expected = [f"agent-{host}", *(name for name, where in placed.items() if where == host)]
        assert keys == sorted(["ca.pem", *(f"{n}.key" for n in expected), *(f"{n}.pem" for n in expected)])
        assert {oct((root / "tls" / k).stat().st_mode & 0o777) for k in keys} == {"0o600"}
        copies = list(workdir.glob(f"psctl-{__version__}-*/.complete"))
        assert len(copies) == (1 if host == "h3" else 0), (host, copies)

    # worker-1's log (on h2) read over SFTP: that worker's own output.
    log = remote.psctl("logs", "worker-1", remote.name).stdout
    assert "worker:1 starting" in log and "worker:0" not in log
    assert remote.psctl("logs", "worker-1", remote.name, "--tail", "1").stdout.count("\n") == 1

    # export copies the newest checkpoint from the chief's host (h1) over SFTP, verified, then writes it here.
    out = remote.folder / "model.npz"
    newest = f"{remote.workdirs['h1']}/{remote.name}/checkpoints/ckpt-000000000300"
    exported = remote.psctl("export", remote.name, "-o", str(out)).stdout
    assert exported.startswith(f"exported h1:{newest} (global step 300) to {out}: "), exported
    want = load_checkpoint(newest).variables  # the hosts share this machine's file system: read it directly
    with np.load(out) as arrays:
        assert sorted(arrays.files) == sorted(want) and all(np.array_equal(arrays[k], want[k]) for k in want)

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


# -- what stops `up` before anything starts: one line per problem, every host reported, nothing left ---------
def nothing_started(remote: Remote) -> None:
    """No cluster was recorded, no supervisor runs here, no process of it runs on any host."""
    assert not (Path(remote.env["PSCTL_HOME"]) / remote.name / "state.json").exists()
    assert remote.psctl("status", remote.name, check=None).returncode == 4
    for host in remote.bed.hosts:
        out = remote.bed.exec(host, "ps axeww -o args=").stdout
        assert f"PSCTL_CLUSTER_ID={remote.name}-" not in out, host
    local = subprocess.run(["ps", "axeww", "-o", "args="], capture_output=True, text=True).stdout
    assert f"PSCTL_CLUSTER_ID={remote.name}-" not in local


def up_fails(remote: Remote, *, code: int = 1, **host_keys: dict[str, str]) -> list[str]:
    """``psctl up`` of the spec with these host overrides: its error lines (after "error: ")."""
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=100, **host_keys)
    done = remote.psctl("up", str(spec), check=code, timeout=120)
    assert "Traceback" not in done.stderr
    lines = [line.strip() for line in done.stderr.strip().splitlines()]
    assert lines[0].startswith("error: preflight failed on"), done.stderr
    nothing_started(remote)
    return lines[1:]


def test_unreachable_host(remote: Remote) -> None:
    assert up_fails(remote, h3={"address": "10.231.0.99"}) == [
        "host h3 (10.231.0.99:22): unreachable: no route to host; check the address and the network"
    ]


def test_wrong_key(remote: Remote) -> None:
    assert up_fails(remote, h1={"identity_file": str(remote.bed.other_key)}) == [
        "host h1: authentication failed for user root; check identity_file or ssh-agent"
    ]


def test_unknown_host_key(remote: Remote) -> None:
    known = Path(remote.env["HOME"]) / ".ssh" / "known_hosts"
    h2 = remote.bed.hosts["h2"].address
    known.write_text("".join(line + "\n" for line in known.read_text().splitlines() if not line.startswith(h2)))
    assert up_fails(remote) == [
        "host h2: unknown host key; add it to known_hosts (ssh-keyscan) or set host_key_policy: accept-new"
    ]


def test_changed_host_key(remote: Remote) -> None:
    known = Path(remote.env["HOME"]) / ".ssh" / "known_hosts"
    lines = known.read_text().splitlines()
    h1_key = next(line for line in lines if line.startswith(remote.bed.hosts["h1"].address + " ")).split(" ", 1)[1]
    h2 = remote.bed.hosts["h2"].address
    known.write_text("".join((f"{h2} {h1_key}" if line.startswith(h2 + " ") else line) + "\n" for line in lines))
    assert up_fails(remote) == [
        f"host h2: host key CHANGED (possible attack); remove the old key from {known} if the change is expected"
    ]


def test_missing_remote_python(remote: Remote) -> None:
    assert up_fails(remote, h1={"python": "/opt/nowhere/python3"}) == [
        "host h1: python '/opt/nowhere/python3' not found; set hosts[].python"
    ]


def test_port_taken_on_one_host_and_a_bad_python_on_another_are_both_reported(remote: Remote) -> None:
    hold = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('0.0.0.0', 7110)); s.listen(); "  # REUSEADDR: earlier tests' ps-0 may leave a TIME_WAIT
            "print('ready', flush=True); time.sleep(120)")
    holder = remote.bed.exec("h2", f"nohup {sys.executable} -c \"{hold}\" > /dev/null 2>&1 & echo $!").stdout.strip()
    try:
        wait_until(lambda: "7110" in remote.bed.exec("h2", "ss -ltnH").stdout, timeout=10, what="the port holder")
        assert up_fails(remote, h3={"python": "/opt/nowhere/python3"}) == [
            "host h2: port 7110 (ps-0) is already in use (Address already in use); pick another port or stop what "
            "holds it (roles.ps.port)",
            "host h3: python '/opt/nowhere/python3' not found; set hosts[].python",
        ]
    finally:
        remote.bed.exec("h2", f"kill {holder}")


def test_a_port_taken_on_a_spare_host_of_a_pool_is_reported(remote: Remote) -> None:
    """ps-0 runs on h2 and may move to h3: its port must be free on h3 too, or a move there would fail."""
    hold = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('0.0.0.0', 7110)); s.listen(); time.sleep(120)")
    holder = remote.bed.exec("h3", f"nohup {sys.executable} -c \"{hold}\" > /dev/null 2>&1 & echo $!").stdout.strip()
    roles = textwrap.dedent("""\
        chief: {host: h1, port: 7100}
        ps: {replicas: 1, hosts: [h2, h3], port: 7110}
        worker: {replicas: 1, host: h1, port: 7120}
        """)
    try:
        wait_until(lambda: "7110" in remote.bed.exec("h3", "ss -ltnH").stdout, timeout=10, what="the port holder")
        spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=100, roles=roles)
        done = remote.psctl("up", str(spec), check=1, timeout=120)
        assert [line.strip() for line in done.stderr.strip().splitlines()] == [
            "error: preflight failed on 1 of 3 hosts:",
            "host h3: port 7110 (ps-0, should it move here) is already in use (Address already in use); pick "
            "another port or stop what holds it (roles.ps.port)",
        ]
        nothing_started(remote)
    finally:
        remote.bed.exec("h3", f"kill {holder}")


def test_check_reports_every_host(remote: Remote) -> None:
    done = remote.psctl("check", str(remote.spec))
    out = " ".join(done.stdout.split())
    assert "3 host(s) ready for 7 roles" in out
    assert f"none (will copy {__version__})" in out  # h3's python has no psctl
    assert out.count(f" {__version__} ") >= 2  # h1 and h2 have this version


# -- heartbeats when the hosts cannot connect back --------------------------------------------------------------
NO_CALLBACK = "psctl_no_callback"
BRIDGE_ADDRESS = f"{SUBNET}.1"  # the launch machine, as the test hosts see it


def block_connections_back(bed: SSHBed, host: str) -> None:
    """In the host's namespace, drop every new connection towards the launch machine (the bridge address):
    only SSH from the launch machine to the host (and the replies on it) is left open."""
    rules = (f"table inet {NO_CALLBACK} {{\n  chain output {{ type filter hook output priority 0; "
             f"ip daddr {BRIDGE_ADDRESS} ct state new drop; }}\n}}\n")
    subprocess.run(["ip", "netns", "exec", bed.hosts[host].netns, "nft", "-f", "-"], input=rules, text=True,
                   check=True)


def allow_connections_back(bed: SSHBed, host: str) -> None:
    subprocess.run(["ip", "netns", "exec", bed.hosts[host].netns, "nft", "delete", "table", "inet", NO_CALLBACK],
                   capture_output=True)


def test_heartbeats_arrive_when_hosts_cannot_connect_back(remote: Remote) -> None:
    listener = socket.create_server((BRIDGE_ADDRESS, 0))  # stands for anything on the launch machine
    port = listener.getsockname()[1]
    probe = f"{sys.executable} -c \"import socket; socket.create_connection(('{BRIDGE_ADDRESS}', {port}), timeout=2)\""
    try:
        assert remote.bed.exec("h1", probe).returncode == 0  # reachable before the rule
        for host in remote.bed.hosts:
            block_connections_back(remote.bed, host)
        for host in remote.bed.hosts:
            assert remote.bed.exec(host, probe).returncode != 0, f"{host} can still connect back"
        remote.psctl("up", str(remote.spec))
        status = remote.status()
        assert status["state"] == "succeeded"
        for role in status["roles"]:
            assert role["last_heartbeat"] is not None, role
        events = (Path(remote.env["PSCTL_HOME"]) / remote.name / "events.jsonl").read_text().splitlines()
        running = {e["role"] for e in map(json.loads, events) if e["to"] == "running" and e["role"] != "cluster"}
        assert running == {r["name"] for r in status["roles"]}  # every role was seen alive by its heartbeats
    finally:
        listener.close()
        for host in remote.bed.hosts:
            allow_connections_back(remote.bed, host)


# -- a host cut off: its worker is declared lost, training goes on, the worker comes back after the heal --------
CUT_ROLES = """\
chief: {host: h1, port: 7100}
ps: {replicas: 2, hosts: [h1, h3], port: 7110, restart: {backoff_seconds: 0.5, max_backoff_seconds: 2}}
worker: {replicas: 2, hosts: [h1, h3, h2], port: 7120, restart: {backoff_seconds: 0.5, max_backoff_seconds: 2}}
"""


def test_a_cut_off_hosts_ps_and_worker_move_to_other_hosts_of_their_pools(remote: Remote) -> None:
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=1_000_000, roles=CUT_ROLES)
    spec.write_text(spec.read_text().replace("heartbeat_timeout: 10s", "heartbeat_timeout: 3s"))
    remote.psctl("up", str(spec), "--detach")
    events_file = Path(remote.env["PSCTL_HOME"]) / remote.name / "events.jsonl"

    def worker(status: dict[str, Any], name: str = "worker-1") -> dict[str, Any]:
        return next(r for r in status["roles"] if r["name"] == name)

    def training_everywhere() -> dict[str, Any] | None:
        status = remote.status()
        assert status["state"] in ("starting", "running"), remote.supervisor_log()
        return status if all(r["local_step"] > 0 for r in status["roles"] if r["role"] == "worker") else None

    before = wait_until(training_everywhere, timeout=120, what="every worker to train")
    old = worker(before)
    assert old["host"] == "h3" and worker(before, "ps-1")["host"] == "h3"
    step_at_cut = before["roles"][0]["global_step"]
    remote.bed.partition("h3")
    cut_at = time.time()
    try:
        def lost() -> dict[str, Any] | None:
            for event in map(json.loads, events_file.read_text().splitlines()):
                if event["role"] == "worker-1" and event["to"] == "lost" and event["time"] > cut_at:
                    return dict(event)
            return None

        event = wait_until(lost, timeout=20, what="worker-1 to be declared lost")
        silence = re.search(r"no heartbeat for ([0-9.]+)s", event["reason"])
        assert silence, event
        # lost at the heartbeat_timeout's silence, at a look (a supervisor starved on a loaded machine looks
        # late: the cut itself bounds the detection only loosely)
        assert 3.0 <= float(silence[1]) <= 3.0 + 1.5, event
        assert event["time"] - cut_at <= 3.0 + 5.0, event

        # While h3 is still cut off, ps-1 restarts on h1 (the other host of its pool) and is restored from the
        # latest checkpoint, and worker-1 on h2, a host of its pool that had no role yet (its keys and a
        # heartbeat forward were ready there); the chief and worker-0, told of their new addresses, train on.
        def moved() -> dict[str, Any] | None:
            status = remote.status()
            w, ps = worker(status), worker(status, "ps-1")
            trained = w["local_step"] > 0 and status["roles"][0]["global_step"] > step_at_cut + 50
            return status if (w["host"], ps["host"]) == ("h2", "h1") and w["state"] == "running" and trained else None

        def explain() -> str:
            roles = [(r["name"], r["host"], r["state"], r["global_step"], r["local_step"])
                     for r in remote.status()["roles"]]
            logs = remote.workdirs["h1"] / remote.name / "logs"
            tails = {p.name: p.read_text(errors="replace")[-2500:] for p in sorted(logs.glob("chief-0.*.log"))}
            return f"roles: {roles}\nevents:\n{events_file.read_text()[-6000:]}\nchief logs: {tails}"

        after = wait_until(moved, timeout=120, what="ps-1 on h1 and worker-1 on h2 to train", detail=explain)
        recovered_at = time.time()
        new = worker(after)
        assert new["address"] == remote.bed.hosts["h2"].address and new["incarnation"] > old["incarnation"]
        assert worker(after, "ps-1")["address"] == remote.bed.hosts["h1"].address
        reasons = {name: [e["reason"] for e in map(json.loads, events_file.read_text().splitlines())
                          if e["role"] == name] for name in ("worker-1", "ps-1")}
        assert any(r.startswith("moves from h3 to h2 (") for r in reasons["worker-1"]), reasons
        assert any(r.startswith("moves from h3 to h1 (") for r in reasons["ps-1"]), reasons
        table = " ".join(remote.psctl("status", remote.name).stdout.split())
        assert "host h3: unreachable: agent silent for " in table, table
    finally:
        remote.bed.heal("h3")
    print(f"worker-1: lost {event['time'] - cut_at:.1f}s after the cut; ps-1 and worker-1 training on h1 and h2 "
          f"{recovered_at - cut_at:.1f}s after it")

    # Once h3 answers again, its agent reports the cut-off incarnations and they are stopped there...
    def gone_from_h3() -> bool:
        return not any(remote.processes("h3", before["cluster_id"], role=r) for r in ("ps-1", "worker-1"))

    wait_until(gone_from_h3, timeout=30, what="the old ps-1 and worker-1 to be stopped on h3",
               detail=lambda: remote.bed.exec("h3", "ps axww -o pid,stat,args").stdout + remote.supervisor_log())
    # Each attempt's log is read from the host that ran it: the first from h3, the one that moved from h2 (named by
    # its number: on a loaded machine a 3 s heartbeat timeout can restart the worker once more meanwhile).
    first = remote.psctl("logs", "worker-1", remote.name, "--attempt", "1").stdout
    latest = remote.psctl("logs", "worker-1", remote.name, "--attempt", str(new["attempt"])).stdout
    assert f"worker:1 serving on {remote.bed.hosts['h3'].address}:7121" in first, first
    assert f"worker:1 serving on {remote.bed.hosts['h2'].address}:7121" in latest, latest
    events = [e for e in map(json.loads, events_file.read_text().splitlines()) if e["role"] == "host h3"]
    assert [e["to"] for e in events][:3] == ["reachable", "unreachable", "reachable"], events
    # ...and had it pushed anything, every PS refuses its incarnation: it was replaced.
    tls = member_files(Path(remote.env["PSCTL_HOME"]) / remote.name / "tls", "worker-1")
    for ps in (r for r in remote.status()["roles"] if r["role"] == "ps"):
        channel = make_channel(f"{ps['address']}:{ps['port']}", tls)
        try:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.ParameterServerStub(channel).Push(
                    pb.PushRequest(step_id=2**62, task="worker:1", incarnation=old["incarnation"]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        finally:
            channel.close()
    wait_until(lambda: worker(remote.status())["state"] == "running", timeout=30, what="worker-1 to run",
               detail=remote.supervisor_log)


PINNED_PS_ROLES = """\
chief: {host: h1, port: 7100}
ps: {host: h2, port: 7110}
worker: {replicas: 2, hosts: [h1], port: 7120}
"""


def test_a_ps_waiting_for_its_cut_off_host_is_taken_back_when_the_host_answers(remote: Remote) -> None:
    """The ps' only host (h2) is cut off longer than the heartbeat timeout: the ps is lost and its restart waits
    for h2. When h2 answers, the ps' process still runs there: it is taken back as it is (it used to be killed
    and restarted, and the chief then restored every ps from the last checkpoint, losing the updates since)."""
    steps = 6000
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=steps, roles=PINNED_PS_ROLES)
    spec.write_text(spec.read_text().replace("heartbeat_timeout: 10s", "heartbeat_timeout: 3s"))
    remote.psctl("up", str(spec), "--detach")

    def ps(status: dict[str, Any]) -> dict[str, Any]:
        return next(r for r in status["roles"] if r["name"] == "ps-0")

    before = wait_until(lambda: (s := remote.status())["roles"][0]["global_step"] >= 300 and s, timeout=120,
                        what="training to pass step 300")
    remote.bed.partition("h2")
    try:
        wait_until(lambda: ps(remote.status())["reason"] == "waiting for h2 to answer", timeout=30,
                   what="ps-0's restart to wait for h2", detail=remote.supervisor_log)
    finally:
        remote.bed.heal("h2")
    final = wait_until(lambda: (s := remote.status())["state"] in ("succeeded", "failed") and s, timeout=240,
                       what="training to finish", detail=remote.supervisor_log)
    assert final["state"] == "succeeded", final["reason"]
    assert final["result"]["global_step"] == steps and final["result"]["ps_restores"] == 0, final["result"]
    assert (ps(final)["pid"], ps(final)["attempt"]) == (ps(before)["pid"], 1), remote.supervisor_log()[-3000:]
    reasons = [e["reason"] for e in map(json.loads, (Path(remote.env["PSCTL_HOME"]) / remote.name
                                                     / "events.jsonl").read_text().splitlines())
               if e["role"] == "ps-0"]
    assert "h2 answers again and its process still runs: taken back, not restarted" in reasons, reasons


CHIEF_POOL_ROLES = """\
chief: {hosts: [h3, h2], port: 7100, restart: {backoff_seconds: 0.5, max_backoff_seconds: 2}}
ps: {host: h1, port: 7110}
worker: {replicas: 2, hosts: [h1, h2], port: 7120}
"""


def test_a_chief_cut_off_from_the_supervisor_moves_and_the_old_one_is_fenced(remote: Remote) -> None:
    """The chief's checkpoints are on storage its pool shares (the test hosts share this machine's file
    system). h3, the chief's host, stops answering the supervisor but still reaches the ps and the workers:
    the chief restarts on h2, reads the global step from the ps and finishes the training, while the old chief,
    still running and connected, is refused by the workers (fencing) and stops by itself."""
    steps = 6000
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=steps, roles=CHIEF_POOL_ROLES)
    text = spec.read_text().replace("heartbeat_timeout: 10s", "heartbeat_timeout: 3s")
    spec.write_text(text.replace("checkpoint: {every_steps: 100}", "checkpoint: {every_steps: 100, dir: shared}"))
    remote.psctl("up", str(spec), "--detach")
    events_file = Path(remote.env["PSCTL_HOME"]) / remote.name / "events.jsonl"
    logs_on_h3 = remote.workdirs["h3"] / remote.name / "logs"  # the hosts share this machine's file system

    def chief(status: dict[str, Any]) -> dict[str, Any]:
        return next(r for r in status["roles"] if r["name"] == "chief-0")

    def explain() -> str:
        tails = {p.name: p.read_text(errors="replace")[-1500:] for p in sorted(logs_on_h3.glob("chief-0.*.log"))}
        return f"events:\n{events_file.read_text()[-4000:]}\nchief logs on h3: {tails}"

    def status_once(ok: Callable[[dict[str, Any]], bool]) -> Callable[[], dict[str, Any] | None]:
        def look() -> dict[str, Any] | None:
            status = remote.status()
            return status if ok(status) else None

        return look

    before = wait_until(status_once(lambda s: chief(s)["global_step"] >= 200), timeout=120,
                        what="training to pass step 200", detail=explain)
    assert chief(before)["host"] == "h3"
    old_log = logs_on_h3 / f"chief-0.{chief(before)['attempt']}.log"

    # The supervisor loses h3 (and its heartbeats); the hosts do not. h3 is frozen until the chief has moved,
    # so that the old chief cannot finish the training meanwhile, however fast this machine is.
    try:
        remote.bed.ssh_only_from_hosts("h3")
        remote.bed.freeze("h3")
        step_at_cut = chief(remote.status())["global_step"]
        moved = wait_until(status_once(lambda s: chief(s)["host"] == "h2"), timeout=60,
                           what="the chief to move to h2", detail=explain)
        assert chief(moved)["incarnation"] > chief(before)["incarnation"]
        remote.bed.thaw("h3")
        # The supervisor still cannot reach h3 to stop the old chief: the workers' refusal is what stops it.
        wait_until(lambda: not remote.processes("h3", before["cluster_id"], role="chief-0"), timeout=60,
                   what="the old chief to stop by itself", detail=explain)
        assert "a newer chief runs the training: stopping" in old_log.read_text(), explain()
    finally:
        remote.bed.thaw("h3")
        remote.bed.heal("h3")
    done = wait_until(status_once(lambda s: s["state"] in ("succeeded", "failed")), timeout=180,
                      what="training to finish on h2", detail=explain)
    assert done["state"] == "succeeded", explain()
    result = done["result"]
    assert result["global_step"] == steps and result["ps_restores"] == 0, result  # no rollback to a checkpoint
    assert result["checkpoint"].startswith(f"h2:{remote.folder / 'shared'}/"), result
    reasons = [e["reason"] for e in map(json.loads, events_file.read_text().splitlines()) if e["role"] == "chief-0"]
    assert any(r.startswith("moves from h3 to h2 (") for r in reasons), reasons
    # The new chief carried on from the ps' global step (the steps before the cut were not lost), and its
    # metrics reached this machine from h2.
    log = remote.psctl("logs", "chief-0", remote.name, "--attempt", str(chief(done)["attempt"])).stdout
    resumed = re.search(r"every ps holds the variables: resuming at global step (\d+)", log)
    assert resumed is not None and int(resumed[1]) >= step_at_cut, log[-3000:]
    metrics = Path(remote.env["PSCTL_HOME"]) / remote.name / "run" / "metrics.jsonl"
    assert any(json.loads(line).get("global_step") == steps for line in metrics.read_text().splitlines())


def test_up_refuses_while_the_last_run_left_processes_on_a_host(remote: Remote) -> None:
    """A role of the last run still alive on a host (its supervisor died, or `down` could not reach the host):
    a new `up` of the name refuses, naming it, instead of clearing its folders under it."""
    remote.psctl("up", str(remote.spec))
    cluster_id = remote.status()["cluster_id"]
    left = remote.bed.exec("h3", f"env PSCTL_CLUSTER_ID={cluster_id} nohup sleep 120 > /dev/null 2>&1 & echo $!",
                           check=True).stdout.strip()
    wait_until(lambda: remote.processes("h3", cluster_id), timeout=10, what="the left-over process")
    again = remote.psctl("up", str(remote.spec), check=2)
    assert f"still has processes on its hosts (h3:{left})" in again.stderr, again.stderr
    assert f"psctl down {remote.name}" in again.stderr and "Traceback" not in again.stderr
    assert remote.status()["cluster_id"] == cluster_id  # the last run's state is kept for that `down`
    assert remote.processes("h3", cluster_id)  # untouched (the fixture's `down` stops it)


@pytest.mark.tensorflow
def test_a_tensorflow_program_over_three_hosts_trains_to_completion(remote: Remote) -> None:
    """The TF2 ParameterServerStrategy example, unmodified, over SSH: the chief and the evaluator on h1, the ps on
    h2, a worker on h2 and one on h3 (whose python has no psctl: psctl's copy serves its TensorFlow server)."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        if os.environ.get("CI"):
            pytest.fail("tensorflow is missing: the test command installs it (pip install -e '.[test,tensorflow]')")
        pytest.skip("tensorflow is not installed")
    shutil.copytree(Path(__file__).resolve().parents[1] / "cluster_examples" / "tensorflow",
                    remote.folder / "tensorflow")
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=1, roles=textwrap.dedent("""\
          chief: {host: h1, port: 7100}
          ps: {host: h2, port: 7110}
          worker: {replicas: 2, hosts: [h2, h3], port: 7120}
          evaluator: {host: h1, port: 7130}
        """))
    text = spec.read_text()
    training = text[text.index("training:"):text.index("supervision:")]
    spec.write_text(text.replace(training, textwrap.dedent("""\
        training:
          framework: tensorflow
          command: "python tensorflow/tf2_pss_train.py --steps 200 --checkpoint_dir {checkpoint_dir}"
          steps: 200
        """)).replace("startup_grace: 60s", "startup_grace: 120s"))
    done = remote.psctl("up", str(spec), timeout=300)
    assert "training finished: the chief exited 0 at step 200" in " ".join(done.stdout.split()), done.stdout
    status = remote.status()
    assert status["state"] == "succeeded"
    assert {r["name"]: r["host"] for r in status["roles"]}["worker-1"] == "h3"
    chief_log = remote.psctl("logs", "chief-0", remote.name).stdout
    assert "chief: finished at step 200" in chief_log, chief_log[-2000:]
    evaluator_log = remote.psctl("logs", "evaluator-0", remote.name).stdout
    assert "evaluator: step 200 eval loss" in evaluator_log
    # the program's checkpoints are on the chief's host, where {checkpoint_dir} pointed
    assert list((remote.workdirs["h1"] / remote.name / "checkpoints").glob("ckpt-*.index"))
    remote.psctl("down", remote.name)
    for host in remote.workdirs:
        assert remote.processes(host, status["cluster_id"]) == []


def test_a_new_supervisor_adopts_the_roles_on_the_hosts_and_training_ends_exactly(remote: Remote) -> None:
    """The launch machine's supervisor dies mid-training: the hosts' agents keep their roles and redial the
    reverse forward; `psctl supervise` listens where the last one did (and asks each host for the same forwarded
    port), the agents dial in, and their roles are adopted: same processes, first attempts, exact step count.
    One host (h3) is cut off as the new supervisor starts: it is reached as soon as it answers again, its
    forward made then (it used to wait for the startup grace to replace an agent that dialled into nothing)."""
    import signal as signals

    import psutil

    steps = 4000  # (held from the kill until the new supervisor saw training go on; h3 cut off stalls it)
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=steps)
    # h3's roles outlast its cut (their heartbeats unheard meanwhile); the startup grace is far off
    spec.write_text(spec.read_text().replace("heartbeat_timeout: 10s, startup_grace: 60s",
                                             "heartbeat_timeout: 40s, startup_grace: 120s"))
    remote.psctl("up", str(spec), "--detach")
    before = wait_until(lambda: (s := remote.status())["roles"][0]["global_step"] >= 300 and s, timeout=120,
                        what="training to pass step 300")
    pids = {r["name"]: (r["host"], r["pid"]) for r in before["roles"]}
    metrics = Path(remote.env["PSCTL_HOME"]) / remote.name / "run" / "metrics.jsonl"

    def progress_since(when: float) -> list[dict[str, Any]]:
        return [r for r in map(json.loads, metrics.read_text().splitlines())
                if r.get("event") == "progress" and r["time"] > when]

    remote.hold.start()  # (until the new supervisor has watched training go on: a fast machine ended it first)
    psutil.Process(before["supervisor_pid"]).send_signal(signals.SIGKILL)
    wait_until(lambda: remote.status()["stale"], timeout=20, what="the supervisor to be gone")
    remote.bed.partition("h3")
    try:
        done = remote.psctl("supervise", remote.name, "--detach")
        assert "adopted" in done.stdout
        wait_until(lambda: "h3" in remote.status()["host_problems"], timeout=30,
                   what="the new supervisor to find h3 cut off", detail=remote.supervisor_log)
    finally:
        remote.bed.heal("h3")
    wait_until(lambda: "h3" not in remote.status()["host_problems"], timeout=30,
               what="h3's agent to dial in once h3 answers", detail=remote.supervisor_log)
    adopted_at = time.time()
    wait_until(lambda: progress_since(adopted_at + 1), timeout=60, what="training to go on under the new supervisor",
               detail=remote.supervisor_log)
    remote.hold.release()
    final = wait_until(lambda: (s := remote.status())["state"] in ("succeeded", "failed") and s, timeout=240,
                       what="training to finish under the new supervisor", detail=remote.supervisor_log)
    assert final["state"] == "succeeded", final["reason"]
    assert final["result"]["global_step"] == steps
    for role in final["roles"]:
        if role["name"] == "evaluator-0":
            continue  # it may have finished on its own
        assert (role["host"], role["pid"]) == pids[role["name"]], role
        assert (role["attempt"], role["restarts"]) == (1, 0), role
    # the new supervisor watched training go on (the chief's metrics it copied from h1 after adopting it)
    later = progress_since(adopted_at + 1)
    assert later and min(r["global_step"] for r in later) < steps, later[:3]


def test_an_agent_killed_then_its_successor_hung_on_a_host_are_replaced_and_the_roles_adopted(remote: Remote) -> None:
    """h2's agent is SIGKILLed mid-training: the supervisor starts another over SSH, which adopts the ps and the
    worker the first left running there (their heartbeats' port, their exit files). That one then hangs
    (SIGSTOP): at half the heartbeat timeout the supervisor kills it over SSH and starts a third, which adopts
    them again (a hung agent on a host used to be taken for a lost host: its roles restarted at the timeout).
    Nothing restarted, no ps restored from a checkpoint, exact step count."""
    steps = 4000  # (held while the agents are replaced)
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=steps)
    remote.psctl("up", str(spec), "--detach")
    before = wait_until(lambda: (s := remote.status())["roles"][0]["global_step"] >= 300 and s, timeout=120,
                        what="training to pass step 300")
    cluster_id = before["cluster_id"]
    pids = {r["name"]: (r["host"], r["pid"]) for r in before["roles"]}
    assert {name for name, (host, _) in pids.items() if host == "h2"} >= {"ps-0"}, pids

    def agents() -> list[str]:
        return [line.split()[0] for line in remote.processes("h2", cluster_id) if "psctl.agent" in line]

    def attached_since(when: float) -> bool:
        """h2's agent attached after ``when`` (a hung one's successor can dial in before its stream is seen
        closed: then it replaces it, reachable throughout)."""
        return any(e["role"] == "host h2" and e["to"] == "reachable" and e["time"] > when for e in remote.events())

    with remote.hold:  # (a fast machine ended training before the agents were replaced: none is, after it)
        for signal_name in ("KILL", "STOP"):
            old = agents()
            assert len(old) == 1, remote.processes("h2", cluster_id)
            signalled = time.time()
            remote.bed.exec("h2", f"kill -{signal_name} {old[0]}", check=True)
            wait_until(lambda old=old: bool(agents()) and old[0] not in agents(), timeout=60,
                       what=f"an agent on h2 in place of the {signal_name}ed one", detail=remote.supervisor_log)
            wait_until(lambda signalled=signalled: attached_since(signalled), timeout=30,
                       what="h2's new agent to attach", detail=remote.supervisor_log)
            assert "h2" not in remote.status()["host_problems"]
    final = wait_until(lambda: (s := remote.status())["state"] in ("succeeded", "failed") and s, timeout=240,
                       what="training to finish", detail=remote.supervisor_log)
    assert final["state"] == "succeeded", final["reason"]
    assert final["result"]["global_step"] == steps and final["result"]["ps_restores"] == 0, final["result"]
    for role in final["roles"]:
        if role["name"] == "evaluator-0":
            continue  # it may have finished on its own
        assert (role["host"], role["pid"]) == pids[role["name"]], role
        assert (role["attempt"], role["restarts"]) == (1, 0), role


def test_workers_and_ps_scaled_on_ssh_hosts_start_on_their_pools_and_training_ends_exactly(remote: Remote) -> None:
    """`psctl scale` over SSH: the new worker starts on the next host of its pool (h3, whose key the supervisor
    sends with its start), a third ps on h1; the chief reshards and takes the worker in; exact step count."""
    steps = 3000  # (held until both scales are seen through)
    roles = textwrap.dedent("""\
          chief: {host: h1, port: 7100}
          ps: {replicas: 2, max_replicas: 3, hosts: [h2, h3, h1], port: 7110}
          worker: {replicas: 2, max_replicas: 3, hosts: [h1, h2, h3], port: 7120}
        """)
    spec, _ = write_spec(remote.bed, remote.folder, remote.name, steps=steps, roles=roles)
    remote.psctl("up", str(spec), "--detach")
    wait_until(lambda: remote.status()["roles"][0]["global_step"] >= 300, timeout=120, what="training to pass 300")
    remote.hold.start()  # (until both scales are seen through: a fast machine ended training first)
    done = remote.psctl("scale", remote.name, "worker=3", "ps=3")
    assert "worker 2 -> 3" in done.stdout and "ps 2 -> 3" in done.stdout

    def running(name: str) -> dict[str, Any] | None:
        role = next((r for r in remote.status()["roles"] if r["name"] == name), None)
        return role if role is not None and role["state"] == "running" and role["local_step"] > 0 else None

    worker = wait_until(lambda: running("worker-2"), timeout=120, what="worker-2 training",
                        detail=remote.supervisor_log)
    assert worker["host"] == "h3" and worker["port"] == 7122
    wait_until(lambda: "resharded from 2 to 3 ps" in remote.psctl("logs", "chief-0", remote.name).stdout,
               timeout=120, what="the chief to reshard", detail=remote.supervisor_log)
    ps = next(r for r in remote.status()["roles"] if r["name"] == "ps-2")
    assert (ps["host"], ps["port"], ps["state"]) == ("h1", 7112, "running")
    remote.hold.release()
    final = wait_until(lambda: (s := remote.status())["state"] in ("succeeded", "failed") and s, timeout=240,
                       what="training to finish", detail=remote.supervisor_log)
    assert final["state"] == "succeeded", final["reason"]
    result = final["result"]
    assert result["global_step"] == steps and sum(p + 1 for p in result["shard_positions"]) == steps, result
    assert (result["ps"], result["workers"], result["retried_steps"]) == (3, 3, 0), result

"""Launch time over SSH: ``psctl up`` to the first training step, 3 hosts and 8 roles, against plain ``ssh``.

    sudo python -m benchmarks.launch_ssh [--runs 3]

Needs root: it brings up the SSH test bed of the tests (``tests/sshbed.py``: three real sshd hosts in network
namespaces on this machine). Per run, in the same bed:

- **psctl**: ``psctl up --detach`` of a spec with 1 chief, 2 ps, 4 workers and an evaluator over h1..h3
  (MLP on digits, heartbeats every 0.2 s), timed to when ``up`` returned (preflight, keys and files copied,
  supervisor started), to every role RUNNING, and to the first training step (the chief's heartbeat reports a
  global step > 0; resolution 0.2 s). Then ``psctl down``.
- **ssh loop (the ceiling)**: what a shell script does by hand: 8 sequential ``ssh host 'nohup CMD &'`` starts,
  one per role, each a fresh OpenSSH connection (``-o ControlMaster=no``), of a command that returns at once.
  It starts nothing that trains: it is the floor of the SSH cost of starting 8 processes one by one.

One JSON line per run, then one with the medians. The hosts share this machine's cores with the roles.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit, log, machine, median, rounded

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from sshbed import SSHBed  # noqa: E402  (the tests' bed: a benchmark that needs root may use it)

ROLES = """\
  chief: {host: h1, port: 7100}
  ps: {replicas: 2, hosts: [h2, h3], port: 7110}
  worker: {replicas: 4, hosts: [h1, h2, h3], port: 7120}
  evaluator: {host: h1, port: 7130}
"""


def write_spec(bed: SSHBed, folder: Path, name: str) -> Path:
    hosts = "\n".join(
        f"  - {{name: {h}, address: {bed.hosts[h].address}, user: root, identity_file: '{bed.client_key}', "
        f"python: '{sys.executable}', workdir: '{folder / 'hosts' / h}'}}"
        for h in sorted(bed.hosts)
    )
    spec = folder / "cluster.yaml"
    spec.write_text(
        f"name: {name}\nhosts:\n{hosts}\nroles:\n{ROLES}"
        "training: {program: psctl.models.mlp, args: {hidden_units: 32}, data: {name: digits}, batch_size: 50, "
        "steps: 100000}\n"
        "supervision: {heartbeat_interval: 0.2s, heartbeat_timeout: 10s}\n"
    )
    return spec


def time_psctl(bed: SSHBed, folder: Path, env: dict[str, str], run: int) -> dict[str, Any]:
    name = f"launch-{run}"
    spec = write_spec(bed, folder, name)
    state = Path(env["PSCTL_HOME"]) / name / "state.json"
    start = time.monotonic()
    try:
        subprocess.run(["psctl", "up", str(spec), "--detach"], env=env, check=True, capture_output=True, text=True,
                       timeout=120)
        returned = time.monotonic() - start
        all_running = first_step = None
        deadline = start + 120
        while first_step is None and time.monotonic() < deadline:
            record = json.loads(state.read_text())
            if record["state"] in ("failed", "stopped", "succeeded"):
                raise RuntimeError(f"cluster {name} ended: {record['reason']}")
            if all_running is None and record["roles"] and all(r["state"] == "running" for r in record["roles"]):
                all_running = time.monotonic() - start
            chief = next(r for r in record["roles"] if r["role"] == "chief")
            if chief["global_step"] > 0:
                first_step = time.monotonic() - start
            time.sleep(0.05)
        if first_step is None:
            raise RuntimeError("no training step within 120 s")
    finally:
        subprocess.run(["psctl", "down", name, "--purge"], env=env, capture_output=True, timeout=120)
    return {"up_returned_s": rounded(returned), "all_running_s": rounded(all_running or first_step),
            "first_step_s": rounded(first_step)}


def time_ssh_loop(bed: SSHBed, known_hosts: Path) -> float:
    placements = ["h1", "h2", "h3", "h1", "h2", "h3", "h1", "h1"]  # 8 roles as the spec deals them
    start = time.monotonic()
    for host in placements:
        subprocess.run(
            ["ssh", "-i", str(bed.client_key), "-o", f"UserKnownHostsFile={known_hosts}", "-o", "BatchMode=yes",
             "-o", "ControlMaster=no", f"root@{bed.hosts[host].address}", "nohup true > /dev/null 2>&1 &"],
            check=True, capture_output=True, timeout=30,
        )
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("launch_ssh needs root (it starts sshd test hosts in network namespaces)", file=sys.stderr)
        return 2
    results = []
    with SSHBed(3) as bed, tempfile.TemporaryDirectory(prefix="psctl-launch-") as tmp:
        folder = Path(tmp)
        home = folder / "home"
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        known = home / ".ssh" / "known_hosts"
        known.write_text(bed.known_hosts.read_text())
        env = dict(os.environ, HOME=str(home), PSCTL_HOME=str(folder / "psctl-home"))
        for run in range(args.runs):
            log(f"run {run + 1}/{args.runs}")
            record = {"run": run + 1, "hosts": 3, "roles": 8, **time_psctl(bed, folder, env, run)}
            record["ssh_loop_8_starts_s"] = rounded(time_ssh_loop(bed, known))
            emit(record)
            results.append(record)
    summary: dict[str, Any] = {"summary": "median", "runs": len(results), "machine": machine()}
    for key in ("up_returned_s", "all_running_s", "first_step_s", "ssh_loop_8_starts_s"):
        summary[key] = rounded(median([r[key] for r in results]))
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

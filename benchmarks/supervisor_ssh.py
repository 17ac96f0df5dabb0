"""The supervisor's cost over SSH: N real sshd hosts, one worker each, the roles mostly idle.

    sudo python -m benchmarks.supervisor_ssh --hosts 8,16,32 [--seconds 30] [--psctl-root DIR]

Needs root: it brings up the tests' SSH bed (``tests/sshbed.py``: real sshd hosts in network namespaces on this
machine). Per N: ``psctl up --detach`` of a cluster with the chief and a ps on h1 and one worker on every host,
training softmax regression on digits with every step slowed to 0.5 s (``--step-sleep``: the roles are mostly
idle, so the machine's cores are the supervisor's and the hosts' sshd's). Timed: ``up`` returning and every
role RUNNING. Then, over ``--seconds``: the supervisor's CPU (psutil: user + system) and the hosts' sshd CPU
(every sshd process of the bed, children's time included: the commands an SSH exec runs count). Then ``psctl
down``.

``--psctl-root DIR`` runs the launcher from another psctl tree (a ``git worktree`` of an older commit, say),
so that an old and a new supervisor are measured on the same bed in one session. One JSON line per N.
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

import psutil

from benchmarks.common import emit, log, machine, rounded

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from sshbed import SSHBed  # noqa: E402  (the tests' bed: a benchmark that needs root may use it)

PROGRAM = '''\
"""Softmax regression whose every step takes at least STEP_SLEEP seconds: roles that are mostly idle."""
import os
import time

from psctl.models import softmax

STEP_SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0.5"))


class Slow(softmax.SoftmaxRegression):
    def loss_and_grads(self, params, batch):
        time.sleep(STEP_SLEEP)
        return super().loss_and_grads(params, batch)


def build(args, data, seed):
    inner = softmax.build(args, data, seed)
    return Slow(inner.num_features, inner.num_classes, inner.data, inner.seed)
'''


def write_spec(bed: SSHBed, folder: Path, name: str, n: int, step_sleep: float) -> Path:
    hosts = "\n".join(
        f"  - {{name: h{i}, address: {bed.hosts[f'h{i}'].address}, user: root, identity_file: '{bed.client_key}', "
        f"python: '{sys.executable}', workdir: '{folder / 'hosts' / f'h{i}'}'}}"
        for i in range(1, n + 1)
    )
    pool = ", ".join(f"h{i}" for i in range(1, n + 1))
    (folder / "slow_program.py").write_text(PROGRAM)
    spec = folder / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\nhosts:\n{hosts}\nroles:\n"
        "  chief: {host: h1, port: 7100}\n  ps: {host: h1, port: 7110}\n"
        f"  worker: {{replicas: {n}, hosts: [{pool}], port: 7120, env: {{BENCH_STEP_SLEEP: '{step_sleep}'}}}}\n"
        "training: {program: slow_program.py, data: {name: digits}, batch_size: 10, steps: 100000000}\n"
        "supervision: {heartbeat_interval: 1s, heartbeat_timeout: 10s, stall_timeout: 1h}\n"
    )
    return spec


def sshd_cpu() -> float:
    """CPU seconds of every sshd process of the bed (and of the commands they ran and reaped)."""
    total = 0.0
    for proc in psutil.process_iter(["name"]):
        if not (proc.info["name"] or "").startswith("sshd"):
            continue
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


def measure(bed: SSHBed, folder: Path, env: dict[str, str], n: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"scale{n}"
    spec = write_spec(bed, folder, name, n, args.step_sleep)
    state = Path(env["PSCTL_HOME"]) / name / "state.json"
    psctl = [sys.executable, "-m", "psctl"]
    start = time.monotonic()
    try:
        # (run from the tree's own folder: ``python -m`` puts the working folder first on the path)
        done = subprocess.run([*psctl, "up", str(spec), "--detach"], env=env, capture_output=True, text=True,
                              timeout=600, cwd=args.psctl_root or REPO)
        if done.returncode != 0:
            raise RuntimeError(f"psctl up failed: {done.stderr.strip()[-500:]}")
        returned = time.monotonic() - start
        while True:
            record = json.loads(state.read_text())
            if record["state"] in ("failed", "stopped", "succeeded"):
                raise RuntimeError(f"cluster {name} ended: {record['reason']}")
            if record["roles"] and all(r["state"] == "running" for r in record["roles"]):
                break
            if time.monotonic() - start > 600:
                raise RuntimeError("not every role ran within 600 s")
            time.sleep(0.1)
        running = time.monotonic() - start
        time.sleep(args.warmup)
        supervisor = psutil.Process(record["supervisor_pid"])
        # which psctl the launcher ran (recorded with the figures)
        imported = subprocess.run([sys.executable, "-c", "import psctl; print(psctl.__file__)"], env=env,
                                  cwd=args.psctl_root or REPO, capture_output=True, text=True).stdout.strip()
        sup0, sshd0, t0, wall0 = cpu(supervisor), sshd_cpu(), time.monotonic(), time.time()
        time.sleep(args.seconds)
        sup1, sshd1, t1, wall1 = cpu(supervisor), sshd_cpu(), time.monotonic(), time.time()
        threads = supervisor.num_threads()
        events = [json.loads(line) for line in (state.parent / "events.jsonl").read_text().splitlines()]
        quiet = not [e for e in events if wall0 <= e["time"] <= wall1]  # no role or host changed meanwhile
    finally:
        subprocess.run([*psctl, "down", name, "--purge"], env=env, capture_output=True, timeout=300,
                       cwd=args.psctl_root or REPO)
    window = t1 - t0
    return {
        "benchmark": "supervisor_ssh", "ok": True, "hosts": n, "roles": n + 2,
        "launcher": imported,
        "up_returned_s": rounded(returned, 2), "all_running_s": rounded(running, 2),
        "supervisor_cpu_cores": rounded((sup1 - sup0) / window, 4),
        "sshd_cpu_cores": rounded((sshd1 - sshd0) / window, 4),
        "supervisor_threads": threads, "window_s": rounded(window, 1), "no_events_in_window": quiet,
        "machine": machine(),
    }


def cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="8,16,32", help="comma-separated host counts")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--step-sleep", type=float, default=0.5)
    parser.add_argument("--psctl-root", help="run the launcher from this psctl tree instead")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("supervisor_ssh needs root (it starts sshd test hosts in network namespaces)", file=sys.stderr)
        return 2
    counts = [int(x) for x in args.hosts.split(",")]
    with SSHBed(max(counts)) as bed, tempfile.TemporaryDirectory(prefix="psctl-supssh-") as tmp:
        folder = Path(tmp)
        home = folder / "home"
        (home / ".ssh").mkdir(parents=True, mode=0o700)
        (home / ".ssh" / "known_hosts").write_text(bed.known_hosts.read_text())
        env = dict(os.environ, HOME=str(home), PSCTL_HOME=str(folder / "psctl-home"))
        if args.psctl_root:
            env["PYTHONPATH"] = args.psctl_root
        for n in counts:
            log(f"{n} hosts")
            try:
                emit(measure(bed, folder, env, n, args))
            except Exception as exc:  # one size failing does not hide the others
                emit({"benchmark": "supervisor_ssh", "ok": False, "hosts": n, "error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

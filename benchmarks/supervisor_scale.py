"""How the supervisor scales with hosts: N agents on this machine, one supervisor, measured for a while.

    python -m benchmarks.supervisor_scale --hosts 100 [--roles-per-host 1] [--seconds 60]

Each agent plays one host (``h0``..``hN-1``, on loopback, no SSH) with R workers that heartbeat at 1 Hz (h0
also has the chief and a ps). The agents are psctl's own (:class:`psctl.agent.core.Agent`, each with its own
mTLS stream to the supervisor), many per process (``--agents-per-process``) so that a 2-core machine holds
1,000 of them; their roles are in-process fakes, except host h0's: real processes that heartbeat through h0's
agent as roles do. worker-0 (on h0) is SIGKILLed at the end to time detection. The supervisor is the real
daemon (``psctl.supervisor.daemon``) in a process of its own, over a cluster of N*R workers on the N hosts;
its CPU time, RSS and threads are read with psutil over the measured window (after every role runs).

Prints one JSON line: hosts, roles, supervisor_cpu_cores (cores over the window), supervisor_rss_mb,
supervisor_threads, detect_s (SIGKILL of a role to the supervisor's "lost" event), with the agents' own CPU
beside it (the rest of the machine's load) and the machine (cores, load average) it ran on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import REPO_ROOT, emit_all, install_signal_handlers, log, machine, rounded

BENCHMARK = "supervisor_scale"
BASE_PORT = 20000


# -- the parts that run in processes of their own ----------------------------------------------------------------
def serve_agents(config: dict[str, Any]) -> None:
    """Run the agents of hosts ``first``..``last-1`` in this process until SIGTERM."""
    from psctl.agent.core import Agent
    from psctl.proto import psctl_pb2 as pb
    from psctl.runtime.cluster import TlsFiles

    class FakeRole:
        """A role as the agent sees it: running until signalled."""

        def __init__(self, pid: int) -> None:
            self.pid = pid
            self.code: int | None = None

        def poll(self) -> int | None:
            return self.code

        def send_signal(self, sig: int) -> None:
            self.code = -sig

    pids = itertools.count(10_000_000)  # never a real pid: fakes are signalled through send_signal only

    def fake(command: pb.StartRole, log_fd: int) -> FakeRole:
        return FakeRole(next(pids))

    def real(command: pb.StartRole, log_fd: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, **command.env}
        return subprocess.Popen([sys.executable, "-m", "benchmarks.supervisor_scale", "--fake-role"], env=env,
                                cwd=REPO_ROOT, stdout=log_fd, stderr=subprocess.STDOUT, start_new_session=True)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agents = []
    for i in range(config["first"], config["last"]):
        tls = TlsFiles(**config["tls"][str(i)])
        agent = Agent(f"h{i}", config["supervisor"], cluster_id=config["cluster_id"], tls=tls,
                      interval=config["interval"], spawn=real if i == 0 else fake, serve_heartbeats=i == 0)
        agent.start()
        agents.append(agent)
    print("ready", flush=True)
    step = 0
    while not stop.wait(config["interval"]):  # the fake roles' heartbeats, straight into their agents
        step += 1
        for agent in agents:
            for role in list(agent.roles.values()):
                if role.running and not isinstance(role.process, subprocess.Popen):
                    job, _, index = role.name.rpartition("-")
                    agent.on_heartbeat(pb.HeartbeatRequest(task=f"{job}:{index}", incarnation=role.incarnation,
                                                           local_step=step))
    for agent in agents:
        agent.stop()


def fake_role() -> None:
    """A real role process that only heartbeats (to its host's agent, with the environment a role gets)."""
    from psctl.runtime.cluster import from_env
    from psctl.runtime.heartbeat import Heartbeater

    beat = Heartbeater(from_env())
    beat.start()
    threading.Event().wait()


def supervise(folder: str) -> None:
    """The supervisor daemon over the benchmark's hosts (agents already running: it adopts them)."""
    from psctl.home import ClusterDir
    from psctl.launch.hostset import Placement
    from psctl.launch.local import LocalRunner
    from psctl.signals import on_signals
    from psctl.spec import load_spec
    from psctl.supervisor.daemon import Supervisor
    from psctl.supervisor.state import load_state

    class HostRunner(LocalRunner):
        """A host of the benchmark: its agent runs here, started by the benchmark, never by the supervisor."""

        def __init__(self, host: str) -> None:
            super().__init__()
            self.host = host

        def start(self, **_: Any) -> Any:
            from psctl.errors import LaunchError

            raise LaunchError(f"host {self.host}: the benchmark starts the agents")

    cdir = ClusterDir(Path(folder))
    record = load_state(cdir.state_file)
    spec = load_spec(record.spec_path)
    places = {h.name: Placement(h.name, HostRunner(h.name), sys.executable, cdir, str(REPO_ROOT), {}, 1,
                                remote=False, address=h.address) for h in spec.hosts}
    supervisor = Supervisor(cdir, spec, record, places)
    on_signals((signal.SIGTERM,), lambda _signum: supervisor.request_stop())  # (sets events: not in a handler)
    supervisor.run()


# -- the benchmark ---------------------------------------------------------------------------------------------
def spec_text(hosts: int, roles_per_host: int, interval: float, timeout: float) -> str:
    lines = ["name: scale", "hosts:"]
    lines += [f"  - {{name: h{i}, address: 127.0.0.1}}" for i in range(hosts)]
    pool = ", ".join(f"h{i}" for i in range(hosts))
    lines += [
        "roles:",
        "  chief: {host: h0, port: 19998}",
        "  ps: {host: h0, port: 19999}",
        f"  worker: {{replicas: {hosts * roles_per_host}, hosts: [{pool}], port: {BASE_PORT}}}",
        "training: {program: psctl.models.mlp, data: {name: digits}, steps: 1000000000}",
        f"supervision: {{heartbeat_interval: {interval}s, heartbeat_timeout: {timeout}s, stall_timeout: 1000000s}}",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from psctl.home import ClusterDir
    from psctl.pki import create_cluster_pki, member_files
    from psctl.spec import load_spec, make_plan
    from psctl.supervisor.agents import agent_member
    from psctl.supervisor.state import ClusterRecord, RoleRecord, save_state

    n, r = args.hosts, args.roles_per_host
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="psctl-scale-") as tmp:
        try:
            folder = Path(tmp)
            spec_path = folder / "scale.yaml"
            spec_path.write_text(spec_text(n, r, args.interval, args.timeout))
            spec = load_spec(spec_path)
            plan = make_plan(spec, check_ports=False)
            cdir = ClusterDir(folder / "home" / "scale")
            cdir.create()
            log(f"{n} hosts: creating the cluster's certificates")
            create_cluster_pki(cdir.tls_dir, "scale-bench", [("supervisor", "127.0.0.1")] + [
                (agent_member(f"h{i}"), "127.0.0.1") for i in range(n)] + [
                (i.name, "127.0.0.1") for i in plan.instances if i.host == "h0"])
            with socketless_port() as port:
                supervisor_address = f"127.0.0.1:{port}"
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PSCTL_CLUSTER_ID": "scale-bench"}
            agents: dict[str, dict[str, Any]] = {}
            per = args.agents_per_process
            for first in range(0, n, per):
                last = min(n, first + per)
                config = {"first": first, "last": last, "supervisor": supervisor_address,
                          "cluster_id": "scale-bench", "interval": args.interval,
                          "tls": {str(i): member_files(cdir.tls_dir, agent_member(f"h{i}")).__dict__
                                  for i in range(first, last)}}
                proc = subprocess.Popen([sys.executable, "-m", "benchmarks.supervisor_scale", "--agents",
                                         json.dumps(config)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                        start_new_session=True)
                processes.append(proc)
                created = psutil.Process(proc.pid).create_time()
                for i in range(first, last):
                    agents[f"h{i}"] = {"pid": proc.pid, "create_time": created}
            for proc in processes:
                assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", "agents failed"
            record = ClusterRecord(
                name="scale", cluster_id="scale-bench", spec_path=str(spec_path), tls=True,
                supervisor_address=supervisor_address, agents=agents,
                roles=[RoleRecord(i.name, i.role, i.index, i.host, i.address, i.port) for i in plan.instances])
            save_state(cdir.state_file, record)
            log(f"{n} agents in {len(processes)} processes; starting the supervisor")
            with open(folder / "supervisor.log", "wb") as supervisor_log:
                supervisor = subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.supervisor_scale", "--supervisor", str(cdir.root)],
                    cwd=REPO_ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=supervisor_log)
            processes.append(supervisor)
            started = time.monotonic()
            while not all_running(cdir):
                if time.monotonic() - started > args.start_timeout:
                    raise TimeoutError(f"not every role ran within {args.start_timeout:.0f}s: see the supervisor log")
                if supervisor.poll() is not None:
                    raise RuntimeError((folder / "supervisor.log").read_text()[-2000:])
                time.sleep(0.5)
            up_s = time.monotonic() - started
            log(f"every role runs after {up_s:.1f}s; measuring for {args.seconds:.0f}s")
            time.sleep(args.warmup)
            sup = psutil.Process(supervisor.pid)
            hosts_procs = [psutil.Process(p.pid) for p in processes[:-1]]
            cpu0, agents0, t0 = cpu(sup), sum(cpu(p) for p in hosts_procs), time.monotonic()
            events0 = count_lines(cdir.events_file)
            time.sleep(args.seconds)
            cpu1, agents1, t1 = cpu(sup), sum(cpu(p) for p in hosts_procs), time.monotonic()
            rss, threads = sup.memory_info().rss, sup.num_threads()
            quiet = count_lines(cdir.events_file) == events0
            victim = next(r for r in json.loads(cdir.state_file.read_text())["roles"] if r["name"] == "worker-0")
            killed_at = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            detect = wait_lost(cdir, victim["name"], killed_at, timeout=args.timeout + 30)
            yield {
                "benchmark": BENCHMARK, "ok": True, "hosts": n, "roles": len(plan.instances),
                "supervisor_cpu_cores": rounded((cpu1 - cpu0) / (t1 - t0), 4),
                "supervisor_rss_mb": rounded(rss / 1e6, 1), "supervisor_threads": threads,
                "detect_s": rounded(detect, 3), "heartbeat_timeout_s": args.timeout,
                "agents_cpu_cores": rounded((agents1 - agents0) / (t1 - t0), 3),
                "agent_processes": len(processes) - 1, "up_s": rounded(up_s, 2), "window_s": rounded(t1 - t0, 1),
                "no_events_in_window": quiet, "machine": machine(),
            }
        finally:
            for proc in reversed(processes):
                with_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for proc in processes:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with_group(proc, signal.SIGKILL)
                    proc.wait()
            for proc in psutil.process_iter(["pid"]):  # the fake role, should its agent have left it behind
                try:
                    if proc.environ().get("PSCTL_CLUSTER_ID") == "scale-bench" and proc.pid != os.getpid():
                        proc.kill()
                except psutil.Error:
                    continue


class socketless_port:
    """A free loopback port (bound, then released for the supervisor to take)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def with_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def count_lines(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except FileNotFoundError:
        return 0


def all_running(cdir: Any) -> bool:
    try:
        roles = json.loads(cdir.state_file.read_text())["roles"]
    except (OSError, ValueError):
        return False
    return all(r["state"] == "running" for r in roles)


def wait_lost(cdir: Any, name: str, since: float, *, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in cdir.events_file.read_text().splitlines():
            event = json.loads(line)
            if event["role"] == name and event["to"] == "lost" and event["time"] >= since:
                return float(event["time"]) - since
        time.sleep(0.01)
    raise TimeoutError(f"{name} was not declared lost within {timeout:.0f}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--roles-per-host", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat (and report) interval")
    parser.add_argument("--timeout", type=float, default=5.0, help="heartbeat timeout")
    parser.add_argument("--agents-per-process", type=int, default=100)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--agents", help=argparse.SUPPRESS)
    parser.add_argument("--supervisor", help=argparse.SUPPRESS)
    parser.add_argument("--fake-role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agents:
        serve_agents(json.loads(args.agents))
        return 0
    if args.supervisor:
        supervise(args.supervisor)
        return 0
    if args.fake_role:
        fake_role()
        return 0
    install_signal_handlers()
    return emit_all(BENCHMARK, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())

"""The supervisor's I/O shell: observe → decide → act → persist.

Every host runs one agent (:mod:`psctl.agent`), started here through the host's runner (this machine's, or
SSH); the agents start and watch the roles and report over one stream each (:mod:`psctl.supervisor.agents`).
This loop drains their reports, asks the pure policy (:func:`psctl.supervisor.policy.decide`) what to do,
carries that out (commands to the agents; starting agents in a small pool of threads, never under the loop),
and rewrites the state file atomically, so ``psctl status`` works from the file alone, even after this process
is gone. A restarted supervisor listens where the last one did; the agents dial in again and their roles are
adopted as they run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from psctl.agent.orphans import HOST_VARIABLE
from psctl.errors import LaunchError, PsctlError
from psctl.home import ClusterDir
from psctl.launch import slurm
from psctl.launch.base import ProcessHandle, Runner
from psctl.launch.cpus import host_slots
from psctl.launch.env import default_threads, tuning_env
from psctl.launch.hostset import Placement, placements
from psctl.launch.remote import remote_training
from psctl.pki import member_files
from psctl.proto import psctl_pb2 as pb
from psctl.runtime.cluster import tf_config
from psctl.spec import ClusterSpec
from psctl.spec.plan import LOCAL_HOST, free_ports, slot
from psctl.supervisor import policy, tensorflow
from psctl.supervisor.agents import AgentHub, agent_member
from psctl.supervisor.policy import HostLive, Observation, PolicyState, chief_ps_layout
from psctl.supervisor.state import ClusterRecord, ClusterState, RoleRecord, save_state

log = logging.getLogger("psctl.supervisor")

#: How often a remote chief's new metrics lines are copied here.
MIRROR_INTERVAL = 2.0
#: Threads that start agents (SSH round trips) at once: ``up`` of many hosts is bounded by this, not serial.
AGENT_STARTERS = 16
#: A change an agent reports (a role started, exited or was signalled; an agent came or went) wakes the loop
#: before its next poll, so that a start, an exit or a finish is acted on at once. An early pass comes at least
#: MIN_PASS_GAP, and EARLY_PASS_WORK times the last pass's own work, after the last one began: under a burst of
#: changes (a thousand agents attaching, a pass over their roles taking tens of milliseconds) early passes take
#: at most a sixth of the loop's time, and of the GIL it shares with the thread that reads the agents' streams.
MIN_PASS_GAP = 0.02
EARLY_PASS_WORK = 5.0
#: A pass this long after the last one (they are a poll interval apart, 0.1 s, plus the pass's own work) means
#: this process did not run meanwhile (SIGSTOP, a paused VM, swap, a starved CPU): see policy.SupervisorStalled.
SUPERVISOR_STALL = 3.0


class Supervisor:
    def __init__(
        self,
        cdir: ClusterDir,
        spec: ClusterSpec,
        record: ClusterRecord,
        runner: Runner | Mapping[str, Placement],
        *,
        get_time: Callable[[], float] = time.monotonic,
        poll_interval: float = 0.1,
        python: str = sys.executable,
    ) -> None:
        """``runner``: the runner of this machine (every role local), or the placement of every host."""
        self.cdir = cdir
        self.spec = spec
        self.record = record
        if isinstance(runner, Runner):
            cwd = str(spec.path.parent if spec.path else cdir.root)
            runner = placements(cdir, {}, {LOCAL_HOST: runner}, cwd=cwd, python=python)
        # an agent on every host a role may run on (its pool's spares too: their reachability decides moves)
        used = {r.host for r in record.roles} | {h for r in spec.roles.values() for h in r.hosts}
        self.places: dict[str, Placement] = {name: p for name, p in runner.items() if name in used}
        self.time = get_time
        self.poll_interval = poll_interval
        self.inbox: queue.SimpleQueue[Observation] = queue.SimpleQueue()
        self._wake = threading.Event()  # a change arrived, or a stop was requested: pass now (see drain)
        self._last_pass = float("-inf")  # (time.monotonic: the gap between passes is real time)
        self.hub = AgentHub(self.inbox, get_time=get_time, on_change=self._wake.set,
                            tls=member_files(cdir.tls_dir, "supervisor") if record.tls else None)
        hosts = {name: HostLive(remote=p.remote, address=p.address) for name, p in self.places.items()}
        self.state = PolicyState(record, spec, hosts, wall_offset=time.time() - get_time())
        self.stop_requested = threading.Event()
        #: Why and with what grace the cluster stops when ``stop_requested`` is set (``psctl down`` leaves its
        #: grace in stop-request.json).
        self.stop_reason = "stopped by psctl down"
        self.default_grace = 5.0
        #: How long the finish waits for the roles to be reported gone (None: their stop's grace and 5 s). A
        #: Slurm job being stopped SIGKILLs everything after its KillWait: the outcome is recorded first.
        self.finish_wait: float | None = None
        self._starters = ThreadPoolExecutor(AGENT_STARTERS, thread_name_prefix="psctl-agent-start")
        self._starting: set[str] = set()  # hosts whose agent a starter thread is starting now
        #: Per host, the roles its agent's last report shows running (the finish waits for them to exit).
        self._running: dict[str, set[str]] = {}
        self._mirror_offsets: dict[str, int] = {}
        self._mirrored_at = float("-inf")
        self._last_save = float("-inf")
        #: Why each of the cluster's files could not be written last time (said once, until it can be again).
        self._unwritable: dict[Path, str] = {}
        #: Orders starter threads' changes to ``record.agents`` with saving the record.
        self._lock = threading.Lock()
        #: One copy of the chief's metrics at a time (in the background, and once more at the finish).
        self._mirror_lock = threading.Lock()

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> ClusterState:
        adopting = bool(self.record.agents)
        try:
            self.listen()
        except (PsctlError, OSError) as exc:
            message = exc.format_message() if isinstance(exc, PsctlError) else str(exc)
            self.act(policy.conclude(self.state, ClusterState.FAILED, f"supervisor cannot listen: {message}"))
            self.save(force=True)
            return self.record.state
        if adopting:  # the first pass asks for every host's agent: those that still run are waited for
            self.state.adopt(self.time())
        waited = False  # the first pass runs at once: it starts the agents, the start of every role
        try:
            while not self.record.state.terminal:
                observations = self.drain(wait=waited)
                waited = True
                if self.stop_requested.is_set() and not self.state.finishing:
                    observations.append(policy.StopRequested(self.stop_grace(), self.stop_reason))
                self.act(policy.decide(self.state, observations, self.time()))
                self.save()
                if self.time() - self._mirrored_at > MIRROR_INTERVAL and self._mirror_lock.acquire(blocking=False):
                    self._mirrored_at = self.time()  # in a starter thread: a cut-off chief's host times out there
                    self._starters.submit(self._mirror_in_background)
        finally:
            self.hub.stop()
            self._starters.shutdown(wait=False, cancel_futures=True)
            self.save(force=True)
            for place in self.places.values():
                place.runner.close()
        return self.record.state

    def listen(self) -> None:
        """The agents' endpoint on loopback (where the last supervisor of the cluster listened, so that its
        agents find this one); every host reaches it through its runner's forward (over SSH a reverse forward,
        so agents dial in also where hosts cannot open connections back to this machine)."""
        old = self.record.supervisor_address
        port = int(old.rpartition(":")[2]) if old and self.record.agents else 0
        try:
            port = self.hub.start(f"127.0.0.1:{port}")
        except OSError:
            port = self.hub.start("127.0.0.1:0")  # taken: agents here will not find this one; theirs restart
        self.record.supervisor_address = f"127.0.0.1:{port}"

        def forward(name: str) -> None:
            with contextlib.suppress(PsctlError):  # unreachable now: forwarded when its agent is found or started
                self._forward(name)

        # at once: a host that does not answer (its connect times out) does not hold up the others
        list(self._starters.map(forward, self.places))

    def _forward(self, host: str) -> int:
        """The port on ``host`` that reaches the agents' endpoint (the one the host had before, if it can)."""
        runner = self.places[host].runner
        port = runner.remote_port(self.hub.port)
        if port is None:
            wanted = int(self.record.agents.get(host, {}).get("forward_port", 0))
            try:
                port = runner.forward_remote_port(self.hub.port, wanted)
            except LaunchError:  # still held by the last supervisor's session: its agent is replaced
                if not wanted:
                    raise
                port = runner.forward_remote_port(self.hub.port, 0)
        with self._lock:
            self.record.agents.setdefault(host, {})["forward_port"] = port
        return port

    def request_stop(self) -> None:
        """Stop the cluster (``psctl down``, a signal): the next pass begins the finish, at once."""
        self.stop_requested.set()
        self._wake.set()

    def drain(self, *, wait: bool = True) -> list[Observation]:
        """What arrived by the next pass (what has arrived, without ``wait``): the policy then decides once on the
        batch (with a thousand agents reporting every second, a pass per report would look at every role a
        thousand times a second). The next pass is one ``poll_interval`` after this one, or sooner once a change
        or a stop request arrives (see MIN_PASS_GAP)."""
        if wait:
            start = time.monotonic()
            work = start - self._last_pass  # the last pass's own (drain is called as soon as it is done)
            if self._wake.wait(self.poll_interval):
                not_before = min(self._last_pass + max(MIN_PASS_GAP, EARLY_PASS_WORK * work),
                                 start + self.poll_interval)  # never later than the pass it replaces
                pause = not_before - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        self._wake.clear()  # (before taking the inbox: a change that lands after it wakes the next pass)
        previous, self._last_pass = self._last_pass, time.monotonic()
        out: list[Observation] = []
        if previous != float("-inf") and self._last_pass - previous > SUPERVISOR_STALL:
            stalled = self._last_pass - previous
            log.warning("no pass of this supervisor for %.1fs (it was stopped, paused, starved of CPU or blocked): "
                        "silence is counted from now", stalled)
            out.append(policy.SupervisorStalled(stalled))
        with contextlib.suppress(queue.Empty):
            while True:
                out.append(self.inbox.get_nowait())
        out.extend(self.scale_requests())
        for obs in out:
            if isinstance(obs, policy.Report):
                self._running[obs.host] = {r.name for r in obs.report.roles if not r.exited}
            elif isinstance(obs, policy.Detached):
                self._running.pop(obs.host, None)
        return out

    def scale_requests(self) -> list[Observation]:
        """``psctl scale``'s request, if one was left (it checked the bounds), with a slot for every replica it
        may add: the spec's host and port for it, a free port where it runs on this machine."""
        path = self.cdir.scale_request
        try:
            request = json.loads(path.read_text(encoding="utf-8"))
            path.unlink()
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("ignoring an unreadable scale request: %s", exc)
            path.unlink(missing_ok=True)
            return []
        out: list[Observation] = []
        hosts = {h.name: h for h in self.spec.hosts}
        for role, replicas in dict(request.get("replicas", {})).items():
            spec = self.spec.roles.get(role)
            if spec is None or not isinstance(replicas, int):
                continue
            indexes = range(len(policy.members(self.record, role)), min(replicas, spec.slots))
            placed = [slot(role, spec, i, hosts) for i in indexes]
            taken = {r.port for r in self.record.roles}
            free = iter(free_ports(sum(p.port is None for p in placed), avoid=taken))
            nodes = self.record.slurm.get("nodes")
            slots = []
            for p in placed:
                port = p.port or next(free)
                if nodes:  # backend slurm: a node of the job, which is its address too
                    node = slurm.node_for(role, p.index, nodes)
                    slots.append(policy.Slot(p.index, p.host, node, port, node=node))
                else:
                    slots.append(policy.Slot(p.index, p.host, p.address, port))
            out.append(policy.ScaleRequested(role, replicas, tuple(slots)))
        return out

    # -- actions --------------------------------------------------------------------------------------
    def act(self, actions: list[policy.Action]) -> None:
        events = [a for a in actions if isinstance(a, policy.WriteEvent)]
        if events:
            self.write_events(events)
        for action in actions:
            if isinstance(action, policy.StartAgent):
                if action.host not in self._starting:
                    self._starting.add(action.host)
                    self._starters.submit(self._start_agent, action.host, action.replace)
            elif isinstance(action, policy.StartRole):
                self.start_role(self.record.role(action.name), action)
            elif isinstance(action, policy.StopRole):
                self.command(action.host, pb.AgentCommand(stop=pb.StopRole(
                    name=action.name, incarnation=action.incarnation, grace_seconds=action.grace)))
            elif isinstance(action, policy.SendView):
                chief = self.state.chief
                views = {with_chief: pb.AgentCommand(view=policy.cluster_view(self.state, for_chief=with_chief))
                         for with_chief in (True, False)}
                for host in [action.host] if action.host else list(self.places):
                    self.command(host, views[chief is not None and chief.host == host])
            elif isinstance(action, policy.RebindCpus):
                self.rebind_cpus(action.host)
            elif isinstance(action, policy.Finish):
                self.finish(action)

    def command(self, host: str, command: pb.AgentCommand) -> bool:
        h = self.state.hosts[host]
        return h.attached and self.hub.send(host, h.agent_pid, command)

    def write_events(self, events: list[policy.WriteEvent]) -> None:
        """Lines of events.jsonl: ``subject`` (a role, "cluster" or "host NAME") went from ``was`` to ``to``."""
        now = time.time()
        for e in events:
            log.info("%s: %s -> %s%s", e.subject, e.was, e.to, f" ({e.reason})" if e.reason else "")
        lines = "".join(json.dumps({"time": now, "role": e.subject, "from": e.was, "to": e.to, "reason": e.reason,
                                    **({} if e.attempt is None else {"attempt": e.attempt})}) + "\n" for e in events)
        try:
            with open(self.cdir.events_file, "a", encoding="utf-8") as f:
                f.write(lines)
        except OSError as exc:  # (the supervisor's own log has them)
            self._unwritten(self.cdir.events_file, exc)
        else:
            self._written(self.cdir.events_file)
        self._last_save = float("-inf")  # a change: persist it now

    # -- agents ---------------------------------------------------------------------------------------
    def agent_env(self, host: str, place: Placement, supervisor_port: int) -> dict[str, str]:
        tls = asdict(member_files(place.dirs.tls_dir, agent_member(host))) if self.record.tls else None
        config = {"host": host, "supervisor": f"127.0.0.1:{supervisor_port}", "tls": tls,
                  "interval": self.spec.supervision.heartbeat_interval,
                  "grace": self.spec.supervision.preemption_grace,
                  "logs": str(place.dirs.logs)}  # where roles that ended while no agent watched them left records
        if len(set(self.record.slurm.get("nodes", ()))) > 1:  # roles on other nodes heartbeat to this one
            config["heartbeat_host"] = socket.gethostname()
        return {**place.base_env, "PSCTL_AGENT": json.dumps(config), "PSCTL_CLUSTER_ID": self.record.cluster_id,
                "PYTHONUNBUFFERED": "1"}

    def _start_agent(self, host: str, replace: bool) -> None:
        """Start ``host``'s agent, unless the one it has runs (it is cut off, or dialling in); ``replace``: stop
        that one first (it never dialled in)."""
        place = self.places[host]
        known = self.record.agents.get(host, {})
        try:
            if known.get("pid"):  # (a restarted supervisor's first look finds the agents it adopts this way)
                handle = ProcessHandle(host, int(known["pid"]), known.get("create_time"))
                if replace:
                    log.warning("host %s: agent pid %d never dialled in, or went silent; starting another", host,
                                handle.pid)
                    place.runner.signal_group(handle, signal.SIGKILL)
                elif place.runner.poll(handle) is None:
                    # it dials the port this host had: forward it (again) where that failed at listen (the host
                    # did not answer then), or the agent dials into nothing until the startup grace replaces it
                    self._forward(host)
                    self.inbox.put(policy.AgentAlive(host))
                    return
            port = self._forward(host)
            handle = place.runner.start(argv=[place.python, "-m", "psctl.agent"], cwd=place.cwd,
                                        env=self.agent_env(host, place, port),
                                        log_path=place.dirs.logs / f"agent-{host}.log")
            with self._lock:
                self.record.agents.setdefault(host, {}).update(pid=handle.pid, create_time=handle.create_time)
            self._last_save = float("-inf")
        except PsctlError as exc:
            self.inbox.put(policy.AgentStartFailed(host, exc.format_message()))
        finally:
            self._starting.discard(host)

    # -- roles ----------------------------------------------------------------------------------------
    def start_role(self, role: RoleRecord, action: policy.StartRole) -> None:
        place = self.places[role.host]
        files = {}
        if place.remote and self.record.tls:  # the role's key goes where it runs, when it runs there
            for suffix in (".pem", ".key"):
                files[str(place.dirs.tls_dir / f"{role.name}{suffix}")] = (
                    self.cdir.tls_dir / f"{role.name}{suffix}").read_bytes()
        env, argv = self.role_env(role), [place.python, "-m", "psctl.runtime"]
        watched_only = self.spec.training.get("framework") == "tensorflow"
        if watched_only:  # the user's TensorFlow program, or psctl's TensorFlow server
            argv, env["TF_CONFIG"] = tensorflow.start(self.spec, self.record.roles, role, place)
        if self.record.backend == "slurm":  # a job step on the role's node: its exit is the srun's
            argv = slurm.step_argv(str(self.record.slurm["job_id"]), role.node, role.name, argv)
        slot, slots = self.cpu_slot(role)
        start = pb.StartRole(name=role.name, incarnation=action.incarnation, attempt=action.attempt, argv=argv,
                             env=env, cwd=place.cwd, log_path=str(place.dirs.role_log(role.name, action.attempt)),
                             files=files, watched_only=watched_only, cpu_slot=slot, cpu_slots=slots)
        if not self.command(role.host, pb.AgentCommand(start=start)):
            log.warning("%s: %s has no agent attached; its start-up grace decides", role.name, role.host)

    def cpu_slot(self, role: RoleRecord) -> tuple[int, int]:
        """The role's slot among its host's roles and their number, from which its agent assigns it a CPU when they
        outnumber the host's CPUs; (0, 0): not bound: cpu_binding: none; Slurm, where a role is a job step, bound
        or not by Slurm's own task plugin; a framework's program, which sizes its own thread pools by the CPUs it
        may use (TensorFlow's parameter-server training bound to one CPU hangs: one inter-op thread)."""
        if not self._cpu_bound(role):
            return 0, 0
        slots = host_slots([(r.role, r.index) for r in self._roles_on_host(role.host)])
        return slots.get((role.role, role.index), 0), len(slots)

    def _cpu_bound(self, role: RoleRecord) -> bool:
        return not (self.spec.roles[role.role].cpu_binding == "none" or self.record.backend == "slurm"
                    or self.spec.training.get("framework") == "tensorflow")

    def rebind_cpus(self, host: str) -> None:
        """Tell ``host``'s agent the CPU slot of each of its roles among them now (they changed: psctl scale, a
        role moved, the host answered again), so that the running ones move to the CPUs their new slots name (or
        run unbound where no longer outnumbered)."""
        roles = self._roles_on_host(host)
        slots = host_slots([(r.role, r.index) for r in roles])
        bound = {r.name: slots[(r.role, r.index)] for r in roles if self._cpu_bound(r)}
        if bound:
            self.command(host, pb.AgentCommand(cpus=pb.CpuSlots(cpu_slot=bound, cpu_slots=len(slots))))

    def _roles_on_host(self, host: str) -> list[RoleRecord]:
        """The host's roles that are part of the cluster now (a retired role's slot and share of CPUs are free)."""
        return [r for r in self.record.roles if r.host == host and not r.retired]

    def role_env(self, role: RoleRecord) -> dict[str, str]:
        place = self.places[role.host]
        jobs: dict[str, list[str]] = {}
        for r in self.record.roles:
            if not r.retired:
                jobs.setdefault(r.role, []).append(r.endpoint)
        last_layout = chief_ps_layout(self.record) if role.role == "chief" else None
        if last_layout is not None:  # (a chief lost before it resharded: its successor starts where it left off)
            jobs["ps"] = [r.endpoint for r in last_layout]
        if place.remote:
            training = remote_training(self.spec, place.dirs)  # type: ignore[arg-type]  # a HostDir on SSH hosts
        else:
            training = dict(self.spec.training)
            if isinstance(training.get("checkpoint"), dict) and not training["checkpoint"].get("dir"):
                training["checkpoint"] = {**training["checkpoint"], "dir": str(self.cdir.checkpoints)}
        if role.role == "chief":
            folder = (training.get("checkpoint") or {}).get("dir")
            self.record.checkpoint_dir = "" if not folder else f"{role.host}:{folder}" if place.remote else str(folder)
        cluster = {
            "cluster": jobs,
            "task": {"type": role.role, "index": role.index},
            "cluster_id": self.record.cluster_id,
            "incarnation": role.incarnation,
            "training": training,
            "run_dir": str(place.dirs.run_dir),
            "supervisor": self.state.hosts[role.host].heartbeat_address or None,
            "tls": asdict(member_files(place.dirs.tls_dir, role.name)) if self.record.tls else None,
            "chief_incarnation": self.state.chief_incarnation(),
        }
        spec_role = self.spec.roles[role.role]
        threads = spec_role.threads or default_threads(place.cpus, len(self._roles_on_host(role.host)))
        env = {} if not place.remote else dict(place.base_env)  # here the agent's own environment is the base
        env.update(
            PSCTL_CLUSTER=json.dumps(cluster),
            TF_CONFIG=tf_config(jobs, role.role, role.index),
            PSCTL_CLUSTER_ID=self.record.cluster_id,
            PSCTL_ROLE=role.name,
            **{HOST_VARIABLE: role.host},
            PSCTL_HEARTBEAT_INTERVAL=str(self.spec.supervision.heartbeat_interval),
            PSCTL_PREEMPTION_GRACE=str(self.spec.supervision.preemption_grace),
        )
        env.update(tuning_env(threads))
        env.update(spec_role.env)
        return env

    # -- the end --------------------------------------------------------------------------------------
    def finish(self, action: policy.Finish) -> None:
        """The policy ordered every role stopped: wait for the agents to report them gone, collect the result,
        record the outcome, and end the agents."""
        deadline = self.time() + (action.grace + 5.0 if self.finish_wait is None else self.finish_wait)
        while any(self._running.get(h) for h in self._running) and self.time() < deadline:
            self.act([a for a in policy.decide(self.state, self.drain(), self.time())
                      if not isinstance(a, policy.Finish)])
        left = sorted(name for names in self._running.values() for name in names)
        if left:
            log.warning("still running after the stop's grace: %s (psctl down looks again)", ", ".join(left))
        self.mirror_metrics()
        self.record.result = self.read_result()
        self.act(policy.conclude(self.state, action.state, action.reason))
        for host in self.places:
            self.command(host, pb.AgentCommand(shutdown=pb.Shutdown(grace_seconds=0.0)))
        self.save(force=True)

    def stop_grace(self) -> float:
        """Seconds between SIGTERM and SIGKILL: ``psctl down --grace`` leaves it in stop-request.json."""
        try:
            return float(json.loads(self.cdir.stop_request.read_text())["grace"])
        except (OSError, ValueError, KeyError, TypeError):
            return self.default_grace

    def save(self, *, force: bool = False) -> None:
        now = self.time()
        if force or now - self._last_save > 1.0:
            try:
                with self._lock:
                    save_state(self.cdir.state_file, self.record)
            except OSError as exc:
                self._unwritten(self.cdir.state_file, exc)
            else:
                self._written(self.cdir.state_file)
            self._last_save = now  # (a failed one too: the next save, a second on, tries again)

    def _unwritten(self, path: Path, exc: OSError) -> None:
        """A file of the cluster's that could not be written (a full disk, a folder gone read-only): said once,
        and supervision goes on (it ended here before, leaving the roles training unwatched)."""
        why = exc.strerror or str(exc)
        if self._unwritable.get(path) != why:
            self._unwritable[path] = why
            log.error("cannot write %s (%s): supervising on, trying again as it goes; status shows the state as "
                      "last written", path, why)

    def _written(self, path: Path) -> None:
        if self._unwritable.pop(path, None) is not None:
            log.info("%s written again", path)

    def _mirror_in_background(self) -> None:
        try:
            self._mirror()
        finally:
            self._mirror_lock.release()

    def mirror_metrics(self) -> None:
        """Copy what a chief on an SSH host added to its metrics.jsonl into the local run folder, so that
        ``status`` and plots read it here (the chief's own file stays complete on its host)."""
        with self._mirror_lock:
            self._mirror()

    def _mirror(self) -> None:
        chief = self.state.chief
        if chief is None or not self.places[chief.host].remote:
            return
        host = chief.host
        place = self.places[host]
        try:
            offset = self._mirror_offsets.get(host, 0)
            data = place.runner.read_file(str(place.dirs.run_dir / "metrics.jsonl"), offset)
        except (OSError, PsctlError):
            return
        complete = data[: data.rfind(b"\n") + 1]  # whole lines only: the rest is read next time
        if complete:
            with open(self.cdir.run_dir / "metrics.jsonl", "ab") as f:
                f.write(complete)
            self._mirror_offsets[host] = offset + len(complete)

    def read_result(self) -> dict[str, Any] | None:
        """The chief's result.json and the evaluator's last result, read on their hosts."""
        by_role = {r.role: r for r in self.record.roles}
        chief = by_role.get("chief")
        result = self._read_run_file(chief, "result.json", 0)
        if not isinstance(result, dict):
            return None
        if chief is not None and self.places[chief.host].remote and result.get("checkpoint"):
            result["checkpoint"] = f"{chief.host}:{result['checkpoint']}"  # scp's notation: where it is
        lines = self._read_run_file(by_role.get("evaluator"), "eval.jsonl", -65536)
        if isinstance(lines, str):
            last = lines.strip().splitlines()[-1:] if lines.strip() else []
            with contextlib.suppress(ValueError):
                result["evaluation"] = json.loads(last[0]) if last else None
        return result

    def _read_run_file(self, role: RoleRecord | None, name: str, offset: int) -> Any:
        """A file of the run folder on ``role``'s host: parsed JSON for .json, else text; None if missing."""
        if role is None:
            return None
        place = self.places[role.host]
        try:
            text = place.runner.read_file(str(Path(str(place.dirs.run_dir)) / name), offset)
            decoded = text.decode("utf-8", "replace")
            return json.loads(decoded) if name.endswith(".json") else decoded
        except (OSError, ValueError, PsctlError):
            return None


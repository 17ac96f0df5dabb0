"""A real cluster of ``python -m psctl.runtime`` processes on loopback, for the runtime tests.

Every role is its own process in its own session (so its whole process group can be killed), logging to its
own file under the run directory. :meth:`LocalCluster.close` stops everything it ever started, escalating
from SIGTERM to SIGKILL of the process group, and then checks with psutil that nothing of the cluster
survived (killing and reporting anything that did); use it through :func:`local_cluster` (a context
manager) or a fixture's ``finally``.

Ports are reserved by binding port 0 with ``SO_REUSEPORT`` and keeping the socket open (not listening) for
the cluster's lifetime: gRPC servers bind with ``SO_REUSEPORT`` too, so the role can listen on the port while
no unrelated process can take it between reservation and use (or between a kill and a restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psutil

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.rpc import make_channel

REPO_ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def autogroup_nice(pid: int) -> int | None:
    """The nice of the process's autogroup (``/autogroup-17 nice 19``); None where the kernel has none."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except FileNotFoundError:
        return None


def wait_until(
    condition: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def reserve_port() -> socket.socket:
    """A loopback port held open (bound, not listening) with SO_REUSEPORT; the port is ``getsockname()[1]``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Role:
    task_type: str
    index: int
    incarnation: int
    popen: subprocess.Popen[bytes]
    #: psutil's handle (pid plus creation time, so a recycled pid is never mistaken for this process);
    #: None if the process was gone before psutil could look at it.
    process: psutil.Process | None
    log_path: Path

    @property
    def task(self) -> str:
        return f"{self.task_type}:{self.index}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""


class LocalCluster:
    def __init__(
        self,
        run_dir: Path,
        training: dict[str, Any],
        *,
        num_ps: int = 2,
        num_workers: int = 2,
        cluster_id: str = "test",
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.training = dict(training)
        self.cluster_id = cluster_id
        self._reservations: list[socket.socket] = []
        self.jobs: dict[str, list[str]] = {
            "chief": [self._address()],
            "ps": [self._address() for _ in range(num_ps)],
            "worker": [self._address() for _ in range(num_workers)],
        }
        #: Extra keys of PSCTL_CLUSTER for the roles started from now on (e.g. the current chief_incarnation).
        self.extra_config: dict[str, Any] = {}
        #: Every process ever started, in start order (restarted roles keep their dead predecessors here).
        self.started: list[Role] = []
        self.current: dict[tuple[str, int], Role] = {}
        self._channels: dict[int, grpc.Channel] = {}

    def _address(self) -> str:
        sock = reserve_port()
        self._reservations.append(sock)
        return f"127.0.0.1:{sock.getsockname()[1]}"

    # -- processes ------------------------------------------------------------------------------------
    def env(self, task_type: str, index: int, incarnation: int) -> dict[str, str]:
        config = {
            "cluster": self.jobs,
            "task": {"type": task_type, "index": index},
            "cluster_id": self.cluster_id,
            "incarnation": incarnation,
            "training": self.training,
            "run_dir": str(self.run_dir),
            **self.extra_config,
        }
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PSCTL_CLUSTER")}
        env.update(
            PSCTL_CLUSTER=json.dumps(config),
            OMP_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        )
        return env

    def start(self, task_type: str, index: int, *, incarnation: int = 1) -> Role:
        old = self.current.get((task_type, index))
        if old is not None and old.popen.poll() is None:
            raise RuntimeError(f"{old.task} is still running (pid {old.popen.pid})")
        log_path = self.run_dir / f"{task_type}-{index}-inc{incarnation}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "psctl.runtime"],
                env=self.env(task_type, index, incarnation),
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, killed as a whole in close()
            )
        try:
            process: psutil.Process | None = psutil.Process(popen.pid)
        except psutil.NoSuchProcess:
            process = None
        role = Role(task_type, index, incarnation, popen, process, log_path)
        self.started.append(role)
        self.current[(task_type, index)] = role
        return role

    def start_servers(self) -> None:
        for task_type in ("ps", "worker"):
            for index in range(len(self.jobs[task_type])):
                self.start(task_type, index)

    def wait_serving(self, timeout: float = 60.0) -> None:
        """Until every ps and worker answers an rpc (so the chief, started next, finds them all up)."""
        for task_type in ("ps", "worker"):
            for index, address in enumerate(self.jobs[task_type]):
                role = self.current[(task_type, index)]

                def answers(task_type: str = task_type, address: str = address, role: Role = role) -> bool:
                    if role.popen.poll() is not None:
                        raise AssertionError(f"{role.task} exited with {role.popen.returncode}\n{role.log()}")
                    return self._answers(task_type, address)

                wait_until(
                    answers, timeout=timeout, interval=0.1, what=f"{task_type}:{index} to serve", detail=self.logs
                )

    @staticmethod
    def _answers(task_type: str, address: str) -> bool:
        channel = make_channel(address)
        try:
            if task_type == "ps":
                pb_grpc.ParameterServerStub(channel).GetState(pb.StateRequest(), timeout=2)
            else:
                pb_grpc.WorkerStub(channel).Ping(pb.PingRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def start_chief(self) -> Role:
        return self.start("chief", 0)

    def role(self, task_type: str, index: int = 0) -> Role:
        return self.current[(task_type, index)]

    def send_signal(self, task_type: str, index: int, sig: int) -> None:
        """Send ``sig`` to a running role's whole process group (SIGSTOP / SIGCONT pause and resume it)."""
        role = self.current[(task_type, index)]
        if role.popen.poll() is not None:
            raise AssertionError(f"{role.task} already exited with {role.popen.returncode}\n{role.log()}")
        os.killpg(role.popen.pid, sig)

    def kill(self, task_type: str, index: int, sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
        """Signal a running role's process group and wait until the process is gone (reaped)."""
        self.send_signal(task_type, index, sig)
        self.current[(task_type, index)].popen.wait(timeout=timeout)

    def wait_for_exit(self, task_type: str, index: int = 0, *, timeout: float) -> int:
        role = self.current[(task_type, index)]
        try:
            return role.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{role.task} did not exit within {timeout:.0f}s\n{self.logs()}") from None

    def logs(self, tail: int = 4000) -> str:
        """The end of every role's log, for assertion messages."""
        parts = []
        for role in self.started:
            text = role.log()
            parts.append(
                f"----- {role.task} incarnation {role.incarnation} (pid {role.popen.pid}) -----\n{text[-tail:]}"
            )
        return "\n".join(parts)

    # -- inspection -----------------------------------------------------------------------------------
    def ps_stub(self, index: int) -> pb_grpc.ParameterServerStub:
        if index not in self._channels:
            self._channels[index] = make_channel(self.jobs["ps"][index])
        return pb_grpc.ParameterServerStub(self._channels[index])

    def ps_state(self, index: int, *, include_step_ids: bool = False, timeout: float = 5.0) -> pb.StateResponse:
        return self.ps_stub(index).GetState(  # type: ignore[no-any-return]
            pb.StateRequest(include_step_ids=include_step_ids), timeout=timeout
        )

    def global_step(self) -> int | None:
        """ps 0's global step, or None while it is not reachable or not initialised yet."""
        try:
            state = self.ps_state(0, timeout=2.0)
        except grpc.RpcError:
            return None
        return int(state.global_step) if state.initialized else None

    def result(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "result.json").read_text())  # type: ignore[no-any-return]

    def chief_log(self) -> str:
        return self.role("chief").log()

    # -- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process ever started, then verify with psutil that none of them (nor anything they
        started) is left; anything found is killed and reported as a failure."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        # Signals go to a role's group only while its leader is our unreaped child, so the group id is
        # certainly still ours (a reaped leader's pid could have been reused).
        live = [r for r in reversed(self.started) if r.popen.poll() is None]
        for role in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(role.popen.pid, signal.SIGCONT)  # a paused role could not act on SIGTERM
                os.killpg(role.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for role in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                role.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for role in self.started:
            if role.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(role.popen.pid, signal.SIGKILL)
            role.popen.wait(timeout=10)
        for sock in self._reservations:
            sock.close()
        self._reservations.clear()
        survivors = self.survivors()
        for proc in survivors:
            with contextlib.suppress(psutil.Error):
                proc.kill()
                proc.wait(timeout=10)
        if survivors:
            raise AssertionError(f"processes of this cluster survived its teardown: {[p.pid for p in survivors]}")

    def survivors(self) -> list[psutil.Process]:
        """Live processes of this cluster: the roles themselves, and any process carrying this cluster's
        PSCTL_CLUSTER (which is how a child of a role would show up)."""
        marker = json.dumps(str(self.run_dir))
        found: dict[int, psutil.Process] = {}
        for role in self.started:
            if role.process is not None and role.process.is_running():
                found[role.process.pid] = role.process
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if marker in proc.environ().get("PSCTL_CLUSTER", ""):
                    found[proc.pid] = proc
            except psutil.Error:
                continue
        return list(found.values())


@contextlib.contextmanager
def local_cluster(run_dir: Path, training: dict[str, Any], **kwargs: Any) -> Iterator[LocalCluster]:
    cluster = LocalCluster(run_dir, training, **kwargs)
    try:
        yield cluster
    finally:
        cluster.close()

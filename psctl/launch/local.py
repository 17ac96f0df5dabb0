"""Processes on this machine: subprocess to start them, psutil to find and watch them."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath

import psutil

from psctl.launch.base import ProcessHandle, Runner

UNKNOWN_EXIT = -255


class LocalRunner(Runner):
    host = "localhost"

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._exited: dict[int, int] = {}  # exit codes of children already reaped

    def start(self, *, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: PurePath) -> ProcessHandle:
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            os.chmod(log_path, 0o600)
            proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own session and process group: signalled as one, survives our exit
            )
        self._children[proc.pid] = proc
        try:
            created: float | None = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            created = None
        return ProcessHandle(self.host, proc.pid, created)

    def poll(self, handle: ProcessHandle) -> int | None:
        child = self._children.get(handle.pid)
        if child is not None:
            code = child.poll()
            if code is not None:
                del self._children[handle.pid]
                self._exited[handle.pid] = code
            return code
        if handle.pid in self._exited:
            return self._exited[handle.pid]
        # Not our child (a supervisor restarted, or the CLI tearing down): watch it through psutil.
        try:
            proc = psutil.Process(handle.pid)
            if handle.create_time is not None and abs(proc.create_time() - handle.create_time) > 0.01:
                return UNKNOWN_EXIT  # the pid was reused: our process is gone
            if proc.status() == psutil.STATUS_ZOMBIE:
                return UNKNOWN_EXIT
        except psutil.NoSuchProcess:
            return UNKNOWN_EXIT
        except psutil.Error:
            return None
        return None

    def signal_group(self, handle: ProcessHandle, sig: int) -> None:
        if self.poll(handle) is not None:
            return
        try:
            os.killpg(handle.pid, sig)
        except (ProcessLookupError, PermissionError):
            # it leads no group (a daemon that forked twice, whose group's leader is gone) or not its own: itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.pid, sig)

    def cluster_processes(self, cluster_id: str) -> list[ProcessHandle]:
        found = []
        me = os.getpid()
        for proc in psutil.process_iter(["pid", "create_time", "status"]):
            if proc.info["pid"] == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if proc.environ().get("PSCTL_CLUSTER_ID") == cluster_id:
                    found.append(ProcessHandle(self.host, proc.info["pid"], proc.info["create_time"]))
            except psutil.Error:
                continue
        return found


    def read_end(self, path: str, nbytes: int) -> tuple[bytes, int]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - nbytes))
            return f.read(size - f.tell()), size

    def read_file(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        with open(path, "rb") as f:
            if offset < 0:
                f.seek(max(0, os.fstat(f.fileno()).st_size + offset))
            else:
                f.seek(offset)
            return f.read(size)

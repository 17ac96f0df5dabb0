"""Fakes for the supervisor's logic tests: a process runner whose processes are dict entries, and a clock.

A fake is right there: what is under test is the decision logic (restart policy, backoff, placement, benching),
not process handling, which the end-to-end and fault tests cover for real.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from psctl.errors import PsctlError
from psctl.launch.base import ProcessHandle, Runner


class FakeRunner(Runner):
    """Processes that exist only as entries in a dict: the test decides when they exit."""

    def __init__(self, host: str = "localhost") -> None:
        self.host = host
        #: Set by a test: the host is cut off (every operation fails with this).
        self.last_error: str | None = None
        self.next_pid = 1000
        self._pid_lock = threading.Lock()  # the supervisor starts and stops roles on SSH hosts from threads
        self.exit_codes: dict[int, int | None] = {}
        self.signals: list[tuple[int, int]] = []

    def start(self, *, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path) -> ProcessHandle:
        if self.last_error is not None:
            raise PsctlError(self.last_error)
        with self._pid_lock:
            self.next_pid += 1
            pid = self.next_pid
            self.exit_codes[pid] = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("started\n")
        return ProcessHandle(self.host, pid, 0.0)

    def poll(self, handle: ProcessHandle) -> int | None:
        return self.exit_codes.get(handle.pid, -255)

    def signal_group(self, handle: ProcessHandle, sig: int) -> None:
        if self.last_error is not None:
            raise PsctlError(self.last_error)
        self.signals.append((handle.pid, sig))
        if self.exit_codes.get(handle.pid) is None:
            self.exit_codes[handle.pid] = -sig

    def cluster_processes(self, cluster_id: str) -> list[ProcessHandle]:
        with self._pid_lock:  # starts add entries from other threads
            return [ProcessHandle(self.host, pid) for pid, code in self.exit_codes.items() if code is None]

    def read_file(self, path: str, offset: int = 0) -> bytes:
        data = Path(path).read_bytes()
        return data[offset:] if offset >= 0 else data[max(0, len(data) + offset):]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

"""Where psctl keeps each cluster's files: ``$PSCTL_HOME/<name>/`` (default ``~/.psctl``)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Generic, TypeVar

from psctl.errors import UsageError

P = TypeVar("P", bound=PurePath)


def psctl_home() -> Path:
    return Path(os.environ.get("PSCTL_HOME", "~/.psctl")).expanduser()


@dataclass(frozen=True)
class RoleFolders(Generic[P]):
    """The folders a cluster's roles use, the same on every host: here under ``$PSCTL_HOME/<name>/``
    (:class:`ClusterDir`), on an SSH host under its workdir (``psctl.launch.remote.HostDir``)."""

    root: P

    @property
    def logs(self) -> P:
        return self.root / "logs"

    @property
    def run_dir(self) -> P:
        """Where the chief writes metrics.jsonl and result.json."""
        return self.root / "run"

    @property
    def tls_dir(self) -> P:
        return self.root / "tls"

    @property
    def checkpoints(self) -> P:
        """Where the chief writes checkpoints unless the spec names a folder."""
        return self.root / "checkpoints"

    def role_log(self, role: str, attempt: int) -> P:
        return self.logs / f"{role}.{attempt}.log"


@dataclass(frozen=True)
class ClusterDir(RoleFolders[Path]):
    """The files of one named cluster on this machine: the role folders, and the supervisor's own."""

    @classmethod
    def named(cls, name: str) -> ClusterDir:
        return cls(psctl_home() / name)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def spec_file(self) -> Path:
        return self.root / "spec.yaml"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def events_file(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def stop_request(self) -> Path:
        """``psctl down`` leaves the grace it asks for here before it signals the supervisor."""
        return self.root / "stop-request.json"

    @property
    def slurm_job_file(self) -> Path:
        """backend slurm: ``up`` writes the job's id here (the supervisor records it in the state once it runs)."""
        return self.root / "slurm-job-id"

    @property
    def scale_request(self) -> Path:
        """``psctl scale`` leaves its request here for the supervisor (which takes it within 0.1 s)."""
        return self.root / "scale-request.json"

    def clear_last_run(self) -> None:
        """Before a new ``up`` of this name: the last run's logs, results, events and requests go (its
        checkpoints stay: the new run resumes from them)."""
        for stale in (self.logs, self.run_dir):
            shutil.rmtree(stale, ignore_errors=True)
        for path in (self.events_file, self.stop_request, self.scale_request, self.slurm_job_file):
            path.unlink(missing_ok=True)

    def create(self) -> None:
        for path in (self.root, self.logs, self.run_dir):
            try:
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o700)
            except OSError as exc:  # PSCTL_HOME a file, read-only, not ours
                raise UsageError(f"cannot create {path}: {exc.strerror or exc}",
                                 hint=f"set PSCTL_HOME (now {psctl_home()}) to a folder you can write") from exc


def list_clusters() -> list[ClusterDir]:
    home = psctl_home()
    if not home.is_dir():
        return []
    return sorted((ClusterDir(p) for p in home.iterdir() if (p / "state.json").is_file()), key=lambda c: c.name)

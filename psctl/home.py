"""Where psctl keeps each cluster's files: ``$PSCTL_HOME/<name>/`` (default ``~/.psctl``)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Generic, TypeVar

from psctl.errors import UsageError

P = TypeVar("P", bound=PurePath)


#: A cluster's name: a folder under PSCTL_HOME, a label on every host (never a path).
CLUSTER_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")

#: How many earlier runs of a cluster name ``up`` keeps under its folder's ``history``.
KEPT_RUNS = 5


def psctl_home() -> Path:
    """``$PSCTL_HOME`` (default ``~/.psctl``, also where it is set empty), made absolute: the supervisor and agents
    run in other folders."""
    return Path(os.environ.get("PSCTL_HOME") or "~/.psctl").expanduser().absolute()


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
        """The folder of the cluster ``name``; a name that is no cluster's (``../x``, a path) is refused before
        anything under it is read or deleted."""
        if not CLUSTER_NAME.fullmatch(name):
            raise UsageError(f"{name!r} is not a cluster name (lowercase letters, digits and '-', at most 63; "
                             "`psctl ls` lists them)")
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
    def supervisor_lock(self) -> Path:
        """Held (flock) by the cluster's supervisor while it runs: see take_supervision."""
        return self.root / "supervisor.lock"

    @property
    def stop_request(self) -> Path:
        """``psctl down`` leaves the grace it asks for here before it signals the supervisor."""
        return self.root / "stop-request.json"

    @property
    def slurm_job_file(self) -> Path:
        """backend slurm: ``up`` writes the job's id here (the supervisor records it in the state once it runs)."""
        return self.root / "slurm-job-id"

    @property
    def up_lock(self) -> Path:
        """Held (flock) by a ``psctl up`` of this name from its check that none runs until its supervisor does: a
        second one at once would make the cluster's keys again under the first (whose agent then failed TLS).
        Beside the cluster's folder, not in it (``up`` moves a last run's files aside)."""
        return self.root.with_name(f".{self.name}.up.lock")

    @property
    def scale_lock(self) -> Path:
        """Held (flock) by a ``psctl scale`` from its check until the supervisor has carried the change out: two
        at once would each read the replicas before the other's change."""
        return self.root / "scale.lock"

    @property
    def scale_request(self) -> Path:
        """``psctl scale`` leaves its request here for the supervisor (which takes it within 0.1 s)."""
        return self.root / "scale-request.json"

    @property
    def history(self) -> Path:
        """The earlier runs of this name, one folder each, numbered on from 1 (the KEPT_RUNS newest are kept)."""
        return self.root / "history"

    def kept_runs(self) -> list[Path]:
        """The earlier runs kept under ``history``, oldest first."""
        if not self.history.is_dir():
            return []
        return sorted((p for p in self.history.iterdir() if p.name.isdigit() and p.is_dir()), key=lambda p: int(p.name))

    def keep_last_run(self) -> Path | None:
        """Before a new ``up`` of this name: the last run's logs, results (metrics, result.json), events, record
        and spec go to a new folder under ``history`` (returned; None where it left none), the oldest beyond
        KEPT_RUNS go, and its requests are dropped. Its checkpoints stay where they are: the new run resumes
        from them."""
        for path in (self.stop_request, self.scale_request, self.slurm_job_file):
            path.unlink(missing_ok=True)
        leftovers = [p for p in (self.logs, self.run_dir, self.events_file, self.supervisor_log, self.state_file,
                                 self.spec_file) if p.exists()]
        if not leftovers:
            return None
        if self._trained_nothing():  # an `up` that found nothing to train: its files go (kept, it took the place
            # of a run that trained, and its lone metrics record cut the curves `psctl plot` continues)
            for path in (self.logs, self.run_dir, self.events_file, self.supervisor_log):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            return None
        runs = self.kept_runs()
        kept = self.history / str(int(runs[-1].name) + 1 if runs else 1)
        kept.mkdir(parents=True, mode=0o700)
        self.history.chmod(0o700)
        for path in leftovers:
            if path in (self.state_file, self.spec_file):  # (copied: they stand for the cluster until replaced)
                shutil.copy2(path, kept / path.name)
            else:
                os.replace(path, kept / path.name)
        for old in runs[: max(0, len(runs) + 1 - KEPT_RUNS)]:
            shutil.rmtree(old, ignore_errors=True)
        return kept

    def _trained_nothing(self) -> bool:
        """Whether the last run ended at once with nothing to train: its result says no step ran, and that is the
        whole run's (its chief's first attempt: a chief restarted at the end trains nothing itself)."""
        try:
            result = json.loads((self.run_dir / "result.json").read_text(encoding="utf-8"))
            record = json.loads(self.state_file.read_text(encoding="utf-8"))
            chiefs = [r for r in record["roles"] if r["role"] == "chief"]
        except (OSError, ValueError, TypeError, KeyError):
            return False
        return (isinstance(result, dict) and result.get("steps_this_run") == 0
                and all(r.get("attempt") == 1 for r in chiefs))

    def create(self) -> None:
        for path in (self.root, self.logs, self.run_dir):
            try:
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o700)
            except OSError as exc:  # PSCTL_HOME a file, read-only, not ours
                raise UsageError(f"cannot create {path}: {exc.strerror or exc}",
                                 hint=f"set PSCTL_HOME (now {psctl_home()}) to a folder you can write") from exc


def nearest_existing(path: Path) -> tuple[Path, int]:
    """The nearest of ``path`` and the folders above it that exists, and its ``st_mode`` (where a file written at
    ``path`` would go); OSError for one on the way that cannot be entered (EACCES)."""
    for existing in (path, *path.parents):
        try:
            return existing, existing.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # (made when written; or under a file: the caller says)
            continue
    raise FileNotFoundError(errno.ENOENT, "no folder of it exists", str(path))  # (the root always does)


def list_clusters() -> list[ClusterDir]:
    home = psctl_home()
    if not home.is_dir():
        return []
    # (a folder whose name no cluster can have, a hand-made copy say, is no cluster: no command could name it)
    return sorted((ClusterDir(p) for p in home.iterdir() if CLUSTER_NAME.fullmatch(p.name)
                   and (p / "state.json").is_file()), key=lambda c: c.name)


def exclusive_lock(path: Path, *, wait: float = 0.0) -> int | None:
    """An exclusive flock on ``path`` (made 0600 if missing): the open descriptor, held until it is closed or the
    process ends (SIGKILL included: the kernel drops it), or None where another process holds it for ``wait``
    seconds. A file system without locks gives -1: unguarded."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)
        except OSError:  # (ENOLCK, say, on a network file system without locks)
            os.close(fd)
            return -1


def release(fd: int | None) -> None:
    """Drop a lock :func:`exclusive_lock` gave (None and -1 hold nothing)."""
    if fd is not None and fd >= 0:
        os.close(fd)


def take_supervision(cdir: ClusterDir, *, wait: float = 0.0) -> int | None:
    """The cluster's supervisor lock, for its supervisor to hold while it runs: a second supervisor started for
    the cluster (`psctl supervise` beside `up`'s, or two at once) gets None and must step aside, or both would run
    its roles. (A supervisor waits a little: a command asking whether one runs holds the lock for an instant.)"""
    return exclusive_lock(cdir.supervisor_lock, wait=wait)


def lock_held(path: Path) -> bool | None:
    """Whether another process holds the lock on ``path`` now; None where that cannot be told (no such file: none
    was ever taken there; a file system without locks)."""
    if not path.exists():
        return None
    try:
        fd = exclusive_lock(path)
    except OSError:  # (removed meanwhile: ``down --purge``)
        return None
    release(fd)
    return None if fd == -1 else fd is None

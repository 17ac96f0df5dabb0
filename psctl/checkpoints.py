"""Finding a cluster's newest valid checkpoint for ``psctl export``: here, or on the SSH host of its chief.

A checkpoint on a host is copied here over SFTP (its manifest first, then each file the manifest names) into a
temporary folder and verified like a local one; the newest that verifies wins, a corrupt newer one is skipped.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from psctl.errors import CheckpointNotFound, PsctlError, UsageError
from psctl.home import ClusterDir
from psctl.launch.hostset import RemoteHost, ssh_runner
from psctl.runtime.checkpoint import (
    CheckpointError,
    Snapshot,
    checkpoint_step,
    first_that_loads,
    latest_checkpoint,
    load_checkpoint,
    step_of,
)
from psctl.spec.plan import LOCAL_HOST
from psctl.supervisor.state import ClusterRecord

if TYPE_CHECKING:
    from psctl.launch.ssh import SSHRunner

_NONE_YET = ("the chief writes one every training.checkpoint.every_steps / every_seconds and at the end; or name "
             "one with --checkpoint PATH")


def split_location(text: str, hosts: Mapping[str, object]) -> tuple[str, str]:
    """``host:path`` (host one of ``hosts``, or ``localhost``: this machine, as `psctl status` names it) as (host,
    path); anything else is a path here."""
    host, sep, path = text.partition(":")
    if sep and host == LOCAL_HOST and LOCAL_HOST not in hosts:
        return LOCAL_HOST, path
    return (host, path) if sep and host in hosts else (LOCAL_HOST, text)


def checkpoint_folder(cdir: ClusterDir, record: ClusterRecord) -> tuple[str, str]:
    """Where the cluster's chief writes checkpoints, as (host, folder): the folder of the checkpoint its result
    names once it finished, else the folder the supervisor gave the chief (training.checkpoint.dir or the
    default), else the default folder on the chief's host (a cluster recorded by an older psctl)."""
    written = (record.result or {}).get("checkpoint")
    if written:
        host, path = split_location(str(written), record.hosts)
        return host, str(PurePosixPath(path).parent)
    if record.checkpoint_dir:
        return split_location(record.checkpoint_dir, record.hosts)
    chief = next((r for r in record.roles if r.role == "chief"), None)
    if chief is not None and chief.host in record.hosts:
        return chief.host, str(RemoteHost.from_dict(record.hosts[chief.host]).dirs.checkpoints)
    return LOCAL_HOST, str(cdir.checkpoints)


def find_snapshot(cdir: ClusterDir | None, record: ClusterRecord | None, location: str | None) -> tuple[str, Snapshot]:
    """The checkpoint to export and where it is (``host:path`` on a host): ``location`` (one checkpoint, or a
    folder of them: the newest valid one; ``host:path`` on one of the cluster's hosts), else the cluster's."""
    if location is None:
        assert cdir is not None and record is not None
        host, folder = checkpoint_folder(cdir, record)
    elif record is not None:
        host, folder = split_location(location, record.hosts)
        if host == LOCAL_HOST and folder == location and not Path(location).expanduser().exists():
            named = location.partition(":")[0]
            hosts = ", ".join(sorted(record.hosts)) or "none: it runs on this machine"
            raise UsageError(f"--checkpoint {location}: {named!r} is not a host of cluster {record.name!r} "
                             f"(its hosts: {hosts}); give HOST:PATH with one of them, or a local folder")
    else:
        host, folder = LOCAL_HOST, location
    if host == LOCAL_HOST:
        return _local(Path(folder).expanduser())
    assert record is not None
    with ssh_runner(RemoteHost.from_dict(record.hosts[host]).spec) as runner, tempfile.TemporaryDirectory() as tmp:
        return fetch_newest(runner, folder, Path(tmp))


def _local(path: Path) -> tuple[str, Snapshot]:
    if not path.exists():
        raise CheckpointNotFound(f"no checkpoint folder {path}", hint=_NONE_YET)
    try:
        if (path / "manifest.json").is_file():
            return str(path), load_checkpoint(path)
    except CheckpointError as exc:  # damaged, not misnamed: a failure (exit 1), not a usage error
        raise PsctlError(str(exc), hint="name another checkpoint, or their folder: the newest that verifies is "
                                        "taken") from None
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointNotFound(f"no valid checkpoint in {path}", hint=_NONE_YET)
    return str(found[0]), found[1]


def fetch_newest(runner: SSHRunner, folder: str, into: Path) -> tuple[str, Snapshot]:
    """Copy the newest checkpoint under ``folder`` on the runner's host that verifies into ``into`` and load it
    (``folder`` may be one checkpoint)."""
    remote = PurePosixPath(folder)
    if checkpoint_step(remote.name) is not None:
        candidates = [remote]
    else:
        try:
            names = runner.listdir(folder)
        except FileNotFoundError:
            raise CheckpointNotFound(f"no checkpoint folder {folder} on {runner.host}", hint=_NONE_YET) from None
        candidates = sorted((remote / n for n in names if checkpoint_step(n) is not None), key=step_of, reverse=True)
    found = first_that_loads(candidates, lambda path: load_checkpoint(_copy(runner, path, into / path.name)),
                             skip=(CheckpointError, FileNotFoundError), where=lambda path: f"{runner.host}:{path}")
    if found is None:
        raise CheckpointNotFound(f"no valid checkpoint in {folder} on {runner.host}", hint=_NONE_YET)
    return f"{runner.host}:{found[0]}", found[1]


def _copy(runner: SSHRunner, remote: PurePosixPath, local: Path) -> Path:
    """The checkpoint's manifest and the files it lists, copied into ``local`` (names checked: a manifest from a
    host cannot make this write outside ``local``)."""
    local.mkdir(mode=0o700)
    manifest = runner.read_file(str(remote / "manifest.json"))
    try:
        names = list(json.loads(manifest)["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{remote}: no readable manifest ({exc})") from None
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(f"{remote}: the manifest names {name!r}, not a file of the checkpoint")
        runner.get_file(str(remote / name), local / name)
    (local / "manifest.json").write_bytes(manifest)
    return local

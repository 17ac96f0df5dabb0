"""Consistent, atomic, checksummed checkpoints, restorable into any number of ps and any partitioning.

A checkpoint is a folder ``ckpt-<global step>/`` holding ``arrays.npz`` (every variable joined whole, and its
optimizer slots), ``state.json`` (global step, each data shard's input position, the optimizer) and
``manifest.json`` (sha256 and size of each file), written last. The folder is built under a temporary name,
every file fsynced, then renamed: a crash mid-write never leaves a folder that looks complete, and a folder
whose files do not match its manifest is skipped (with a warning) in favour of the previous one.

Numbering is by global step, so a restarted cluster never overwrites an older checkpoint (TensorFlow's save
counter restarts at 1 in a process that did not restore).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import socket
import stat
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, TypeVar

import grpc
import numpy as np

from psctl.proto import psctl_pb2 as pb
from psctl.runtime.atomic import private_temporary, write_json_atomic
from psctl.runtime.model import ShardedModel
from psctl.runtime.ps_client import SYNC_COUNTERS, PsClient, sync_counters
from psctl.runtime.wire import DENSE, SLOT, Entry

log = logging.getLogger("psctl.checkpoint")
P = TypeVar("P", bound=PurePath)

PREFIX = "ckpt-"
#: A checkpoint that did not verify, set aside under this prefix (``damaged-ckpt-<step>``): out of the listed
#: checkpoints, so that it neither blocks a new one at its step nor counts against ``max_to_keep``; kept to look at.
DAMAGED_PREFIX = "damaged-"
#: Beside the checkpoints: which cluster last finished training into this folder (see mark_finished).
FINISHED = "finished.json"
_NAME = re.compile(r"ckpt-(\d+)")
#: Another host's temporary checkpoint folder untouched this long was abandoned (its writer died).
ABANDONED_AFTER = 24 * 3600.0
#: A checkpoint being written: ``.tmp-ckpt-<step>-<host>-<pid>-<thread>`` (host names have no dashes here).
_HOST = socket.gethostname().replace("-", "_")
_TMP_OWNER = re.compile(r"\.tmp-ckpt-\d+-(?P<host>[^-]*)-(?P<pid>\d+)-\d+")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or corrupt (``damaged``), or could not be read just now (an I/O error,
    a permission, a stale network handle: not ``damaged``, the same files may read tomorrow)."""

    def __init__(self, message: str, *, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


def _unread(path: Path, what: str, exc: OSError) -> CheckpointError:
    """A CheckpointError for an OSError reading ``path``: damaged where a file is missing or of the wrong kind."""
    missing = isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError))
    return CheckpointError(f"{path}: {what} ({exc})", damaged=missing)


@dataclass
class Snapshot:
    """The whole model at one global step: variables joined whole, slots likewise."""

    global_step: int
    shard_positions: list[int]
    variables: dict[str, np.ndarray]
    slots: dict[str, dict[str, np.ndarray]]
    meta: dict[str, Any] = field(default_factory=dict)
    #: synchronous training's counters as ps 0 had them (``sync_counters``); empty in a checkpoint from before
    #: they were recorded
    sync_counters: dict[str, int] = field(default_factory=dict)


def take_snapshot(model: ShardedModel, ps: PsClient) -> Snapshot:
    """Pull every shard and its slots from every PS (the caller has made sure no update is in flight)."""
    plan = model.pull_plan(full=True)
    pulled, global_step = ps.pull(plan, include_slots=True)
    by_name: dict[str, np.ndarray] = {}
    for entries in pulled.values():
        for entry in entries:
            by_name[entry.name] = entry.array
    state = ps.state(0)
    variables: dict[str, np.ndarray] = {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for name, layout in model.layouts.items():
        parts = [by_name[s.name] for s in layout.shards]
        variables[name] = parts[0].copy() if len(parts) == 1 else layout.join(parts)
        slot_names = sorted({k.split("#", 1)[1] for k in by_name if k.split("#", 1)[0] in
                             {s.name for s in layout.shards} and "#" in k})
        slots[name] = {}
        for slot in slot_names:
            pieces = [by_name[f"{s.name}#{slot}"] for s in layout.shards]
            if pieces[0].ndim == 0:  # a step count (Adam's t): set below
                slots[name][slot] = np.asarray(np.max(np.stack(pieces)), dtype=pieces[0].dtype)
            else:
                slots[name][slot] = pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    return Snapshot(global_step, list(state.shard_positions), variables, one_step_count(slots),
                    sync_counters=sync_counters(state))


def one_step_count(slots: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """``slots`` with each step count (a scalar slot: Adam's t) the same for every variable: the most advanced.
    The optimizer counts its steps once (TF's ``iterations``), each PS for its variables; PS that applied a step
    the others never will (a worker lost mid-push) differ by it, and a checkpoint of an older psctl kept one per
    shard. One count restored to every PS keeps them one; counts that differed came back otherwise than taken."""
    counts: dict[str, np.ndarray] = {}
    for per in slots.values():
        for key, value in per.items():
            if value.ndim == 0 and (key not in counts or value > counts[key]):
                counts[key] = value
    return {name: {key: counts[key].copy() if value.ndim == 0 else value for key, value in per.items()}
            for name, per in slots.items()}


def snapshot_difference(a: Snapshot, b: Snapshot) -> str:
    """What differs between two snapshots ("" if nothing): step, data positions, a variable or a slot."""
    if a.global_step != b.global_step:
        return f"the global step ({a.global_step} -> {b.global_step})"
    if a.shard_positions != b.shard_positions:
        return f"the data positions ({a.shard_positions} -> {b.shard_positions})"
    for name in sorted(set(a.variables) | set(b.variables)):
        if name not in a.variables or name not in b.variables or not np.array_equal(a.variables[name],
                                                                                      b.variables[name]):
            return f"variable {name!r}"
        slots_a, slots_b = a.slots.get(name, {}), b.slots.get(name, {})
        for slot in sorted(set(slots_a) | set(slots_b)):
            if slot not in slots_a or slot not in slots_b or not np.array_equal(slots_a[slot], slots_b[slot]):
                return f"slot {slot!r} of variable {name!r}"
    return ""


def check_variables(model: ShardedModel, snapshot: Snapshot) -> None:
    """CheckpointError unless ``snapshot`` holds every variable of ``model``, each of its shape."""
    for name, layout in model.layouts.items():
        if name not in snapshot.variables:
            raise CheckpointError(f"the checkpoint has no variable {name!r}")
        if snapshot.variables[name].shape != layout.variable.shape:
            raise CheckpointError(f"{name!r} is {snapshot.variables[name].shape} in the checkpoint, the program says "
                                  f"{layout.variable.shape}")


def restore_snapshot(model: ShardedModel, ps: PsClient, snapshot: Snapshot) -> None:
    """Split the snapshot into this model's current layout (any ps count or partitioning) and assign it."""
    check_variables(model, snapshot)
    per_ps: dict[int, list[Entry]] = {i: [] for i in range(model.num_ps)}
    slots = one_step_count(snapshot.slots)  # (a checkpoint of an older psctl: a count per variable)
    for name, layout in model.layouts.items():
        full = snapshot.variables[name]
        parts = [full] if len(layout.shards) == 1 else layout.split(full)
        for shard, part in zip(layout.shards, parts, strict=True):
            per_ps[shard.ps].append(Entry(shard.name, DENSE, np.ascontiguousarray(part)))
            for slot, value in slots.get(name, {}).items():
                if value.ndim == 0:
                    piece = value
                else:
                    piece = value[shard.row_offset : shard.row_offset + shard.shape[0]] if len(layout.shards) > 1 \
                        else value
                # np.require keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
                per_ps[shard.ps].append(Entry(f"{shard.name}#{slot}", SLOT, np.require(piece, requirements="C")))
    try:
        ps.assign(per_ps, snapshot.global_step, snapshot.shard_positions, snapshot.sync_counters or None)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:  # type: ignore[attr-defined]
            raise
        # (another optimizer's slots, say: the ps refuse what their variables do not have)
        raise CheckpointError(f"the ps refused it: {exc.details()}") from None  # type: ignore[attr-defined]


def reshard_onto(snapshot: Snapshot, model: ShardedModel, ps: PsClient, *, seed: int, optimizer: pb.OptimizerConfig,
                 cluster_id: str, replicas_to_aggregate: int = 0, distinct_replicas: bool = False) -> None:
    """Put ``snapshot`` onto another layout (``model`` over the ps of ``ps``: psctl scale ps=N): re-create the
    layout's shards on every ps (whatever they held), assign the snapshot split for it, and read it all back:
    CheckpointError unless every variable, slot, the global step and the data positions are the snapshot's."""
    ps.init(model.shard_specs(seed), optimizer, cluster_id, reset=True, replicas_to_aggregate=replicas_to_aggregate,
            distinct_replicas=distinct_replicas)
    restore_snapshot(model, ps, snapshot)
    differs = snapshot_difference(snapshot, take_snapshot(model, ps))
    if differs:
        raise CheckpointError(f"the variables read back from {model.num_ps} ps differ from the snapshot: {differs}")


# -- files ------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step:012d}"


def write_checkpoint(directory: str | Path, snapshot: Snapshot) -> Path:
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, snapshot.global_step)
    if final.exists():
        try:
            verify_checkpoint(final, checksums=False)  # (sizes only: a stop's checkpoint must not read gigabytes)
            return final  # the same global step is already saved: never overwrite
        except CheckpointError as exc:
            if not exc.damaged:
                raise
            set_aside(final, exc)  # (a damaged one from an earlier run must not stand in for this one)
    _remove_abandoned_writes(directory)
    tmp = directory / f".tmp-{final.name}-{_HOST}-{os.getpid()}-{threading.get_ident()}"
    tmp.mkdir()
    try:
        _write_into(tmp, snapshot)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (disk full, say) leaves nothing behind
        raise
    _fsync_dir(directory)
    return final


def _write_into(tmp: Path, snapshot: Snapshot) -> None:
    """The checkpoint's files in ``tmp``, each flushed to disk, then the folder itself."""
    arrays = {f"var:{k}": v for k, v in snapshot.variables.items()}
    for name, slots in snapshot.slots.items():
        arrays.update({f"slot:{name}#{slot}": v for slot, v in slots.items()})
    with open(tmp / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    state = {"global_step": snapshot.global_step, "shard_positions": snapshot.shard_positions,
             "sync_counters": snapshot.sync_counters, "time": time.time(), **snapshot.meta}
    with open(tmp / "state.json", "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    manifest = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
                for name in CHECKPOINT_FILES}  # (only its own: a file the file system drops in is not one of them)
    with open(tmp / "manifest.json", "w") as f:
        json.dump({"files": manifest, "global_step": snapshot.global_step}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _remove_abandoned_writes(directory: Path) -> None:
    """Delete the temporary folders of writers that died mid-write: on this host, those of processes that are
    gone; of other hosts (on shared storage the chief of another host may be writing one right now), those
    untouched for ABANDONED_AFTER seconds (no write takes that long; a host that crashed never comes back to
    clean its own)."""
    for tmp in directory.glob(f".tmp-{PREFIX}*"):
        match = _TMP_OWNER.fullmatch(tmp.name)
        if match is not None and match["host"] == _HOST:
            try:
                os.kill(int(match["pid"]), 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:  # alive, someone else's
                continue
        else:
            try:
                if time.time() - tmp.stat().st_mtime < ABANDONED_AFTER:
                    continue
            except OSError:
                continue
        shutil.rmtree(tmp, ignore_errors=True)


def mark_finished(directory: str | Path, cluster_id: str, global_step: int) -> None:
    """Leave word beside the checkpoints that cluster ``cluster_id`` finished training (its last checkpoint is
    written): an evaluator on another host, which cannot see the chief's result.json, stops on it."""
    write_json_atomic(Path(directory).expanduser() / FINISHED,
                      {"cluster_id": cluster_id, "global_step": global_step, "time": time.time()})


def finished_at(directory: str | Path, cluster_id: str) -> int | None:
    """The global step cluster ``cluster_id`` finished training at, if it left word in ``directory`` (see
    mark_finished); None otherwise."""
    try:
        word = json.loads((Path(directory).expanduser() / FINISHED).read_text())
        return int(word["global_step"]) if word["cluster_id"] == cluster_id else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest first (temporary folders are not listed)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and checkpoint_step(p.name) is not None]
    return sorted(found, key=step_of)


def checkpoint_step(name: str) -> int | None:
    """The global step in a checkpoint folder's name (``ckpt-<step>``); None for any other name."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def step_of(path: PurePath) -> int:
    step = checkpoint_step(path.name)
    if step is None:
        raise ValueError(f"{path} is not a checkpoint folder (ckpt-<step>)")
    return step


#: The files of a checkpoint, as its manifest lists them.
CHECKPOINT_FILES = ("arrays.npz", "state.json")


def verify_checkpoint(path: Path, *, checksums: bool = True) -> None:
    """CheckpointError unless every file the manifest names is there, of its size and (``checksums``) its sha256."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())["files"]
    except OSError as exc:
        raise _unread(path, "no readable manifest", exc) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: no readable manifest ({exc})") from None
    # its files at least, each a plain name in the folder (a name such as ../../x had that file read and hashed;
    # more files than these: a later psctl's, still a checkpoint to this one)
    if not (isinstance(manifest, dict) and set(CHECKPOINT_FILES) <= set(manifest)
            and all(isinstance(n, str) and n == PurePath(n).name and n not in (".", "..") for n in manifest)):
        names = sorted(map(str, manifest)) if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: the manifest names {names!r}, not a checkpoint's files "
                              f"{list(CHECKPOINT_FILES)} in its folder")
    for name, info in manifest.items():
        file = path / name
        try:
            if not file.is_file() or file.stat().st_size != info["bytes"]:
                raise CheckpointError(f"{path}: {name} is missing or truncated")
            if checksums and _sha256(file) != info["sha256"]:
                raise CheckpointError(f"{path}: {name} does not match its checksum")
        except OSError as exc:
            raise _unread(path, f"{name} cannot be read", exc) from None


def _check_arrays_file(path: Path) -> None:
    """CheckpointError unless arrays.npz is as a checkpoint writes it: every array stored (a compressed one could
    inflate a thousandfold), each holding what its header declares (a header of terabytes over a few bytes was a
    MemoryError on every restart, not a damaged checkpoint)."""
    with zipfile.ZipFile(path / "arrays.npz") as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"{path}: arrays.npz holds compressed arrays ({info.filename}): not as a "
                                      "checkpoint is written")
            with archive.open(info) as member:
                read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                               (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(member))
                if read_header is None:  # (numpy's load refuses it too, as damaged)
                    continue
                shape, _, dtype = read_header(member)
                declared = member.tell() + math.prod(shape) * dtype.itemsize
            if declared > info.file_size:
                raise CheckpointError(f"{path}: arrays.npz's {info.filename} declares {declared} bytes and holds "
                                      f"{info.file_size}")


def load_checkpoint(path: str | Path, *, verify: bool = True) -> Snapshot:
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    try:
        state = json.loads((path / "state.json").read_text())
        variables: dict[str, np.ndarray] = {}
        slots: dict[str, dict[str, np.ndarray]] = {}
        _check_arrays_file(path)
        with np.load(path / "arrays.npz", allow_pickle=False) as npz:
            for key in npz.files:
                kind, _, name = key.partition(":")
                if kind == "var":
                    variables[name] = npz[key]
                elif kind == "slot":
                    var, _, slot = name.partition("#")
                    slots.setdefault(var, {})[slot] = npz[key]
    except OSError as exc:
        raise _unread(path, "cannot load", exc) from None
    except (ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: cannot load ({exc})") from None
    counters = state.get("sync_counters") or {}
    if not (isinstance(counters, dict) and all(isinstance(counters.get(k), int) for k in SYNC_COUNTERS)):
        counters = {}  # (not what this psctl writes: resumed as from a checkpoint that recorded none)
    return Snapshot(int(state["global_step"]), list(state.get("shard_positions", [])), variables, slots,
                    {k: v for k, v in state.items() if k not in ("global_step", "shard_positions", "sync_counters")},
                    {k: int(counters[k]) for k in SYNC_COUNTERS} if counters else {})


def latest_checkpoint(directory: str | Path) -> tuple[Path, Snapshot] | None:
    """The newest checkpoint that verifies; a corrupt newer one is skipped with a warning."""
    return first_that_loads(reversed(list_checkpoints(directory)), load_checkpoint)


def restorable_checkpoint(directory: str | Path) -> tuple[tuple[Path, Snapshot] | None, list[str]]:
    """The newest checkpoint that verifies, for training to go on from, and what was wrong with each newer one,
    each set aside (``set_aside``). Training goes on from an older step: were they left, a damaged one would
    stand at a step the new run writes again, and newer than every new checkpoint, be what pruning keeps."""
    damaged: list[str] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return (path, load_checkpoint(path)), damaged
        except CheckpointError as exc:
            why = str(exc).removeprefix(f"{path}: ")
            if not exc.damaged:  # (not set aside: the same files may read another time)
                log.warning("skipping checkpoint %s, which cannot be read now: %s", path, why)
                damaged.append(f"{path.name}: {why} (skipped, left as it is)")
                continue
            try:
                damaged.append(f"{path.name}: {why} (now {set_aside(path, exc).name})")
            except OSError as err:  # (a folder that cannot be changed: skipped all the same)
                log.warning("cannot set aside damaged checkpoint %s: %s", path, err)
                damaged.append(f"{path.name}: {why} (left as it is: {err.strerror})")
    return None, damaged


def set_aside(path: Path, why: Exception) -> Path:
    """Rename a checkpoint that did not verify to ``damaged-ckpt-<step>`` (``-2``, ... where taken), beside it;
    the new name."""
    for n in itertools.count(1):
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}{'' if n == 1 else f'-{n}'}")
        if not aside.exists():
            break
    os.rename(path, aside)
    log.warning("set aside damaged checkpoint %s as %s: %s", path, aside.name, why)
    return aside


def first_that_loads(
    newest_first: Iterable[P],
    load: Callable[[P], Snapshot],
    *,
    skip: tuple[type[Exception], ...] = (CheckpointError,),
    where: Callable[[P], str] = str,
) -> tuple[P, Snapshot] | None:
    """The first of ``newest_first`` that ``load`` loads; one that fails with ``skip`` is skipped with a warning
    (a checkpoint cut short by a crash, or corrupted, must not stop a restore from the one before it)."""
    for path in newest_first:
        try:
            return path, load(path)
        except skip as exc:
            said, named, why = str(exc).partition(": ")
            if named and PurePath(said).name == PurePath(str(path)).name:  # (its message names it already)
                said = why
            log.warning("skipping checkpoint %s: %s", where(path), said if named else exc)
    return None


def prune(directory: str | Path, *, max_to_keep: int | None, keep_every_hours: float = 0.0) -> list[Path]:
    """Delete the oldest checkpoints beyond ``max_to_keep``, except one every ``keep_every_hours``."""
    paths = list_checkpoints(directory)
    if not max_to_keep or len(paths) <= max_to_keep:
        return []
    removed = []
    last_kept_time = None
    for path in paths[: len(paths) - max_to_keep]:
        if keep_every_hours > 0:
            try:
                stamp = float(json.loads((path / "state.json").read_text())["time"])
            except (OSError, ValueError, KeyError):
                stamp = 0.0
            if last_kept_time is None or stamp - last_kept_time >= keep_every_hours * 3600:
                last_kept_time = stamp
                continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def export_arrays(snapshot: Snapshot, out: str | Path) -> Path:
    """The trained variables as plain arrays (sharded ones joined), for serving: one ``.npz``. A regular file is
    replaced whole (a link's target: the link stays); anything else that exists (a pipe, ``/dev/stdout``) is
    written into, never replaced."""
    out = Path(out)
    try:
        kind = os.stat(out).st_mode  # (followed as given: /dev/stdout to a pipe has no path of its own)
    except FileNotFoundError:
        kind = None
    if kind is not None and not stat.S_ISREG(kind):
        with open(out, "wb") as f:
            np.savez(f, **snapshot.variables)  # type: ignore[arg-type]
        return out
    out = Path(os.path.realpath(out))  # a link's target is replaced, the link stays
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_temporary(out)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **snapshot.variables)  # type: ignore[arg-type]
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a disk that filled up keeps no half-written file)
        raise
    return out


class Checkpointer:
    """When to save, and saving in the background so training waits only for the snapshot."""

    def __init__(self, config: Mapping[str, Any], *, get_time: Any = time.monotonic) -> None:
        self.directory = Path(str(config["dir"])).expanduser()
        self.every_steps = int(config.get("every_steps") or 0)
        self.every_seconds = float(config.get("every_seconds") or 0)
        self.max_to_keep = config.get("max_to_keep")
        self.keep_every_hours = float(config.get("keep_every_hours") or 0)
        self._time = get_time
        self._last_step = 0
        self._last_time = get_time()
        self._writer: threading.Thread | None = None
        self.latest: Path | None = None
        self.saved = 0
        #: Saves that failed (a full disk, a folder that cannot be written), and the last one's error: the
        #: result says so, since a run whose checkpoints all failed loses its model with its ps.
        self.failed = 0
        self.last_error: str | None = None

    def mark(self, global_step: int) -> None:
        """Count the interval from ``global_step`` (after a restore or resume), not from an earlier save."""
        self.wait()
        self._last_step, self._last_time = global_step, self._time()

    def next_due_step(self) -> int | None:
        """The global step at which the next checkpoint by steps falls due (None: checkpoints by time only)."""
        return self._last_step + self.every_steps if self.every_steps else None

    def due(self, global_step: int) -> bool:
        if self.every_steps and global_step - self._last_step >= self.every_steps:
            return True
        return bool(self.every_seconds) and self._time() - self._last_time >= self.every_seconds

    def save_async(self, snapshot: Snapshot) -> None:
        self.wait()
        self._last_step, self._last_time = snapshot.global_step, self._time()
        self._writer = threading.Thread(target=self._write, args=(snapshot,), name="checkpoint", daemon=True)
        self._writer.start()

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        try:
            existed = checkpoint_path(self.directory, snapshot.global_step).exists()
            self.latest = write_checkpoint(self.directory, snapshot)
            if existed:
                return
            self.saved += 1
            prune(self.directory, max_to_keep=self.max_to_keep, keep_every_hours=self.keep_every_hours)
            log.info("checkpoint %s written in %.2fs", self.latest, time.monotonic() - started)
        except OSError as exc:
            log.error("checkpoint at step %d failed: %s", snapshot.global_step, exc)
            self.failed += 1
            self.last_error = f"step {snapshot.global_step}: {exc}"

    def wait(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None

"""Checkpoints: the files (atomic, checksummed, never overwritten, pruned), and restoring them into parameter
servers with another number of ps and another partitioning, optimizer slots included.

The restore tests run real PS servers (VariableStore behind gRPC on loopback, in this process) and push real
gradients of a real program through PsClient, so the optimizer slots being checkpointed are the ones training
produces.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.checkpoint import (
    ABANDONED_AFTER,
    DAMAGED_PREFIX,
    PREFIX,
    Checkpointer,
    CheckpointError,
    Snapshot,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune,
    reshard_onto,
    restorable_checkpoint,
    restore_snapshot,
    take_snapshot,
    verify_checkpoint,
    write_checkpoint,
)
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import Program, ProgramRef, load_program
from psctl.runtime.ps import ParameterServerServicer, VariableStore
from psctl.runtime.ps_client import PsClient, PushHeader, sync_counters
from psctl.runtime.rpc import make_server
from psctl.runtime.wire import DENSE, SLOT, Entry

CLUSTER = "ckpt-test"


# -- checkpoint files -----------------------------------------------------------------------------------------
def sample_snapshot(step: int, *, scale: float = 1.0) -> Snapshot:
    """Variables of several dtypes and ranks (a 0-d one included) and optimizer slots (0-d ``t`` included)."""
    rng = np.random.default_rng(step)
    kernel = (rng.standard_normal((5, 3)) * scale).astype(np.float32)
    return Snapshot(
        global_step=step,
        shard_positions=[step // 2, -1, step // 3],
        variables={
            "dense/kernel": kernel,
            "dense/bias": rng.standard_normal(3).astype(np.float64),
            "scalar": np.asarray(rng.standard_normal(), dtype=np.float32),
        },
        slots={
            "dense/kernel": {
                "m": rng.standard_normal((5, 3)).astype(np.float32),
                "v": rng.random((5, 3)).astype(np.float32),
                "t": np.asarray(step + 7, dtype=np.int64),
            },
            "dense/bias": {"accum": rng.random(3).astype(np.float64)},
            "scalar": {"t": np.asarray(3, dtype=np.int64)},
        },
        meta={"optimizer": {"name": "adam", "learning_rate": 0.01}, "program": "psctl.models.mlp"},
    )


def assert_snapshots_equal(got: Snapshot, want: Snapshot) -> None:
    """Exactly equal: same names, dtypes, shapes (0-d stays 0-d) and values; same step and positions."""
    assert got.global_step == want.global_step
    assert list(got.shard_positions) == list(want.shard_positions)
    assert sorted(got.variables) == sorted(want.variables)
    for name, value in want.variables.items():
        assert got.variables[name].dtype == value.dtype, name
        assert got.variables[name].shape == value.shape, name
        assert np.array_equal(got.variables[name], value), name
    assert sorted(k for k, v in got.slots.items() if v) == sorted(k for k, v in want.slots.items() if v)
    for name, slots in want.slots.items():
        assert sorted(got.slots.get(name, {})) == sorted(slots), name
        for slot, value in slots.items():
            mine = got.slots[name][slot]
            assert mine.dtype == value.dtype, f"{name}#{slot}"
            assert mine.shape == value.shape, f"{name}#{slot}"
            assert np.array_equal(mine, value), f"{name}#{slot}"


def leftover_temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def test_write_and_load_round_trip(tmp_path: Path) -> None:
    snapshot = sample_snapshot(1234)
    path = write_checkpoint(tmp_path / "ckpts", snapshot)

    assert path == tmp_path / "ckpts" / f"{PREFIX}000000001234"
    assert path == checkpoint_path(tmp_path / "ckpts", 1234)
    assert sorted(p.name for p in path.iterdir()) == ["arrays.npz", "manifest.json", "state.json"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["global_step"] == 1234
    assert sorted(manifest["files"]) == ["arrays.npz", "state.json"]
    for name, info in manifest["files"].items():
        assert info["bytes"] == (path / name).stat().st_size
        assert len(info["sha256"]) == 64
    verify_checkpoint(path)
    assert leftover_temporaries(tmp_path / "ckpts") == []

    loaded = load_checkpoint(path)
    assert_snapshots_equal(loaded, snapshot)
    assert loaded.slots["dense/kernel"]["t"].ndim == 0
    assert loaded.slots["scalar"]["t"].ndim == 0
    assert loaded.variables["scalar"].ndim == 0
    assert loaded.meta["optimizer"] == snapshot.meta["optimizer"]
    assert loaded.meta["program"] == "psctl.models.mlp"
    assert list_checkpoints(tmp_path / "ckpts") == [path]
    found = latest_checkpoint(tmp_path / "ckpts")
    assert found is not None and found[0] == path


def test_a_second_write_at_the_same_step_does_not_overwrite(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    first = write_checkpoint(directory, sample_snapshot(50))
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in first.iterdir()}
    folder_mtime = first.stat().st_mtime_ns

    other = sample_snapshot(50, scale=100.0)  # same global step, different values
    assert not np.array_equal(other.variables["dense/kernel"], sample_snapshot(50).variables["dense/kernel"])
    again = write_checkpoint(directory, other)

    assert again == first
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in first.iterdir()} == before
    assert first.stat().st_mtime_ns == folder_mtime
    assert_snapshots_equal(load_checkpoint(first), sample_snapshot(50))
    assert list_checkpoints(directory) == [first]
    assert leftover_temporaries(directory) == []


def _truncate(path: Path) -> None:
    data = (path / "arrays.npz").read_bytes()
    (path / "arrays.npz").write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray((path / "arrays.npz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "arrays.npz").write_bytes(bytes(data))


def _drop_manifest(path: Path) -> None:
    (path / "manifest.json").unlink()  # a crash after the data but before the manifest


@pytest.mark.parametrize(
    "corrupt", [_truncate, _flip_byte, _drop_manifest], ids=["truncated", "flipped", "no-manifest"]
)
def test_latest_skips_a_corrupt_newest_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Callable[[Path], None]
) -> None:
    directory = tmp_path / "ckpts"
    older = write_checkpoint(directory, sample_snapshot(100))
    newest = write_checkpoint(directory, sample_snapshot(200))
    size = (newest / "arrays.npz").stat().st_size
    corrupt(newest)
    if corrupt is _flip_byte:
        assert (newest / "arrays.npz").stat().st_size == size  # only the checksum can tell

    with pytest.raises(CheckpointError):
        verify_checkpoint(newest)
    with pytest.raises(CheckpointError):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="psctl.checkpoint"):
        found = latest_checkpoint(directory)

    assert found is not None
    path, snapshot = found
    assert path == older
    assert_snapshots_equal(snapshot, sample_snapshot(100))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "psctl.checkpoint"]
    assert len(warnings) == 1, caplog.text
    assert newest.name in warnings[0].getMessage()
    assert "skipping" in warnings[0].getMessage()


def test_latest_is_none_when_every_checkpoint_is_corrupt_and_ignores_temporaries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ckpts"
    assert latest_checkpoint(directory) is None  # no folder at all
    only = write_checkpoint(directory, sample_snapshot(10))
    # a writer that crashed mid-write leaves its temporary folder: never listed, never loaded
    crashed = directory / f".tmp-{PREFIX}000000000020-999-1"
    crashed.mkdir()
    (crashed / "arrays.npz").write_bytes(b"partial")
    assert list_checkpoints(directory) == [only]
    found = latest_checkpoint(directory)
    assert found is not None and found[0] == only

    _truncate(only)
    with caplog.at_level(logging.WARNING, logger="psctl.checkpoint"):
        assert latest_checkpoint(directory) is None
    assert only.name in caplog.text


def test_a_write_removes_only_this_hosts_abandoned_temporaries(tmp_path: Path) -> None:
    """On storage several hosts share, another host's chief (or a live process here) may be writing: only
    temporaries of this host's dead processes are abandoned."""
    directory = tmp_path / "ckpts"
    directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    host = socket.gethostname().replace("-", "_")
    abandoned = directory / f".tmp-{PREFIX}000000000020-{host}-{dead}-1"
    writing_here = directory / f".tmp-{PREFIX}000000000030-{host}-{os.getpid()}-1"
    writing_elsewhere = directory / f".tmp-{PREFIX}000000000030-otherhost-{dead}-1"
    abandoned_elsewhere = directory / f".tmp-{PREFIX}000000000010-otherhost-{dead}-1"
    for folder in (abandoned, writing_here, writing_elsewhere, abandoned_elsewhere):
        folder.mkdir()
    day_ago = time.time() - ABANDONED_AFTER - 60
    os.utime(abandoned_elsewhere, (day_ago, day_ago))  # its host crashed long ago
    write_checkpoint(directory, sample_snapshot(40))
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [checkpoint_path(directory, 40).name, writing_here.name, writing_elsewhere.name])


def test_a_failed_write_leaves_no_temporary_behind(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    broken = sample_snapshot(50)
    broken.meta = {"not json": object()}  # fails after the arrays are on disk
    with pytest.raises(TypeError):
        write_checkpoint(directory, broken)
    assert leftover_temporaries(directory) == [] and list_checkpoints(directory) == []


@pytest.mark.parametrize("corrupt", [_truncate, _drop_manifest], ids=["truncated", "no-manifest"])
def test_a_damaged_checkpoint_at_the_step_a_write_comes_to_is_set_aside_and_written_anew(
    tmp_path: Path, corrupt: Callable[[Path], None]
) -> None:
    """A run that resumed before an earlier run's damaged checkpoints reaches their steps again: "never
    overwrite" kept the damaged one and reported it as the run's checkpoint (`export` then found none). (A write
    checks the files' sizes, not their checksums: a stop's checkpoint must not read gigabytes first; one whose
    bytes changed is set aside when a restore reads it.)"""
    directory = tmp_path / "ckpts"
    damaged = write_checkpoint(directory, sample_snapshot(50, scale=100.0))
    corrupt(damaged)
    written = write_checkpoint(directory, sample_snapshot(50))
    assert written == damaged and list_checkpoints(directory) == [written]
    assert_snapshots_equal(load_checkpoint(written), sample_snapshot(50))
    aside = directory / f"{DAMAGED_PREFIX}{written.name}"
    assert aside.is_dir() and (aside / "arrays.npz").is_file()  # kept to look at, out of the listing
    corrupt(written)
    write_checkpoint(directory, sample_snapshot(50))  # a second damaged one at that step: its own name
    assert (directory / f"{DAMAGED_PREFIX}{written.name}-2").is_dir()
    assert_snapshots_equal(load_checkpoint(written), sample_snapshot(50))
    assert leftover_temporaries(directory) == []


def test_damaged_checkpoints_newer_than_the_one_restored_are_set_aside_and_not_kept_by_pruning(
    tmp_path: Path,
) -> None:
    """The newest checkpoint that verifies is restored; each newer one that does not is renamed out of the
    listing with what was wrong. Left there, they outranked every checkpoint the run went on to write: pruning
    by step deleted each new one (and with every one damaged, the run kept nothing)."""
    directory = tmp_path / "ckpts"
    good = write_checkpoint(directory, sample_snapshot(100))
    for step in (200, 300):
        _truncate(write_checkpoint(directory, sample_snapshot(step)))
    bogus = directory / f"{PREFIX}000000900001"
    bogus.mkdir()  # not a checkpoint's files at all
    found, damaged = restorable_checkpoint(directory)
    assert found is not None and found[0] == good
    assert_snapshots_equal(found[1], sample_snapshot(100))
    assert [d.split(":")[0] for d in damaged] == [f"{PREFIX}000000900001", f"{PREFIX}000000000300",
                                                  f"{PREFIX}000000000200"]
    assert "arrays.npz is missing or truncated" in damaged[1] and damaged[1].endswith(
        f"(now {DAMAGED_PREFIX}{PREFIX}000000000300)")
    assert list_checkpoints(directory) == [good]
    new = [write_checkpoint(directory, sample_snapshot(step)) for step in (150, 200, 250)]
    prune(directory, max_to_keep=2)
    assert list_checkpoints(directory) == new[1:]  # the run's own newest, where the damaged ones were kept before
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(DAMAGED_PREFIX)) == [
        f"{DAMAGED_PREFIX}{PREFIX}000000000200", f"{DAMAGED_PREFIX}{PREFIX}000000000300",
        f"{DAMAGED_PREFIX}{PREFIX}000000900001"]
    for path in new[1:]:
        _truncate(path)
    assert restorable_checkpoint(directory)[0] is None  # nothing verifies: none to restore, each set aside
    assert list_checkpoints(directory) == []


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    paths = [write_checkpoint(directory, sample_snapshot(step)) for step in (5, 10, 15, 20, 25)]

    assert prune(directory, max_to_keep=None) == []
    assert prune(directory, max_to_keep=5) == []
    assert list_checkpoints(directory) == paths

    removed = prune(directory, max_to_keep=2)
    assert removed == paths[:3]
    assert list_checkpoints(directory) == paths[3:]
    assert all(not p.exists() for p in paths[:3])
    assert latest_checkpoint(directory) is not None
    assert_snapshots_equal(load_checkpoint(paths[4]), sample_snapshot(25))


def test_prune_keeps_one_checkpoint_every_keep_every_hours(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    hours = {1: 0.0, 2: 0.5, 3: 1.1, 4: 1.2, 5: 1.3}
    paths = {}
    for step, at in hours.items():
        snapshot = sample_snapshot(step)
        snapshot.meta = {"time": 1_000_000.0 + at * 3600}  # the save time state.json records
        paths[step] = write_checkpoint(directory, snapshot)
    removed = prune(directory, max_to_keep=1, keep_every_hours=1.0)
    # kept: the first, the first at least an hour after it, and the newest
    assert removed == [paths[2], paths[4]]
    assert list_checkpoints(directory) == [paths[1], paths[3], paths[5]]


def test_checkpointer_saves_when_due_in_the_background_and_prunes(tmp_path: Path) -> None:
    now = [0.0]
    ckpt = Checkpointer({"dir": str(tmp_path / "ckpts"), "every_steps": 10, "every_seconds": 30.0, "max_to_keep": 2},
                        get_time=lambda: now[0])
    assert not ckpt.due(9)
    assert ckpt.due(10)
    for step in (10, 20, 30):
        ckpt.save_async(sample_snapshot(step))
    ckpt.wait()
    assert ckpt.saved == 3
    assert ckpt.latest == checkpoint_path(tmp_path / "ckpts", 30)
    assert [p.name for p in list_checkpoints(tmp_path / "ckpts")] == [f"{PREFIX}000000000020", f"{PREFIX}000000000030"]
    assert not ckpt.due(39)
    assert ckpt.due(40)
    now[0] = 31.0  # every_seconds elapsed since the last save: due whatever the step
    assert ckpt.due(31)


# -- restoring into real parameter servers ------------------------------------------------------------------
@dataclass
class PsGroup:
    stores: list[VariableStore]
    client: PsClient


class PsServers:
    """In-process PS servers on loopback; every one started is stopped by the fixture."""

    def __init__(self) -> None:
        self.servers: list[grpc.Server] = []
        self.clients: list[PsClient] = []

    def start(self, count: int) -> PsGroup:
        stores, addresses = [], []
        for _ in range(count):
            store = VariableStore(cluster_id=CLUSTER)
            server, port = make_server("127.0.0.1:0")
            pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(store), server)
            server.start()
            self.servers.append(server)
            stores.append(store)
            addresses.append(f"127.0.0.1:{port}")
        client = PsClient(addresses, timeout=30)
        self.clients.append(client)
        return PsGroup(stores, client)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.stop(grace=None).wait()


@pytest.fixture
def ps_servers() -> Iterator[PsServers]:
    servers = PsServers()
    try:
        yield servers
    finally:
        servers.stop()


ADAM = pb.OptimizerConfig(name="adam", learning_rate=0.05)
ADAGRAD = pb.OptimizerConfig(name="adagrad", learning_rate=0.1)
SEED = 3


@pytest.fixture(scope="module")
def program() -> Program:
    """A sparse embedding table (50 rows) plus dense head variables, on small synthetic id data."""
    data = {"name": "synthetic_embedding", "num_examples": 400, "vocab_size": 50, "ids_per_example": 4}
    return load_program(ProgramRef("psctl.models.wide_embedding", {"dim": 4}, data, SEED))


def make_model(program: Program, num_ps: int, partitioner: dict[str, Any] | None) -> ShardedModel:
    return ShardedModel(program, num_ps, partitioner)


def init_group(group: PsGroup, model: ShardedModel, optimizer: pb.OptimizerConfig) -> None:
    replies = group.client.init(model.shard_specs(SEED), optimizer, CLUSTER)
    assert not any(r.already_initialized for r in replies)


def train_steps(group: PsGroup, model: ShardedModel, steps: int, *, num_shards: int = 2, batch: int = 16) -> None:
    """What workers do: pull the rows a batch needs, compute real gradients, push them (sparse and dense)."""
    program = model.program
    for step in range(steps):
        shard = step % num_shards
        position = step // num_shards
        data = program.dataset("train", shard, num_shards).batch(position, batch)
        ids = program.embedding_ids(data)
        plan = model.pull_plan(ids)
        pulled, _ = group.client.pull(plan, model.pull_bytes(plan))
        _loss, grads = program.loss_and_grads(model.assemble(ids, pulled), data)
        header = PushHeader(step_id=step + 1, task=f"worker:{shard}", incarnation=1, shard=shard, position=position)
        responses = group.client.push(header, model.push_plan(grads))
        assert all(r.applied for r in responses.values())


def shard_names(model: ShardedModel) -> set[str]:
    return {s.name for layout in model.layouts.values() for s in layout.shards}


def fixed(n: int) -> dict[str, Any]:
    return {"kind": "fixed", "num_shards": n}


LAYOUTS = [
    # (ps before, partitioner before, ps after, partitioner after, optimizer)
    pytest.param(3, fixed(3), 2, fixed(2), ADAM, id="3ps-3shards-to-2ps-2shards-adam"),
    pytest.param(3, fixed(3), 2, None, ADAM, id="3ps-3shards-to-2ps-unpartitioned-adam"),
    pytest.param(3, fixed(3), 1, None, ADAGRAD, id="3ps-3shards-to-1ps-adagrad"),
    pytest.param(1, None, 4, fixed(4), ADAM, id="1ps-to-4ps-4shards-adam"),
    pytest.param(1, None, 2, fixed(4), ADAGRAD, id="1ps-to-2ps-4shards-adagrad"),
]


@pytest.mark.parametrize(("ps_before", "part_before", "ps_after", "part_after", "optimizer"), LAYOUTS)
def test_restore_into_another_layout_keeps_variables_and_slots_exactly(
    tmp_path: Path,
    ps_servers: PsServers,
    program: Program,
    ps_before: int,
    part_before: dict[str, Any] | None,
    ps_after: int,
    part_after: dict[str, Any] | None,
    optimizer: pb.OptimizerConfig,
) -> None:
    source_model = make_model(program, ps_before, part_before)
    source = ps_servers.start(ps_before)
    init_group(source, source_model, optimizer)
    initial = take_snapshot(source_model, source.client)
    train_steps(source, source_model, 7)
    original = take_snapshot(source_model, source.client)

    # the updates were real: every variable moved, and every slot holds optimizer state
    assert original.global_step == 7
    assert original.shard_positions == [3, 2]  # shard 0 consumed positions 0..3, shard 1 0..2
    slot_names = {"m", "v", "t"} if optimizer is ADAM else {"accum"}
    for name in original.variables:
        assert not np.array_equal(original.variables[name], initial.variables[name]), name
        assert set(original.slots[name]) == slot_names, name
        for slot, value in original.slots[name].items():
            assert not np.array_equal(value, initial.slots[name][slot]), f"{name}#{slot}"
    if optimizer is ADAM:
        assert original.slots["head/kernel"]["t"].ndim == 0
        assert int(original.slots["head/kernel"]["t"]) == 7

    path = write_checkpoint(tmp_path / "ckpts", original)
    loaded = load_checkpoint(path)
    assert_snapshots_equal(loaded, original)

    target_model = make_model(program, ps_after, part_after)
    assert shard_names(target_model) != shard_names(source_model)  # really another layout
    target = ps_servers.start(ps_after)
    init_group(target, target_model, optimizer)
    restore_snapshot(target_model, target.client, loaded)

    # each shard on each PS holds exactly its rows of the checkpoint, slots likewise (read in-process)
    for layout in target_model.layouts.values():
        name = layout.variable.name
        for shard in layout.shards:
            held = target.stores[shard.ps]._shards[shard.name]
            rows = slice(shard.row_offset, shard.row_offset + shard.shape[0])
            want = original.variables[name] if not layout.partitioned else original.variables[name][rows]
            assert np.array_equal(held.value, want), shard.name
            for slot, value in original.slots[name].items():
                want_slot = value if value.ndim == 0 or not layout.partitioned else value[rows]
                assert held.slots[slot].shape == want_slot.shape, f"{shard.name}#{slot}"
                assert np.array_equal(held.slots[slot], want_slot), f"{shard.name}#{slot}"

    restored = take_snapshot(target_model, target.client)
    assert_snapshots_equal(restored, original)
    state = target.client.state(0)
    assert state.global_step == 7
    assert list(state.shard_positions) == [3, 2]

    # and training goes on from there: the restored PS accept and apply updates in the new layout
    train_steps(target, target_model, 1)
    assert target.client.state(0).global_step == 8


def test_adam_s_step_count_is_the_steps_taken_whichever_shards_they_touched_and_a_restore_keeps_it(
    ps_servers: PsServers, program: Program
) -> None:
    """Shards of an embedding see different batches, and Adam's ``t`` counts the optimizer's steps (TF's
    ``iterations``), not each shard's: the checkpoint holds the steps taken, and a restore into another layout
    gives every PS that count."""
    source_model = make_model(program, 3, fixed(3))
    source = ps_servers.start(3)
    init_group(source, source_model, ADAM)
    steps = 6
    train_steps(source, source_model, steps, batch=1)  # 4 ids a step: some steps leave a shard untouched
    snapshot = take_snapshot(source_model, source.client)
    assert int(snapshot.slots["emb/table"]["t"]) == steps
    assert [store.optimizer_steps for store in source.stores] == [steps] * 3

    target_model = make_model(program, 2, fixed(2))
    target = ps_servers.start(2)
    init_group(target, target_model, ADAM)
    restore_snapshot(target_model, target.client, snapshot)
    assert [store.optimizer_steps for store in target.stores] == [steps] * 2
    assert int(take_snapshot(target_model, target.client).slots["emb/table"]["t"]) == steps


def test_ps_whose_step_counts_differ_checkpoint_and_reshard_one_count(ps_servers: PsServers,
                                                                        program: Program) -> None:
    """Each PS counts the optimizer's steps for its variables; two that differ (one applied a step the other
    never will, a worker lost mid-push; a restore of an older checkpoint's counts per variable) are saved with
    the most advanced count for every variable, and a reshard onto one ps reads back what it assigned (it failed:
    the ps took the larger count for all its variables, which no longer matched the snapshot)."""
    model = make_model(program, 2, fixed(2))
    group = ps_servers.start(2)
    init_group(group, model, ADAM)
    train_steps(group, model, 3, batch=1)
    group.stores[1].optimizer_steps += 4  # (as if it had applied steps the other never will)
    snapshot = take_snapshot(model, group.client)
    assert {name: int(slots["t"]) for name, slots in snapshot.slots.items()} == dict.fromkeys(snapshot.slots, 7)
    one = make_model(program, 1, fixed(2))
    target = ps_servers.start(1)
    init_group(target, one, ADAM)
    reshard_onto(snapshot, one, target.client, seed=SEED, optimizer=ADAM, cluster_id=CLUSTER)
    assert target.stores[0].optimizer_steps == 7
    older = take_snapshot(model, group.client)  # a checkpoint of an older psctl: one count per variable
    older.slots["emb/table"]["t"] = np.asarray(2, dtype=np.int64)
    restore_snapshot(model, group.client, older)
    assert [store.optimizer_steps for store in group.stores] == [7, 7]


def test_restore_refuses_a_checkpoint_of_another_model(
    ps_servers: PsServers, program: Program
) -> None:
    model = make_model(program, 2, fixed(2))
    group = ps_servers.start(2)
    init_group(group, model, ADAM)
    train_steps(group, model, 2)
    before = take_snapshot(model, group.client)

    missing = take_snapshot(model, group.client)
    del missing.variables["head/bias"]
    with pytest.raises(CheckpointError, match="head/bias"):
        restore_snapshot(model, group.client, missing)
    reshaped = take_snapshot(model, group.client)
    reshaped.variables["emb/table"] = reshaped.variables["emb/table"][:10]
    with pytest.raises(CheckpointError, match="emb/table"):
        restore_snapshot(model, group.client, reshaped)
    assert_snapshots_equal(take_snapshot(model, group.client), before)


# -- refused assigns ----------------------------------------------------------------------------------------
def full_assign(model: ShardedModel, snapshot: Snapshot) -> list[Entry]:
    """A complete, valid assign for a single-PS model: every variable and every slot."""
    entries = []
    for name, value in snapshot.variables.items():
        entries.append(Entry(name, DENSE, np.ascontiguousarray(value)))
        for slot, array in snapshot.slots[name].items():
            entries.append(Entry(f"{name}#{slot}", SLOT, np.require(array, requirements="C")))
    return entries


def _without(name: str) -> Callable[[list[Entry]], list[Entry]]:
    return lambda entries: [e for e in entries if e.name != name]


def _replace(name: str, make: Callable[[np.ndarray], np.ndarray]) -> Callable[[list[Entry]], list[Entry]]:
    return lambda entries: [Entry(e.name, e.kind, make(e.array)) if e.name == name else e for e in entries]


BAD_ASSIGNS = [
    pytest.param(_without("head/kernel#m"), "missing", id="missing-slot"),
    pytest.param(_without("head/bias#t"), "missing", id="missing-scalar-slot"),
    pytest.param(_without("emb/table"), "missing", id="missing-variable"),
    pytest.param(_replace("emb/table#v", lambda a: np.zeros((a.shape[0], a.shape[1] + 1), a.dtype)), "expected",
                 id="slot-wrong-shape"),
    pytest.param(_replace("head/kernel#t", lambda a: np.zeros(1, np.int64)), "expected", id="0d-slot-made-1d"),
    pytest.param(_replace("head/kernel#m", lambda a: a.astype(np.float64)), "expected", id="slot-wrong-dtype"),
    pytest.param(_replace("head/kernel", lambda a: np.zeros((a.shape[0] + 1, a.shape[1]), a.dtype)), "shape",
                 id="variable-wrong-shape"),
    pytest.param(lambda entries: [*entries, Entry("head/kernel#accum", SLOT, np.zeros((4, 1), np.float32))],
                 "no optimizer slot", id="unknown-slot"),
    pytest.param(_replace("head/bias", lambda a: np.full_like(a, np.nan)), "NaN", id="non-finite"),
]


@pytest.mark.parametrize(("corrupt", "message"), BAD_ASSIGNS)
def test_a_bad_assign_is_refused_and_changes_nothing(
    ps_servers: PsServers, program: Program, corrupt: Callable[[list[Entry]], list[Entry]], message: str
) -> None:
    model = make_model(program, 1, None)
    group = ps_servers.start(1)
    init_group(group, model, ADAM)
    train_steps(group, model, 3)
    before = take_snapshot(model, group.client)
    state_before = group.client.state(0, include_step_ids=True)

    # a valid assign of other values would change the PS: the refusal below is what keeps it as it was
    other = take_snapshot(model, group.client)
    for value in other.variables.values():
        value += 1
    entries = corrupt(full_assign(model, other))
    with pytest.raises(grpc.RpcError) as info:
        group.client.assign({0: entries}, 999, [50, 60])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert message in (info.value.details() or "")  # type: ignore[attr-defined]

    assert_snapshots_equal(take_snapshot(model, group.client), before)
    state_after = group.client.state(0, include_step_ids=True)
    assert state_after.global_step == state_before.global_step == 3
    assert list(state_after.shard_positions) == list(state_before.shard_positions)
    assert list(state_after.applied_step_ids) == list(state_before.applied_step_ids)

    # the same assign, whole and valid, is accepted: the refusal was for the defect alone
    group.client.assign({0: full_assign(model, other)}, 999, [50, 60])
    after = take_snapshot(model, group.client)
    assert after.global_step == 999
    assert after.shard_positions == [50, 60]
    assert np.array_equal(after.variables["head/kernel"], other.variables["head/kernel"])


def test_an_assign_of_negative_synchronous_counters_is_refused_and_changes_nothing(
        ps_servers: PsServers, program: Program) -> None:
    model = make_model(program, 1, None)
    group = ps_servers.start(1)
    init_group(group, model, ADAM)
    train_steps(group, model, 3)
    before = take_snapshot(model, group.client)
    with pytest.raises(grpc.RpcError) as info:
        group.client.assign({0: full_assign(model, before)}, 999, [50, 60],
                            {"gradients_applied": 10, "stale_dropped": -1, "timed_out_steps": 0})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "synchronous counters must be >= 0" in (info.value.details() or "")  # type: ignore[attr-defined]
    after = take_snapshot(model, group.client)
    assert (after.global_step, after.sync_counters) == (3, before.sync_counters)


def test_restore_with_a_slot_missing_from_the_checkpoint_is_refused(
    ps_servers: PsServers, program: Program
) -> None:
    model = make_model(program, 1, None)
    group = ps_servers.start(1)
    init_group(group, model, ADAM)
    train_steps(group, model, 2)
    before = take_snapshot(model, group.client)
    broken = take_snapshot(model, group.client)
    del broken.slots["emb/table"]["v"]
    with pytest.raises(CheckpointError, match=r"the ps refused it: .*missing \['v'\]"):  # (their INVALID_ARGUMENT)
        restore_snapshot(model, group.client, broken)
    assert_snapshots_equal(take_snapshot(model, group.client), before)


def test_checkpoints_are_listed_in_step_order(tmp_path: Path) -> None:
    """Folder names sort in step order (zero padded), so the newest is always last, even past 10^9 steps."""
    directory = tmp_path / "ckpts"
    steps = [9, 10, 99, 100, 1_000_000_001]
    for step in reversed(steps):
        write_checkpoint(directory, sample_snapshot(step))
    assert [load_checkpoint(p).global_step for p in list_checkpoints(directory)] == steps
    assert leftover_temporaries(directory) == []


def _rewritten(path: Path, name: str, data: bytes, *, files: dict[str, Any] | None = None) -> None:
    """``name`` in the checkpoint at ``path`` replaced by ``data``, its manifest made to match (as whoever can
    write the folder could)."""
    import hashlib

    (path / name).write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["files"].update(files or {})
    (path / "manifest.json").write_text(json.dumps(manifest))


def _npz(members: dict[str, bytes], compression: int) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


def test_a_checkpoint_that_would_inflate_or_names_other_files_is_damaged_not_loaded(tmp_path: Path) -> None:
    """Whoever can write a checkpoint folder (shared storage; a host `export` copies from): an array whose header
    declares terabytes crashed the chief with a MemoryError on every restart (not set aside as damaged); compressed
    arrays inflated a thousandfold; a manifest naming ../../etc/hostname had that file read and hashed. (An array
    that holds what it declares, too large for the memory free now, is no damage: that MemoryError is the
    chief's, restarted, its checkpoints kept.)"""
    import hashlib
    import io
    import zipfile

    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1099511627776,), }"
    huge = b"\x93NUMPY\x01\x00" + (len(header) + 1).to_bytes(2, "little") + header + b"\n" + bytes(64)
    plain = io.BytesIO()
    np.save(plain, np.zeros(100_000, np.float32))
    outside = tmp_path / "outside"
    outside.write_bytes(b"not a checkpoint's")
    cases: dict[str, tuple[str, bytes, dict[str, Any]]] = {
        "declares 8796093022288 bytes and holds 144": ("arrays.npz", _npz({"var:x.npy": huge}, zipfile.ZIP_STORED),
                                                        {}),
        "compressed arrays": ("arrays.npz", _npz({"var:x.npy": plain.getvalue()}, zipfile.ZIP_DEFLATED), {}),
        "the manifest names": ("state.json", b"{}", {"../../../outside": {
            "sha256": hashlib.sha256(outside.read_bytes()).hexdigest(), "bytes": outside.stat().st_size}}),
    }
    for said, (name, data, files) in cases.items():
        folder = tmp_path / said.replace(" ", "-")
        path = write_checkpoint(folder, sample_snapshot(10))
        _rewritten(path, name, data, files=files)
        with pytest.raises(CheckpointError, match=said) as caught:
            load_checkpoint(path)
        assert caught.value.damaged, said
        found, damaged = restorable_checkpoint(folder)  # a resume sets it aside, and goes on without it
        assert found is None and len(damaged) == 1 and said in damaged[0], damaged


def test_export_and_state_writes_follow_no_link_planted_at_a_temporary_name(tmp_path: Path) -> None:
    """They wrote `model.npz.tmp` (and `.state.json.HOST.PID.tmp`), names known in advance: another user of a
    shared folder could plant a link there, and the write went through it into a file of the user's."""
    from psctl.runtime.atomic import write_json_atomic
    from psctl.runtime.checkpoint import export_arrays

    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    out = tmp_path / "model.npz"
    (tmp_path / "model.npz.tmp").symlink_to(victim)
    state = tmp_path / "state.json"
    (tmp_path / f".state.json.{socket.gethostname()}.{os.getpid()}.tmp").symlink_to(victim)
    export_arrays(sample_snapshot(10), out)
    write_json_atomic(state, {"x": 1})
    assert victim.read_bytes() == b"mine"
    with np.load(out) as arrays:
        assert sorted(arrays.files) == sorted(sample_snapshot(10).variables)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # (owner-only, as psctl writes every file: umask 077)
    assert json.loads(state.read_text()) == {"x": 1} and stat.S_IMODE(state.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".tmp" and not p.is_symlink()) == []


# -- the chief's resume ---------------------------------------------------------------------------------------
def resuming_chief(tmp_path: Path, addresses: list[str], training: str = "") -> Any:
    """A chief of the digits MLP over the ps at ``addresses``, checkpointing into tmp_path/ckpts (not run: its
    resume, ``_init_or_restore``, is what is driven); ``training``: more keys of the spec's training."""
    from psctl.runtime.chief import Chief
    from psctl.runtime.cluster import ClusterInfo
    from psctl.spec import load_spec_text

    training = training or "mode: async"
    spec = load_spec_text(
        "roles: {chief: {}, ps: {replicas: 2}, worker: {replicas: 2}}\n"
        f"training: {{program: psctl.models.mlp, data: {{name: digits}}, steps: 1000, {training},\n"
        f"           checkpoint: {{dir: {tmp_path / 'ckpts'}, every_steps: 100}}}}\n",
        filename=str(tmp_path / "spec.yaml"))
    info = ClusterInfo({"chief": ["127.0.0.1:1"], "ps": addresses, "worker": ["127.0.0.1:2", "127.0.0.1:3"]},
                       "chief", 0,
                       cluster_id=CLUSTER, training=dict(spec.training), run_dir=str(tmp_path / "run"))
    return Chief(info)


def test_a_chief_that_died_before_restoring_into_the_ps_is_followed_by_one_that_restores(
        tmp_path: Path, ps_servers: PsServers) -> None:
    """A chief sets the ps up (initializers, global step 0), then restores the checkpoint into them: one that
    died in between left ps that count as set up. Its successor restores the checkpoint, ahead of them, rather
    than train again from step 0 (and write its checkpoints over the run it lost)."""
    group = ps_servers.start(2)
    first = resuming_chief(tmp_path, group.client.addresses)
    try:
        first._init_or_restore()  # the ps at their initializers, at global step 0
        snapshot = take_snapshot(first.model, first.ps)
        snapshot.global_step, snapshot.shard_positions = 300, [149, 149]
        write_checkpoint(tmp_path / "ckpts", snapshot)  # (the run before's: the first chief died right here)
    finally:
        first.close()
    second = resuming_chief(tmp_path, group.client.addresses)
    try:
        second._init_or_restore()
        assert (second.ps.state(0).global_step, list(second.ps.state(0).shard_positions)) == (300, [149, 149])
        assert second.restores == 1
        # ps that hold the model ahead of every checkpoint are kept as they are
        third = resuming_chief(tmp_path, group.client.addresses)
        third._init_or_restore()
        assert third.restores == 0 and third.ps.state(0).global_step == 300
        third.close()
    finally:
        second.close()


@pytest.mark.parametrize("cut_short", ["restore", "reset"])
def test_a_restore_of_every_ps_cut_short_is_done_again_not_resumed_as_the_model(
        tmp_path: Path, ps_servers: PsServers, cut_short: str) -> None:
    """A chief restoring the latest checkpoint (``reset``: with none, setting every ps back to its initializers)
    gives each ps its part; one lost half-way left ps 0 at the checkpoint and ps 1 where training had taken it.
    Its successor found every ps holding variables and resumed that mix as the model. Each ps now names the
    model its shards belong to: ps of different models are restored again, all of them."""
    group = ps_servers.start(2)
    first = resuming_chief(tmp_path, group.client.addresses)
    try:
        first._init_or_restore()  # the initializers, at global step 0
        start = take_snapshot(first.model, first.ps)
        if cut_short == "restore":
            start.global_step, start.shard_positions = 300, [149, 149]
            write_checkpoint(tmp_path / "ckpts", start)
        trained = take_snapshot(first.model, first.ps)  # training went on: every variable moved
        trained.variables = {name: value + 1 for name, value in trained.variables.items()}
        trained.global_step, trained.shard_positions = 500, [249, 249]
        restore_snapshot(first.model, first.ps, trained)
        only_ps0 = PsClient(group.client.addresses[:1], timeout=30)  # the chief lost after ps 0 took its part
        try:
            if cut_short == "restore":
                restore_snapshot(first.model, only_ps0, start)
            else:
                cfg = first.config
                only_ps0.init(first.model.shard_specs(cfg.seed), cfg.optimizer_proto(), first.info.cluster_id,
                              reset=True)
        finally:
            only_ps0.close()
    finally:
        first.close()
    second = resuming_chief(tmp_path, group.client.addresses)
    try:
        second._init_or_restore()
        now = take_snapshot(second.model, second.ps)
        assert now.global_step == start.global_step
        for name, value in start.variables.items():  # one model, on every ps: the checkpoint's, or the initial
            np.testing.assert_array_equal(now.variables[name], value, err_msg=name)
        assert second.restores == 1
    finally:
        second.close()


def test_synchronous_counters_carry_on_from_the_checkpoint_into_restarted_ps(
        tmp_path: Path, ps_servers: PsServers) -> None:
    """A restarted ps counts from zero: restored from a checkpoint, every ps takes the run's counts as of it
    (``result.json``'s ``sync``, read from ps 0, counted only what followed its last restart); one that recorded
    none (an older psctl's) leaves each ps its own."""
    counts = {"gradients_applied": 600, "stale_dropped": 3, "timed_out_steps": 1}
    group = ps_servers.start(2)
    first = resuming_chief(tmp_path, group.client.addresses, "mode: sync")
    try:
        first._init_or_restore()
        snapshot = take_snapshot(first.model, first.ps)
        snapshot.global_step, snapshot.sync_counters = 300, dict(counts)
        restore_snapshot(first.model, first.ps, snapshot)
        assert [sync_counters(first.ps.state(i)) for i in range(2)] == [counts, counts]
        taken = take_snapshot(first.model, first.ps)  # (as the chief checkpoints)
        assert taken.sync_counters == counts
        written = write_checkpoint(tmp_path / "ckpts", taken)
        assert load_checkpoint(written).sync_counters == counts
    finally:
        first.close()
    restarted = ps_servers.start(2)  # every ps lost (their processes restarted), the checkpoint kept
    second = resuming_chief(tmp_path, restarted.client.addresses, "mode: sync")
    try:
        second._init_or_restore()
        assert second.restores == 0 and second.ps.state(0).global_step == 300
        assert second._sync_counters() == counts
        assert sync_counters(second.ps.state(1)) == counts
        # every ps set back to its initializers (no checkpoint to restore): training, and its counts, start again
        cfg = second.config
        second.ps.init(second.model.shard_specs(cfg.seed), cfg.optimizer_proto(), second.info.cluster_id,
                       reset=True, replicas_to_aggregate=2)
        assert second._sync_counters() == dict.fromkeys(counts, 0)
    finally:
        second.close()
    taken.global_step, taken.sync_counters = 400, {}  # a newer checkpoint that records none
    write_checkpoint(tmp_path / "ckpts", taken)
    third = resuming_chief(tmp_path, ps_servers.start(2).client.addresses, "mode: sync")
    try:
        third._init_or_restore()
        assert third.ps.state(0).global_step == 400 and third._sync_counters() == dict.fromkeys(counts, 0)
    finally:
        third.close()


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s.variables.update({"hid/kernel": s.variables["hid/kernel"][:, :7]}), "'hid/kernel' is (64, 7) in "
     "the checkpoint, the program says (64, 100)"),
    # a checkpoint that does not record its data shards (older): the shards its positions show read
    (lambda s: (s.meta.pop("data_shards", None), s.shard_positions.extend([5, 5, 5])), "it read its data in 3 "
     "shards, this run would split it in 2 (training.data_shards, or one per worker): set training.data_shards: 3"),
    (lambda s: s.slots["hid/bias"].update({"accum": np.zeros_like(s.variables["hid/bias"])}),  # (adagrad's)
     "'hid/bias' has the optimizer slots ['accum', 'm', 't', 'v'] there, training.optimizer adam keeps ['m', 't', "
     "'v']"),
    # what a checkpoint records of its run: another optimizer (momentum's and Adagrad's slots are both `accum`:
    # each took the other's state and trained on, or failed on a NaN), batch size (its data positions count
    # batches: another size repeated or skipped data), or program (its variables checked first: the message
    # named the slots of a variable it does not have)
    (lambda s: s.meta.update(optimizer={"name": "adagrad", "learning_rate": 0.1}),
     "it was trained with training.optimizer adagrad, this spec's is adam (its optimizer state is adagrad's)"),
    (lambda s: s.meta.update(batch_size=20), "it read its data in batches of 20, this spec's are of 100 (its data "
     "positions count batches): set training.batch_size: 20 to resume it"),
    (lambda s: (s.meta.update(program="psctl.models.softmax"), s.slots.pop("hid/kernel"),
                s.variables.update({"softmax/kernel": s.variables.pop("hid/kernel")})),
     "the checkpoint has no variable 'hid/kernel' (it was trained by program psctl.models.softmax, this spec's is "
     "psctl.models.mlp)"),
])
def test_a_checkpoint_that_does_not_fit_the_spec_is_a_permanent_error_naming_it(
        tmp_path: Path, ps_servers: PsServers, change: Callable[[Snapshot], None], message: str) -> None:
    """(Another model's shapes, another optimizer's slots: resumed, the chief used to exit 1, be restarted, and
    its successor train from step 0 over the checkpoint.)"""
    from psctl.runtime.chief import CheckpointMismatch

    group = ps_servers.start(2)
    chief = resuming_chief(tmp_path, group.client.addresses)
    try:
        chief._init_or_restore()
        snapshot = take_snapshot(chief.model, chief.ps)
        snapshot.global_step = 200
        change(snapshot)
        written = write_checkpoint(tmp_path / "ckpts", snapshot)
        with pytest.raises(CheckpointMismatch) as caught:
            chief._init_or_restore()
        text = str(caught.value)
        assert text.startswith(f"checkpoint {written} does not fit this spec: ") and message in text, text
        assert chief.ps.state(0).global_step == 0  # nothing of it was taken
    finally:
        chief.close()

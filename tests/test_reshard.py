"""Resharding for ``psctl scale ps=N``, over real gRPC on loopback: the variables and optimizer slots move onto
another number of ps unchanged, and the worker takes the new layout from the next step the chief sends."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from inprocess_cluster import CLUSTER_ID, MakeCluster, cluster_factory

from psctl.proto import psctl_pb2 as pb
from psctl.runtime.checkpoint import reshard_onto, take_snapshot
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps_client import PsClient

MLP = ProgramRef("psctl.models.mlp", {"hidden_units": 16}, {"name": "digits"}, 0)
ADAM = pb.OptimizerConfig(name="adam", learning_rate=0.01)


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    yield from cluster_factory()


@pytest.mark.parametrize(("old", "new"), [(2, 3), (3, 2)])
def test_resharding_keeps_every_variable_and_slot_and_the_next_step_uses_the_new_layout(
    make_cluster: MakeCluster, old: int, new: int
) -> None:
    made = make_cluster(MLP, num_ps=old, spare_ps=max(0, new - old))
    for _ in range(30):
        made.coordinator.schedule("train")
    made.coordinator.join()
    paused = take_snapshot(made.model, made.chief)  # what the chief snapshots at the pause
    assert paused.global_step == 30
    assert paused.slots and all(slots for slots in paused.slots.values())  # Adam's moments: real state to move

    addresses = (made.chief.addresses + made.spare_addresses)[:new]
    model = ShardedModel(load_program(MLP), new)
    client = PsClient(addresses, timeout=30)
    try:
        reshard_onto(paused, model, client, seed=0, optimizer=ADAM, cluster_id=CLUSTER_ID)
        moved = take_snapshot(model, client)
        assert moved.global_step == paused.global_step and moved.shard_positions == paused.shard_positions
        assert sorted(moved.variables) == sorted(paused.variables)
        for name, value in paused.variables.items():
            np.testing.assert_array_equal(moved.variables[name], value, err_msg=name)
            assert sorted(moved.slots[name]) == sorted(paused.slots[name])
            for slot, slot_value in paused.slots[name].items():
                np.testing.assert_array_equal(moved.slots[name][slot], slot_value, err_msg=f"{name}#{slot}")
        holders = {shard.ps for layout in model.layouts.values() for shard in layout.shards}
        assert holders == set(range(new))  # every ps of the new layout holds a share

        # the chief's next step carries the layout: the worker follows it, and every new ps gets its push
        made.coordinator.set_ps_addresses(addresses)
        made.coordinator.recover({0: paused.shard_positions[0] + 1})
        servicers = (made.ps + made.spare)[:new]
        pushes = [s.calls["push"] for s in servicers]
        made.coordinator.schedule("train")
        made.coordinator.join()
        assert [s.calls["push"] for s in servicers] == [n + 1 for n in pushes]
        assert made.worker.model.num_ps == new and made.worker.ps.addresses == addresses
        assert client.state(0).global_step == 31
    finally:
        client.close()

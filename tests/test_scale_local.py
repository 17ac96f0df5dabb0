"""``psctl scale`` on a running local cluster, with real processes: workers 2 -> 4 -> 1 and ps 2 -> 3 while it
trains. Exactly the steps asked for, every batch taken once (the data shards' last positions sum to the steps),
nothing retried, the ps' variables resharded without a change, and the roles left running on the CPUs of their
slots among the roles now (where they outnumber this machine's CPUs)."""

from __future__ import annotations

import itertools
import re
import textwrap
from functools import partial
from typing import Any

import psutil
import pytest
from cluster_helpers import wait_until
from conftest import Hold, PsctlEnv
from supervised_cluster import SupervisedCluster

from psctl.launch.cpus import YIELD_NICE, allowed_cpus, cpus_for_slot, host_slots
from psctl.runtime.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 240.0


def held_cluster(penv: PsctlEnv, name: str, steps: int) -> tuple[SupervisedCluster, Hold]:
    """The cluster, its steps 50 ms slower while the test holds it: a fast machine trained to the end before the
    scales were seen through."""
    hold = Hold(penv.tmp_path / f"{name}-hold", pause=0.05)
    return SupervisedCluster(penv, name, spec_text(name, steps, str(hold.program))), hold


def spec_text(name: str, steps: int, program: str = "psctl.models.mlp") -> str:
    return textwrap.dedent(
        f"""\
        name: {name}
        roles:
          chief: {{}}
          ps: {{replicas: 2, max_replicas: 3}}
          worker: {{replicas: 2, max_replicas: 4}}
        training:
          program: {program}
          args: {{hidden_units: 32}}
          data: {{name: digits}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.01}}
          steps: {steps}
          log_every_seconds: 0.2s
          checkpoint: {{every_steps: 1000, every_seconds: 0, max_to_keep: 100}}
        supervision: {{heartbeat_interval: 0.2s, heartbeat_timeout: 5s, preemption_grace: 20s}}
        """
    )


def scale(penv: PsctlEnv, cluster: SupervisedCluster, *targets: str) -> str:
    done = penv.run("scale", cluster.name, *targets, timeout=60)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{cluster.describe()}"
    return done.stdout


def scale_at_once(penv: PsctlEnv, cluster: SupervisedCluster, *targets: str) -> list[str]:
    """One `psctl scale` per target, all started together: their outputs (each must succeed)."""
    scales = [penv.popen("scale", cluster.name, target) for target in targets]
    try:
        outputs = [p.communicate(timeout=60) for p in scales]
    finally:
        for p in scales:
            p.kill()
            p.wait()
    for p, (out, err) in zip(scales, outputs, strict=True):
        assert p.returncode == 0, f"{out}\n{err}\n{cluster.describe()}"
    return [out for out, _ in outputs]


def assert_every_batch_once(cluster: SupervisedCluster, steps: int) -> dict[str, Any]:
    cluster.wait_finished(RUN_TIMEOUT)
    result = cluster.result()
    assert result["global_step"] == steps, cluster.describe()
    # one batch per step, each shard read from its start without a gap: no step applied twice, none skipped
    assert sum(p + 1 for p in result["shard_positions"]) == steps, result
    assert result["retried_steps"] == 0 and result["ps_restores"] == 0, result
    progress = [r["global_step"] for r in cluster.progress_records()]
    assert all(b >= a for a, b in itertools.pairwise(progress)), progress  # never went back
    assert result["metrics"]["accuracy"] > 0.8, result
    return result


def assert_on_their_slots_cpus(roles: list[dict[str, Any]]) -> None:
    """Each running role on the CPU its slot among these roles names (cpu_binding: auto), moved there as the
    roles were scaled (where they outnumber this machine's CPUs; else on every CPU)."""
    allowed = allowed_cpus()
    slots = host_slots((r["role"], r["index"]) for r in roles)
    for r in roles:
        expected = cpus_for_slot(slots[(r["role"], r["index"])], len(slots), allowed) or allowed
        wait_until(lambda r=r, expected=expected: sorted(psutil.Process(r["pid"]).cpu_affinity()) == expected,
                   timeout=10, what=f"{r['name']} on CPU(s) {expected} of {allowed}")


def test_workers_scaled_2_to_4_to_1_while_training_take_every_batch_exactly_once(psctl_env: PsctlEnv) -> None:
    steps = 6000
    cluster, hold = held_cluster(psctl_env, "scalew", steps)
    cluster.up()
    wait_until(lambda: cluster.progress() >= 300, timeout=120, what="global step 300", detail=cluster.describe)
    hold.start()  # until both scales are seen through

    # two at once: one is carried out, the other waits for it and finds nothing left to change (without the
    # scale lock both read 2 workers, or the second found the first's request and refused)
    outputs = sorted(scale_at_once(psctl_env, cluster, "worker=4", "worker=4"))
    assert "worker 2 -> 4" in outputs[0] and "worker unchanged" in outputs[1], outputs

    def training(name: str) -> bool:
        return bool(cluster.role(name)["state"] == "running" and cluster.role(name)["local_step"] > 0)

    def left(name: str) -> bool:
        return cluster.role(name)["pid"] is None

    for name in ("worker-2", "worker-3"):  # they joined and got work
        wait_until(partial(training, name), timeout=60, what=f"{name} training", detail=cluster.describe)
    assert cluster.progress() < steps, "training ended before the scale-down"

    def nice(name: str) -> int:
        return int(psutil.Process(cluster.role(name)["pid"]).nice())

    # where the 7 roles outnumber this machine's CPUs (bound), the training workers yield theirs to the ps and
    # the chief; elsewhere every role runs at the usual priority
    yielding = YIELD_NICE if len(allowed_cpus()) < 7 else 0
    wait_until(lambda: all(nice(f"worker-{i}") == yielding for i in range(4)), timeout=30,
               what=f"every worker at nice {yielding}", detail=cluster.describe)
    assert nice("ps-0") == nice("ps-1") == nice("chief-0") == 0

    assert "worker 4 -> 1" in scale(psctl_env, cluster, "worker=1")
    for name in ("worker-1", "worker-2", "worker-3"):
        wait_until(partial(left, name), timeout=60, what=f"{name} to leave", detail=cluster.describe)
        assert cluster.role(name)["state"] == "stopped" and cluster.role(name)["retired"]
        assert "stopping: its steps finished" in cluster.log(name), cluster.log(name)[-2000:]
    status = cluster.status()
    assert [r["name"] for r in status["roles"] if r["state"] == "running"] == ["chief-0", "ps-0", "ps-1", "worker-0"]
    assert_on_their_slots_cpus([r for r in cluster.state()["roles"] if r["state"] == "running"])
    assert cluster.progress() < steps, "training ended before the last scale was seen through"
    hold.release()

    result = assert_every_batch_once(cluster, steps)
    assert result["workers"] == 1
    assert cluster.role("worker-0")["attempt"] == 1  # nothing else was restarted
    reasons = [e["reason"] for e in cluster.events("cluster")]
    assert "psctl scale worker=4: worker 2 -> 4" in reasons and "psctl scale worker=1: worker 4 -> 1" in reasons
    chief = cluster.log("chief-0")
    assert "worker:3 joins at" in chief and "worker:3 leaves (scaled down)" in chief


def test_ps_scaled_2_to_3_while_training_reshards_every_variable_unchanged(psctl_env: PsctlEnv) -> None:
    """Then 3 -> 2 while the chief is away (stopped, then killed before it could reshard): the leaving ps used to
    be stopped at once and the next chief restored the latest checkpoint onto 2 ps (the steps since it trained
    again); it starts on the 3 ps the last one left, resumes from them and reshards."""
    steps = 3000
    cluster, hold = held_cluster(psctl_env, "scaleps", steps)
    cluster.up()
    wait_until(lambda: cluster.progress() >= 300, timeout=120, what="global step 300", detail=cluster.describe)
    hold.start()  # until the chief is killed

    assert "ps 2 -> 3" in scale(psctl_env, cluster, "ps=3")
    resharded = wait_until(
        lambda: re.search(r"resharded from 2 to 3 ps at global step (\d+): every variable and slot verified",
                          cluster.log("chief-0")),
        timeout=60, what="the chief to reshard onto 3 ps", detail=cluster.describe)
    at = int(resharded[1])
    assert at < steps
    # the snapshot taken at the pause is a checkpoint of its own (a chief lost half-way restores it)
    assert f"ckpt-{at:012d}" in [p.name for p in list_checkpoints(cluster.root / "checkpoints")]
    wait_until(lambda: cluster.role("ps-2")["metrics"].get("bytes_held", 0) > 0, timeout=30,
               what="ps-2 to hold a share of the variables", detail=cluster.describe)
    for name in ("chief-0", "ps-0", "ps-1", "ps-2", "worker-0", "worker-1"):
        assert cluster.role(name)["attempt"] == 1, cluster.describe()  # a reshard, not a restart

    chief = psutil.Process(cluster.role("chief-0")["pid"])
    chief.suspend()
    try:
        assert "ps 3 -> 2" in scale(psctl_env, cluster, "ps=2")
    finally:
        chief.kill()
        hold.release()
    wait_until(lambda: "resharded from 3 to 2 ps" in cluster.log("chief-0"), timeout=60,
               what="the next chief to reshard onto 2 ps", detail=cluster.describe)
    result = assert_every_batch_once(cluster, steps)  # (no ps restored, the global step never went back)
    assert result["ps"] == 2
    assert "restored" not in cluster.log("chief-0"), cluster.log("chief-0")[-3000:]
    # the clients of the layouts resharded away from are closed at the end: the pool thread of one held the
    # chief at its exit (2 s, and a warning blaming the program)
    assert "still running (not daemons" not in cluster.log("chief-0"), cluster.log("chief-0")[-3000:]
    assert cluster.role("chief-0")["attempt"] == 2
    assert cluster.role("ps-2")["reason"] == "resharded onto 2 ps: scaled down", cluster.describe()

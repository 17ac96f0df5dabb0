"""Synchronous (and bounded-staleness) training end to end: the installed ``psctl up`` on specs written to
``tmp_path``, real supervisors, real role processes talking gRPC on loopback.

What each test reads is what an operator reads: the chief's ``run/result.json`` ("global_step", "metrics",
"sync": {"gradients_applied", "stale_dropped", "timed_out_steps"}, "max_observed_lag"), ``state.json`` and
``psctl status --json``, and the roles' logs. Slow or dying workers are made by a user program in ``tmp_path``
that wraps ``psctl.models.mlp``: it delays ``loss_and_grads`` in one role (the supervisor sets ``PSCTL_ROLE``
for every role) and counts every role's computed steps in a file of its own (one byte per step).

Clusters are small (1 chief, 1-2 ps, 2-3 workers, an MLP with 32 hidden units on digits, tens to a few hundred
steps) for a two-core machine. Every process is taken down by the ``psctl_env`` fixture (``psctl down`` for the
test's own PSCTL_HOME, then a psutil sweep by PSCTL_CLUSTER_ID), and an attached ``psctl up`` the test started
is stopped by the test itself.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from cluster_helpers import wait_until
from conftest import PsctlEnv

pytestmark = pytest.mark.slow

#: Starting the roles of a cluster (each imports numpy, grpc, scikit-learn's digits), training, evaluating.
RUN_TIMEOUT = 120.0
#: The slowed worker's extra seconds per step.
DELAY = 0.3
SLOW_ROLE = "worker-2"

PROGRAM = '''\
"""psctl.models.mlp, with one role slowed down and every role's computed steps counted (test helper)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from psctl.models import mlp

COUNTS = Path({counts!r})
SLOW_ROLE = {slow_role!r}
DELAY = {delay!r}


class Wrapped:
    def __init__(self, inner):
        self._inner = inner
        self._role = os.environ.get("PSCTL_ROLE", "")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def loss_and_grads(self, params, batch):
        if self._role == SLOW_ROLE:
            time.sleep(DELAY)  # simulates a slow machine, not a synchronisation
        result = self._inner.loss_and_grads(params, batch)
        with open(COUNTS / (self._role or "unknown"), "ab") as f:
            f.write(b".")
        return result


def build(args, data, seed):
    return Wrapped(mlp.build(args, data, seed))
'''


# -- specs and runs -------------------------------------------------------------------------------------------------
def write_program(tmp_path: Path, *, slow_role: str = SLOW_ROLE, delay: float = DELAY) -> tuple[Path, Path]:
    counts = tmp_path / "counts"
    counts.mkdir(exist_ok=True)
    path = tmp_path / "slowed_mlp.py"
    path.write_text(PROGRAM.format(counts=str(counts), slow_role=slow_role, delay=delay), encoding="utf-8")
    return path, counts


def step_counts(counts: Path) -> dict[str, int]:
    """Steps each role computed (the wrapper appends one byte per loss_and_grads)."""
    return {p.name: p.stat().st_size for p in counts.iterdir()} if counts.is_dir() else {}


def write_spec(
    penv: PsctlEnv,
    name: str,
    *,
    steps: int,
    mode: str = "sync",
    ps: int = 1,
    workers: int = 2,
    program: str = "psctl.models.mlp",
    tls: bool = False,
    restart_never: bool = False,
    optimizer: dict[str, Any] | None = None,
    **training: Any,
) -> Path:
    never = {"restart": {"policy": "never"}} if restart_never else {}
    spec = {
        "name": name,
        "roles": {"chief": dict(never), "ps": {"replicas": ps}, "worker": {"replicas": workers, **never}},
        "training": {
            "program": program,
            "args": {"hidden_units": 32},
            "data": {"name": "digits"},
            "batch_size": 50,
            "optimizer": optimizer or {"name": "adam", "learning_rate": 0.01},
            "mode": mode,
            "steps": steps,
            "log_every_seconds": "0.2s",
            **training,
        },
        "supervision": {"heartbeat_interval": "0.5s", "heartbeat_timeout": "10s"},
    }
    if not tls:
        spec["security"] = {"tls": False}
    path = penv.tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def cluster_root(penv: PsctlEnv, name: str) -> Path:
    return penv.home / name


def logs(penv: PsctlEnv, name: str, chars: int = 2500) -> str:
    """The end of the supervisor's and every role's log, for assertion messages."""
    root = cluster_root(penv, name)
    parts = []
    for path in [root / "supervisor.log", *sorted((root / "logs").glob("*.log"))]:
        with contextlib.suppress(OSError):
            parts.append(f"----- {path.name} -----\n{path.read_text(encoding='utf-8', errors='replace')[-chars:]}")
    return "\n".join(parts)


def result_of(penv: PsctlEnv, name: str) -> dict[str, Any]:
    return json.loads((cluster_root(penv, name) / "run" / "result.json").read_text())  # type: ignore[no-any-return]


def up(penv: PsctlEnv, spec: Path, name: str) -> dict[str, Any]:
    """``psctl up SPEC`` attached, to the end; returns result.json after checking the run succeeded."""
    done = penv.run("up", str(spec), timeout=RUN_TIMEOUT)
    with contextlib.suppress(OSError, ValueError, KeyError):
        penv.state(name)  # registers the cluster id for the teardown's sweep
    assert done.returncode == 0, f"psctl up exited {done.returncode}\n{done.stdout}\n{done.stderr}\n{logs(penv, name)}"
    assert f"training finished: {result_of(penv, name)['global_step']} steps" in " ".join(done.stdout.split())
    return result_of(penv, name)


@contextlib.contextmanager
def up_attached(penv: PsctlEnv, spec: Path, name: str) -> Iterator[subprocess.Popen[str]]:
    """``psctl up SPEC`` attached, in the background while the test acts; always stopped on the way out."""
    proc = penv.popen("up", str(spec))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `psctl up` detaches on Ctrl-C; the fixture's `psctl down` stops the rest
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=15)


def live_process(penv: PsctlEnv, name: str, role: str) -> psutil.Process:
    """``role``'s running process, from state.json's pid and create_time, checked by its environment."""
    record = penv.role(name, role)
    proc = psutil.Process(record["pid"])
    assert abs(proc.create_time() - record["create_time"]) < 0.05, f"pid {record['pid']} was reused"
    env = proc.environ()
    assert env.get("PSCTL_ROLE") == role, env.get("PSCTL_ROLE")
    assert env.get("PSCTL_CLUSTER_ID") == penv.state(name)["cluster_id"]
    return proc


def sigkill(proc: psutil.Process) -> None:
    proc.send_signal(signal.SIGKILL)

    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(gone, timeout=10, what=f"pid {proc.pid} to die")


# -- synchronous training -------------------------------------------------------------------------------------------
def test_sync_trains_exact_steps_and_matches_async_accuracy(psctl_env: PsctlEnv) -> None:
    """R = N = 2 on 2 ps, TLS on (the default). Every global step averages exactly R gradients; the model is as
    good as the asynchronous one. 400 steps of Adam bring both to their plateau on digits (~0.95-0.97 on the
    test split), so the comparison is not a race between two half-trained models."""
    steps = 400
    sync = up(psctl_env, write_spec(psctl_env, "sync", steps=steps, ps=2, workers=2, tls=True,
                                    replicas_to_aggregate=2, total_replicas=2), "sync")
    assert sync["global_step"] == steps, sync
    assert sync["sync"]["gradients_applied"] == steps * 2, sync
    assert sync["sync"]["timed_out_steps"] == 0, sync
    assert sync["max_observed_lag"] is None

    asyn = up(psctl_env, write_spec(psctl_env, "async", steps=steps, mode="async", ps=2, workers=2, tls=True), "async")
    assert asyn["global_step"] == steps, asyn
    assert asyn["sync"] is None
    acc_sync, acc_async = sync["metrics"]["accuracy"], asyn["metrics"]["accuracy"]
    assert acc_sync > 0.9 and acc_async > 0.9, (sync, asyn)
    assert abs(acc_sync - acc_async) <= 0.01, (acc_sync, acc_async)


def test_backup_worker_slow_gradients_are_dropped(psctl_env: PsctlEnv) -> None:
    """N = 3 workers for R = 2: the slowest is a backup whose gradients arrive after the step moved on."""
    steps = 100
    program, counts = write_program(psctl_env.tmp_path)
    spec = write_spec(psctl_env, "backup", steps=steps, ps=2, workers=3, program=str(program),
                      replicas_to_aggregate=2, total_replicas=3)
    result = up(psctl_env, spec, "backup")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 2, result
    assert result["sync"]["stale_dropped"] > 0, result
    assert result["sync"]["timed_out_steps"] == 0, result
    # never waited for the slow worker: it alone would need steps * DELAY
    assert result["seconds"] < steps * DELAY, result
    computed = step_counts(counts)
    assert computed.get(SLOW_ROLE, 0) < steps / 3, computed  # it did fewer steps than its share
    assert result["metrics"]["accuracy"] > 0.8, result


def test_fewer_workers_than_replicas_to_aggregate(psctl_env: PsctlEnv) -> None:
    """N = 2 < R = 4: each worker computes two batches per global step."""
    steps = 60
    program, counts = write_program(psctl_env.tmp_path, slow_role="none")
    spec = write_spec(psctl_env, "fewer", steps=steps, workers=2, program=str(program),
                      replicas_to_aggregate=4, total_replicas=2)
    result = up(psctl_env, spec, "fewer")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 4, result
    assert result["sync"]["timed_out_steps"] == 0, result
    computed = step_counts(counts)
    assert sum(computed.values()) >= steps * 4, computed


# -- a dead replica ---------------------------------------------------------------------------------------------------
def kill_worker_when(psctl_env: PsctlEnv, name: str, counts: Path, victim: str, at: int) -> None:
    """SIGKILL ``victim`` once it has computed ``at`` steps (pid from state.json)."""
    wait_until(lambda: step_counts(counts).get(victim, 0) >= at, timeout=RUN_TIMEOUT, interval=0.01,
               what=f"{victim} to compute {at} steps", detail=lambda: logs(psctl_env, name))
    sigkill(live_process(psctl_env, name, victim))


def test_dead_worker_gradients_counted_live_worker_covers(psctl_env: PsctlEnv) -> None:
    """TensorFlow's rule (gradients, not replicas, count): the live worker pushes twice per step and training
    goes on without waiting for the replica timeout."""
    steps = 80
    program, counts = write_program(psctl_env.tmp_path, slow_role="none")
    spec = write_spec(psctl_env, "cover", steps=steps, workers=2, program=str(program), restart_never=True,
                      replicas_to_aggregate=2, replica_timeout="30s", min_replicas=1)
    with up_attached(psctl_env, spec, "cover") as proc:
        kill_worker_when(psctl_env, "cover", counts, "worker-1", 15)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"{out}\n{err}\n{logs(psctl_env, 'cover')}"
    result = result_of(psctl_env, "cover")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 2, result
    assert result["sync"]["timed_out_steps"] == 0, result  # 30 s were never waited
    assert result["seconds"] < 30, result
    assert psctl_env.role("cover", "worker-1")["state"] == "failed"


def test_dead_worker_replica_timeout_proceeds_with_min_replicas(psctl_env: PsctlEnv) -> None:
    """distinct_replicas: the live worker alone cannot make R = 2; after replica_timeout the step proceeds with
    the one replica that arrived (min_replicas 1)."""
    steps = 60
    remaining = 6  # each step after the kill waits replica_timeout
    program, counts = write_program(psctl_env.tmp_path, slow_role="none")
    spec = write_spec(psctl_env, "timeout", steps=steps, workers=2, program=str(program), restart_never=True,
                      replicas_to_aggregate=2, replica_timeout="1s", min_replicas=1, distinct_replicas=True)
    with up_attached(psctl_env, spec, "timeout") as proc:
        kill_worker_when(psctl_env, "timeout", counts, "worker-1", steps - remaining)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"{out}\n{err}\n{logs(psctl_env, 'timeout')}"
    result = result_of(psctl_env, "timeout")
    assert result["global_step"] == steps, result
    assert result["sync"]["timed_out_steps"] >= 1, result
    assert result["sync"]["gradients_applied"] == steps * 2, result  # the live worker pushed both
    chief_log = (cluster_root(psctl_env, "timeout") / "logs" / "chief-0.1.log").read_text()
    assert "proceeded with 1 of 2 replicas" in chief_log


def test_dead_worker_below_min_replicas_fails_clearly(psctl_env: PsctlEnv) -> None:
    steps = 60
    program, counts = write_program(psctl_env.tmp_path, slow_role="none")
    spec = write_spec(psctl_env, "short", steps=steps, workers=2, program=str(program), restart_never=True,
                      replicas_to_aggregate=2, replica_timeout="1s", min_replicas=2, distinct_replicas=True)
    with up_attached(psctl_env, spec, "short") as proc:
        kill_worker_when(psctl_env, "short", counts, "worker-1", 10)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode != 0, f"{out}\n{err}\n{logs(psctl_env, 'short')}"
    message = "replicas arrived within"
    assert message in " ".join(err.split()), err
    chief_log = (cluster_root(psctl_env, "short") / "logs" / "chief-0.1.log").read_text()
    assert "only 1 of 2 replicas arrived within 1s (min_replicas 2)" in chief_log
    done = psctl_env.run("status", "short", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "failed", status
    assert message in status["reason"], status["reason"]
    assert not (cluster_root(psctl_env, "short") / "run" / "result.json").exists()


# -- bounded staleness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [1, 0])
def test_bounded_staleness_holds_its_bound(psctl_env: PsctlEnv, staleness: int) -> None:
    """A worker may start a step only while it has completed at most ``staleness`` steps more than the slowest
    live worker. ``max_observed_lag`` is that lead measured when a step is taken (coordinator._take), so it is
    at most ``staleness``; since a step taken at lead ``staleness`` completes at ``staleness + 1``, the workers'
    step counts differ by at most ``staleness + 1`` — the slow worker does its share and the others wait."""
    steps = 45
    name = f"bounded{staleness}"
    program, counts = write_program(psctl_env.tmp_path)
    spec = write_spec(psctl_env, name, steps=steps, mode="bounded", workers=3, program=str(program),
                      staleness=staleness)
    result = up(psctl_env, spec, name)
    assert result["global_step"] == steps, result
    assert result["sync"] is None
    # the slow worker holds the others back: the bound is reached, never passed
    assert result["max_observed_lag"] == staleness, result
    computed = step_counts(counts)
    assert set(computed) == {"worker-0", "worker-1", "worker-2"}, computed
    assert sum(computed.values()) == steps, computed
    assert max(computed.values()) - min(computed.values()) <= staleness + 1, computed

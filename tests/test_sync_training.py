"""Synchronous (and bounded-staleness) training end to end: the installed ``psctl up`` on specs written to
``tmp_path``, real supervisors, real role processes talking gRPC on loopback.

What each test reads is what an operator reads: the chief's ``run/result.json`` ("global_step", "metrics",
"sync": {"gradients_applied", "stale_dropped", "timed_out_steps"}, "max_observed_lag"), ``state.json`` and
``psctl status --json``, and the roles' logs. Slow or dying workers are made by a user program in ``tmp_path``
that wraps ``psctl.models.mlp``: it delays ``loss_and_grads`` in one role or hangs one role in a given step
(the supervisor sets ``PSCTL_ROLE`` for every role; a hung role is then SIGKILLed by the test, by the pid in
state.json), and counts every role's computed steps in a file of its own (one byte per step).

Clusters are small (1 chief, 1-2 ps, 1-3 workers, an MLP with 32 hidden units on digits, tens of steps; a
thousand for the accuracy comparison) for a two-core machine; ``security: {tls: false}`` everywhere except the
accuracy comparison, which keeps the default mutual TLS. Every process is taken down by the ``psctl_env``
fixture (``psctl down`` for the test's own PSCTL_HOME, then a psutil sweep by PSCTL_CLUSTER_ID), and an attached
``psctl up`` the test started is stopped by the test itself.
"""

from __future__ import annotations

import contextlib
import json
import re
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

PROGRAM = '''\
"""psctl.models.mlp, with one role slowed down, one role hung at a given step, and every role's computed steps
counted in a file of its own (a test helper)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from psctl.models import mlp

COUNTS = Path({counts!r})
SLOW_ROLE = {slow_role!r}
DELAY = {delay!r}
HANG_ROLE = {hang_role!r}
HANG_AT = {hang_at!r}


class Wrapped:
    def __init__(self, inner):
        self._inner = inner
        self._role = os.environ.get("PSCTL_ROLE", "")
        self._computed = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def loss_and_grads(self, params, batch):
        if self._role == SLOW_ROLE:
            time.sleep(DELAY)  # a slow machine
        result = self._inner.loss_and_grads(params, batch)
        self._computed += 1
        with open(COUNTS / (self._role or "unknown"), "ab") as f:
            f.write(b".")
        if self._role == HANG_ROLE and self._computed >= HANG_AT:
            time.sleep(3600)  # a stuck machine: the test SIGKILLs it here, its step in flight
        return result


def build(args, data, seed):
    return Wrapped(mlp.build(args, data, seed))
'''


# -- specs and runs -------------------------------------------------------------------------------------------------
def write_program(
    tmp_path: Path, *, slow_role: str = "", delay: float = DELAY, hang_role: str = "", hang_at: int = 0
) -> tuple[Path, Path]:
    """The wrapped MLP program, and the folder where it counts each role's computed steps."""
    counts = tmp_path / "counts"
    counts.mkdir(exist_ok=True)
    path = tmp_path / "wrapped_mlp.py"
    text = PROGRAM.format(counts=str(counts), slow_role=slow_role, delay=delay, hang_role=hang_role, hang_at=hang_at)
    path.write_text(text, encoding="utf-8")
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
    max_workers: int | None = None,
    program: str = "psctl.models.mlp",
    tls: bool = False,
    worker_restart: str | None = None,
    chief_restart: str | None = None,
    optimizer: dict[str, Any] | None = None,
    **training: Any,
) -> Path:
    """A spec in block style: 1 chief, ``ps`` ps, ``workers`` workers; an MLP with 32 hidden units on digits."""
    chief: dict[str, Any] = {"replicas": 1}
    worker: dict[str, Any] = {"replicas": workers} | ({"max_replicas": max_workers} if max_workers else {})
    if chief_restart:
        chief["restart"] = {"policy": chief_restart}
    if worker_restart:
        worker["restart"] = {"policy": worker_restart}
    spec: dict[str, Any] = {
        "name": name,
        "roles": {"chief": chief, "ps": {"replicas": ps}, "worker": worker},
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
    path.write_text(yaml.safe_dump(spec, sort_keys=False, default_flow_style=False), encoding="utf-8")
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


def chief_log(penv: PsctlEnv, name: str) -> str:
    return (cluster_root(penv, name) / "logs" / "chief-0.1.log").read_text(encoding="utf-8", errors="replace")


def result_of(penv: PsctlEnv, name: str) -> dict[str, Any]:
    return json.loads((cluster_root(penv, name) / "run" / "result.json").read_text())  # type: ignore[no-any-return]


def register(penv: PsctlEnv, name: str) -> None:
    """Note the cluster's id for the teardown's sweep (once its state.json exists)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        penv.state(name)


def up(penv: PsctlEnv, spec: Path, name: str) -> dict[str, Any]:
    """``psctl up SPEC`` attached, to the end; returns result.json after checking the run succeeded."""
    done = penv.run("up", str(spec), timeout=RUN_TIMEOUT)
    register(penv, name)
    assert done.returncode == 0, f"psctl up exited {done.returncode}\n{done.stdout}\n{done.stderr}\n{logs(penv, name)}"
    result = result_of(penv, name)
    assert f"training finished: {result['global_step']} steps" in " ".join(done.stdout.split()), done.stdout
    return result


@contextlib.contextmanager
def up_attached(penv: PsctlEnv, spec: Path, name: str) -> Iterator[subprocess.Popen[str]]:
    """``psctl up SPEC`` attached, in the background while the test acts; always stopped on the way out (the
    fixture's ``psctl down`` then stops the cluster)."""
    proc = penv.popen("up", str(spec))
    try:
        yield proc
    finally:
        register(penv, name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # `psctl up` detaches on Ctrl-C
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=15)
        else:
            proc.communicate(timeout=15)  # closes the pipes


def finish(proc: subprocess.Popen[str], penv: PsctlEnv, name: str) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"psctl up did not finish within {RUN_TIMEOUT:.0f}s\n{logs(penv, name)}") from None
    return proc.returncode, out, err


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


def kill_when_hung(penv: PsctlEnv, name: str, proc: subprocess.Popen[str], counts: Path, victim: str, at: int) -> None:
    """Wait until ``victim`` hangs in its step ``at`` (its count file says so), then SIGKILL it by the pid in
    state.json. Fails at once if the cluster ended first."""

    def hung() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"psctl up ended before {victim} reached step {at}\n{logs(penv, name)}")
        return step_counts(counts).get(victim, 0) >= at

    wait_until(hung, timeout=RUN_TIMEOUT, interval=0.02, what=f"{victim} to reach step {at}",
               detail=lambda: logs(penv, name))
    sigkill(live_process(penv, name, victim))


# -- synchronous training -------------------------------------------------------------------------------------------
def test_sync_trains_exact_steps_and_matches_async_accuracy(psctl_env: PsctlEnv) -> None:
    """R = N = 2 over 2 ps, with TLS on (the default). Every global step averages exactly R gradients, and the
    model is as good as the asynchronous one trained for as many global steps.

    The size is chosen so that the 1-point comparison is between two converged models. Measured on the 359 test
    examples (1 example = 0.28 points): with Adam at lr 0.01 the asynchronous accuracy still wanders between
    0.961 and 0.981 from run to run at 400 and at 800 steps, so |sync - async| exceeded 0.01 in about one run in
    three; at lr 0.003 and 1000 steps twelve asynchronous runs all ended at 0.975-0.978 and the synchronous one
    at 0.975 (synchronous training is deterministic here: repeated runs agree to the last digit)."""
    steps = 1000
    adam = {"name": "adam", "learning_rate": 0.003}
    sync_spec = write_spec(psctl_env, "sync", steps=steps, ps=2, workers=2, tls=True, optimizer=adam,
                           replicas_to_aggregate=2, total_replicas=2)
    sync = up(psctl_env, sync_spec, "sync")
    assert sync["global_step"] == steps, sync
    assert sync["sync"] == {"gradients_applied": steps * 2, "stale_dropped": 0, "timed_out_steps": 0}, sync
    assert sync["max_observed_lag"] is None

    async_spec = write_spec(psctl_env, "async", steps=steps, mode="async", ps=2, workers=2, tls=True, optimizer=adam)
    asyn = up(psctl_env, async_spec, "async")
    assert asyn["global_step"] == steps, asyn
    assert asyn["sync"] is None
    acc_sync, acc_async = sync["metrics"]["accuracy"], asyn["metrics"]["accuracy"]
    assert acc_sync > 0.95 and acc_async > 0.95, (sync, asyn)
    assert abs(acc_sync - acc_async) <= 0.01, (acc_sync, acc_async)


def test_backup_worker_slow_gradients_are_dropped(psctl_env: PsctlEnv) -> None:
    """N = 3 workers for R = 2 over 2 ps: the slowest worker is a backup whose gradients arrive after the step
    moved on; they are dropped, and nobody waits for it. (replica_timeout and the chief's restart policy only
    turn a stuck step into a quick failure instead of minutes of waiting and restarting.)"""
    steps = 100
    program, counts = write_program(psctl_env.tmp_path, slow_role="worker-2")
    spec = write_spec(psctl_env, "backup", steps=steps, ps=2, workers=3, program=str(program),
                      chief_restart="never", replicas_to_aggregate=2, total_replicas=3, replica_timeout="10s")
    result = up(psctl_env, spec, "backup")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 2, result
    assert result["sync"]["stale_dropped"] > 0, result
    assert result["sync"]["timed_out_steps"] == 0, result
    # never waited for the slow worker: it alone would need steps * DELAY
    assert result["seconds"] < steps * DELAY, result
    computed = step_counts(counts)
    assert computed.get("worker-2", 0) < steps / 3, computed  # it did less than its share
    assert result["metrics"]["accuracy"] > 0.8, result


def test_fewer_workers_than_replicas_to_aggregate(psctl_env: PsctlEnv) -> None:
    """N = 2 < R = 4 over 2 ps: each worker computes two batches per global step."""
    steps = 60
    program, counts = write_program(psctl_env.tmp_path)
    spec = write_spec(psctl_env, "fewer", steps=steps, ps=2, workers=2, program=str(program),
                      replicas_to_aggregate=4, total_replicas=2)
    result = up(psctl_env, spec, "fewer")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 4, result
    assert result["sync"]["timed_out_steps"] == 0, result
    computed = step_counts(counts)
    assert sum(computed.values()) == steps * 4, computed  # every batch computed was used: none stale
    assert min(computed.get("worker-0", 0), computed.get("worker-1", 0)) > 0, computed


@pytest.mark.parametrize(("workers", "total"), [(1, 3), (2, 4)], ids=["one-worker-n3", "two-workers-n4"])
def test_workers_compute_no_backup_after_their_own_batch_and_every_shard_is_trained(
    psctl_env: PsctlEnv, workers: int, total: int
) -> None:
    """N = 3 for R = 2 with a single worker left: it computed the round's third batch after the two that
    completed the step, always stale, and always of the same shard: that shard's data was read and never trained
    on (positions [910, -1, 893], 900 stale); N = 4 with two workers, half of every round. Backups are workers
    racing the slow ones (one step per live worker, at least R), as in TensorFlow."""
    steps = 120
    spec = write_spec(psctl_env, "alone", steps=steps, workers=workers, replicas_to_aggregate=2,
                      total_replicas=total, data_shards=total)
    result = up(psctl_env, spec, "alone")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 2 and result["sync"]["stale_dropped"] == 0, result
    positions = result["shard_positions"]  # each shard's last batch, from 0: every shard read and trained on
    assert min(positions) >= 0 and sum(p + 1 for p in positions) == steps * 2, result
    # the rate status, top and the log show is global steps/s: it counted the batches (R per step, here 2x);
    # every batch computed was used, so the examples per global step are R batches' exactly
    records = (psctl_env.home / "alone" / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    final = [r for r in map(json.loads, records) if r.get("event") == "progress"][-1]  # (the whole run's)
    assert final["examples_per_sec"] / final["steps_per_sec"] == pytest.approx(2 * 50, rel=0.02), final


# -- a dead replica ---------------------------------------------------------------------------------------------------
#: worker-1 hangs in this step (computed, not pushed) and is SIGKILLed there.
HANG_AT = 20
#: Long enough that a healthy step (the first one included: workers still connecting) never times out, on a loaded
#: 2-core machine too.
REPLICA_TIMEOUT = 6.0


def test_dead_worker_live_worker_covers_when_gradients_count(psctl_env: PsctlEnv) -> None:
    """TensorFlow's rule (gradients count, not replicas): the dead worker's step is re-run by the live one, which
    then pushes twice per step; training goes on without ever waiting for the replica timeout."""
    steps = 60
    program, counts = write_program(psctl_env.tmp_path, hang_role="worker-1", hang_at=HANG_AT)
    spec = write_spec(psctl_env, "cover", steps=steps, workers=2, program=str(program), worker_restart="never",
                      replicas_to_aggregate=2, replica_timeout="60s", min_replicas=1)
    with up_attached(psctl_env, spec, "cover") as proc:
        kill_when_hung(psctl_env, "cover", proc, counts, "worker-1", HANG_AT)
        code, out, err = finish(proc, psctl_env, "cover")
    assert code == 0, f"{out}\n{err}\n{logs(psctl_env, 'cover')}"
    result = result_of(psctl_env, "cover")
    assert result["global_step"] == steps, result
    assert result["sync"]["gradients_applied"] == steps * 2, result
    assert result["sync"]["timed_out_steps"] == 0, result
    assert result["seconds"] < 60, result  # the 60 s timeout was never waited
    computed = step_counts(counts)
    # worker-1 computed HANG_AT gradients and pushed all but the last; worker-0 re-ran that step (at most once)
    assert computed["worker-1"] == HANG_AT and sum(computed.values()) == 2 * steps + 1, computed
    assert psctl_env.role("cover", "worker-1")["state"] == "failed"


def test_dead_worker_replica_timeout_proceeds_with_min_replicas(psctl_env: PsctlEnv) -> None:
    """distinct_replicas: the live worker alone cannot make R = 2; after replica_timeout each step proceeds with
    the one replica that arrived (min_replicas 1), to the exact final step."""
    steps = HANG_AT + 1  # each step from the hung one on (two) waits REPLICA_TIMEOUT
    program, counts = write_program(psctl_env.tmp_path, hang_role="worker-1", hang_at=HANG_AT)
    spec = write_spec(psctl_env, "proceed", steps=steps, workers=2, program=str(program), worker_restart="never",
                      replicas_to_aggregate=2, replica_timeout=f"{REPLICA_TIMEOUT}s", min_replicas=1,
                      distinct_replicas=True)
    with up_attached(psctl_env, spec, "proceed") as proc:
        kill_when_hung(psctl_env, "proceed", proc, counts, "worker-1", HANG_AT)
        code, out, err = finish(proc, psctl_env, "proceed")
    assert code == 0, f"{out}\n{err}\n{logs(psctl_env, 'proceed')}"
    result = result_of(psctl_env, "proceed")
    assert result["global_step"] == steps, result
    # distinct replicas: each worker takes one step per round, so worker-1 hung in round HANG_AT - 1 and every round
    # from there on timed out with worker-0's single gradient, and only those
    timed_out = result["sync"]["timed_out_steps"]
    assert timed_out == steps - (HANG_AT - 1), result
    assert chief_log(psctl_env, "proceed").count("proceeded with 1 of 2 replicas") == timed_out
    assert result["sync"]["gradients_applied"] == 2 * steps - timed_out, result
    computed = step_counts(counts)
    assert computed == {"worker-0": steps, "worker-1": HANG_AT}, computed


def test_dead_worker_below_min_replicas_fails_clearly(psctl_env: PsctlEnv) -> None:
    steps = 60
    program, counts = write_program(psctl_env.tmp_path, hang_role="worker-1", hang_at=HANG_AT)
    spec = write_spec(psctl_env, "short", steps=steps, workers=2, program=str(program), worker_restart="never",
                      chief_restart="never", replicas_to_aggregate=2, replica_timeout=f"{REPLICA_TIMEOUT}s",
                      min_replicas=2, distinct_replicas=True)
    with up_attached(psctl_env, spec, "short") as proc:
        kill_when_hung(psctl_env, "short", proc, counts, "worker-1", HANG_AT)
        code, out, err = finish(proc, psctl_env, "short")
    assert code == 3, f"{out}\n{err}\n{logs(psctl_env, 'short')}"  # psctl's "training failed"
    message = "replicas arrived within"
    assert message in " ".join(err.split()), err
    log = chief_log(psctl_env, "short")
    within = f"within {REPLICA_TIMEOUT:g}s"
    assert re.search(rf"synchronous step \d+: only 1 of 2 replicas arrived {within} \(min_replicas 2\)", log), log
    done = psctl_env.run("status", "short", "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "failed", status
    assert message in status["reason"], status["reason"]
    assert not (cluster_root(psctl_env, "short") / "run" / "result.json").exists()


def test_failed_sync_step_is_not_retried_by_restarting_the_chief(psctl_env: PsctlEnv) -> None:
    """Exit code 3 (training failed: a non-retryable error) is permanent, so under the default restart policy
    the chief is not restarted into the same failure again and again. One worker (of the two there may be: the
    spec refuses R distinct replicas from fewer workers than there can be) cannot make R = 2 distinct
    replicas: the first step fails after the replica timeout."""
    program, _ = write_program(psctl_env.tmp_path)
    spec = write_spec(psctl_env, "once", steps=50, workers=1, max_workers=2, program=str(program),
                      replicas_to_aggregate=2, replica_timeout="2s", distinct_replicas=True)
    with up_attached(psctl_env, spec, "once") as proc:

        def failed_or_restarted() -> bool:
            if not psctl_env.state_file("once").exists():
                return False  # `psctl up` is still bringing it up
            state = psctl_env.state("once")
            chief = psctl_env.role("once", "chief-0")
            return state["state"] in ("failed", "succeeded", "stopped") or chief["restarts"] > 0

        wait_until(failed_or_restarted, timeout=RUN_TIMEOUT, interval=0.1, what="the chief's failure",
                   detail=lambda: logs(psctl_env, "once"))
        assert psctl_env.role("once", "chief-0")["restarts"] == 0, logs(psctl_env, "once")
        code, _, err = finish(proc, psctl_env, "once")
    state = psctl_env.state("once")
    assert state["state"] == "failed"
    assert code == 3
    assert "replicas arrived within" in " ".join(err.split()), err


# -- bounded staleness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("staleness", [1, 0])
def test_bounded_staleness_holds_its_bound(psctl_env: PsctlEnv, staleness: int) -> None:
    """A worker may start a step only while it has completed at most ``staleness`` steps more than the slowest
    live worker. ``max_observed_lag`` is that lead measured when a step is taken (coordinator._take), so it is
    at most ``staleness``, and with one slow worker it reaches it. A step taken at lead ``staleness`` completes
    at ``staleness + 1``, so the workers' step counts end at most ``staleness + 1`` apart: the slow worker does
    its share and the others wait for it (without the bound it would do a handful of the steps)."""
    steps = 45
    name = f"bounded{staleness}"
    program, counts = write_program(psctl_env.tmp_path, slow_role="worker-2")
    spec = write_spec(psctl_env, name, steps=steps, mode="bounded", workers=3, program=str(program),
                      staleness=staleness)
    result = up(psctl_env, spec, name)
    assert result["global_step"] == steps, result
    assert result["sync"] is None
    assert result["max_observed_lag"] == staleness, result
    computed = step_counts(counts)
    assert set(computed) == {"worker-0", "worker-1", "worker-2"}, computed
    assert sum(computed.values()) == steps, computed
    assert max(computed.values()) - min(computed.values()) <= staleness + 1, computed

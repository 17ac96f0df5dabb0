"""Chaos: synchronous training (2 ps, 3 workers, R = 2 of N = 3) under the supervisor while a random worker is
SIGKILLed again and again, every time the global step has moved on by ``KILL_EVERY`` since the previous kill.

The run must end at exactly the configured step, with every step averaging exactly R fresh gradients (nothing
short, nothing doubled), its model as good as a fault-free run of the same spec (run first, in the same test),
and every killed worker restarted by the supervisor each time it was killed.

Victims are drawn from a seeded ``random.Random`` (the same sequence of workers every run); each kill takes
the pid from ``state.json`` (checked against its creation time and environment) and waits until the process
is gone. Kills are paced by a bounded wait on the chief's reported global step, never by sleeping. The
``psctl_env`` fixture takes every cluster down (``psctl down``, then a psutil sweep by cluster id) whether the
test passes or fails.
"""

from __future__ import annotations

import random
import textwrap
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import pytest
from cluster_helpers import wait_until
from conftest import PsctlEnv
from supervised_cluster import SupervisedCluster, sigkill

from psctl.runtime.coordinator import NEVER_SENT

pytestmark = pytest.mark.slow

STEPS = 1000
WORKERS = 3
R = 2
#: A kill every time the global step has advanced this far since the previous one.
KILL_EVERY = 60
#: Restart backoff: 0.2 s, doubling per kill of the same worker up to 0.4 s (plus jitter).
BACKOFF, MAX_BACKOFF = 0.2, 0.4
#: No kill closer to the end than this many seconds, at the rate training has run so far: the victim must come
#: back (its backoff, then a new process that heartbeats: ~1 s on 2 cores) before training finishes without it.
#: (Counted in steps, the margin shrank below a restart whenever training got faster; at the rate since the start,
#: which the start and the kills hold down, the end came sooner than reckoned.)
QUIET_END_SECONDS = 3.0
#: The rate is training's over about this many seconds before each reading.
RATE_WINDOW_SECONDS = 2.0
MIN_KILLS = 5
SEED = 20240611
#: Each run of 1,000 steps takes ~5-15 s on this 2-core machine; this only bounds a hang.
RUN_TIMEOUT = 75.0


def spec_text(name: str) -> str:
    """Both runs use this spec (TLS on, the default); only the name differs."""
    return textwrap.dedent(
        f"""\
        name: {name}
        roles:
          chief: {{}}
          ps: {{replicas: 2}}
          worker:
            replicas: {WORKERS}
            restart:
              {{policy: on-failure, max_restarts: 50, backoff_seconds: {BACKOFF}, max_backoff_seconds: {MAX_BACKOFF}}}
        training:
          program: psctl.models.mlp
          args: {{hidden_units: 32}}
          data: {{name: digits}}
          batch_size: 50
          optimizer: {{name: adam, learning_rate: 0.003}}
          mode: sync
          replicas_to_aggregate: {R}
          total_replicas: {WORKERS}
          replica_timeout: 30s
          steps: {STEPS}
          log_every_seconds: 0.2s
          checkpoint: {{every_steps: 100, every_seconds: 0, max_to_keep: 100}}
        supervision: {{heartbeat_interval: 0.5s, heartbeat_timeout: 10s}}
        """
    )


class Run(SupervisedCluster):
    """One cluster of the test's PSCTL_HOME (this file's spec), read through its files as an operator would."""

    def __init__(self, penv: PsctlEnv, name: str) -> None:
        super().__init__(penv, name, spec_text(name))

    def wait_finished(self, timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
        return super().wait_finished(timeout)


@dataclass(frozen=True)
class Kill:
    role: str
    attempt: int  # the attempt that was killed
    global_step: int  # the chief's reported global step just before the kill


class StepRate:
    """Training's recent rate: global steps per second over the last RATE_WINDOW_SECONDS of readings (once the
    step was seen above 0)."""

    def __init__(self) -> None:
        self.readings: deque[tuple[float, int]] = deque()  # when, and the step then

    def observe(self, step: int, now: float) -> float | None:
        """The rate, given the step seen ``now``; None until two readings apart in time and steps."""
        if step:
            self.readings.append((now, step))
        while len(self.readings) > 2 and now - self.readings[1][0] >= RATE_WINDOW_SECONDS:
            self.readings.popleft()
        if len(self.readings) < 2:
            return None
        (then, first), (_, last) = self.readings[0], self.readings[-1]
        return (last - first) / (now - then) if now > then and last > first else None


def chaos(run: Run, rng: random.Random) -> list[Kill]:
    """Kill a random worker each time the global step has advanced by KILL_EVERY since the previous kill,
    until too close to the end. The victim is drawn first (so the sequence depends only on the seed); if it is
    still coming back from an earlier kill, the wait goes on until it runs again."""
    kills: list[Kill] = []
    last = 0
    rate = StepRate()
    while True:
        victim = f"worker-{rng.randrange(WORKERS)}"
        attempt = 1 + sum(k.role == victim for k in kills)

        def ready(victim: str = victim, attempt: int = attempt, due: int = last + KILL_EVERY) -> str | None:
            if run.finished():
                return "finished"
            step = run.progress()
            steps_per_second = rate.observe(step, time.monotonic())
            if step >= STEPS or (steps_per_second and (STEPS - step) / steps_per_second < QUIET_END_SECONDS):
                return "end"
            record = run.role(victim)
            if step >= due and record["state"] == "running" and record["attempt"] == attempt:
                return "kill"
            return None

        outcome = wait_until(ready, timeout=RUN_TIMEOUT, interval=0.02, what=f"the step for killing {victim}",
                             detail=run.describe)
        if outcome != "kill":
            return kills
        proc = run.process(victim)
        step = run.progress()
        sigkill(proc)
        kills.append(Kill(victim, attempt, step))
        last = step


@pytest.mark.timeout(180)
def test_sync_training_survives_repeated_worker_kills(psctl_env: PsctlEnv) -> None:
    started = time.monotonic()
    # -- the reference: the same spec, no fault -------------------------------------------------------------
    clean = Run(psctl_env, "clean")
    clean.up()
    clean.wait_finished()
    reference = clean.result()
    assert reference["global_step"] == STEPS, reference
    assert reference["sync"]["gradients_applied"] == R * STEPS, reference
    clean_seconds = time.monotonic() - started

    # -- chaos ----------------------------------------------------------------------------------------------
    chaotic = Run(psctl_env, "chaos")
    chaos_started = time.monotonic()
    chaotic.up()
    kills = chaos(chaotic, random.Random(SEED))
    chaotic.wait_finished()
    chaos_seconds = time.monotonic() - chaos_started
    result = chaotic.result()
    detail = f"kills: {kills}\n{chaotic.describe()}"

    assert len(kills) >= MIN_KILLS, detail
    # exact: every one of the STEPS global steps averaged exactly R fresh gradients, none proceeded short
    assert result["global_step"] == STEPS, detail
    assert result["steps_this_run"] == STEPS, detail  # the chief was never restarted
    assert result["sync"]["gradients_applied"] == R * STEPS, result
    assert result["sync"]["timed_out_steps"] == 0, result
    assert result["ps_restores"] == 0, result
    # killed workers' in-flight steps went back on the queue (unless every kill fell between two calls: then
    # each worker's next call found no connection and was requeued as never sent)
    assert result["retried_steps"] >= 1 or NEVER_SENT in chaotic.log("chief-0"), result
    assert chaotic.state()["result"]["global_step"] == STEPS

    # as good a model as the fault-free run
    acc, ref_acc = result["metrics"]["accuracy"], reference["metrics"]["accuracy"]
    assert ref_acc > 0.95, reference
    # 359 test examples: two runs that see their batches in another order differ by a point or two by chance
    # (a binomial standard error of ~0.8 points each); a run that lost or doubled updates falls much further
    assert abs(acc - ref_acc) <= 0.02, (acc, ref_acc)

    # every kill was seen as that, and answered with a restart that came up and ran
    per_role = Counter(k.role for k in kills)
    for role, count in per_role.items():
        record = chaotic.role(role)
        assert record["attempt"] >= count + 1 and record["restarts"] == record["attempt"] - 1, detail
        lost = [e for e in chaotic.events(role) if e["to"] == "lost" and "SIGKILL" in e["reason"]]
        assert [e["attempt"] for e in lost] == [k.attempt for k in kills if k.role == role], detail
        running = {e["attempt"] for e in chaotic.events(role) if e["to"] == "running"}
        assert set(range(1, count + 2)) <= running, (role, running, detail)
        assert record["state"] == "stopped", detail  # stopped when training finished, never given up on
    for role in ("chief-0", "ps-0", "ps-1"):
        assert chaotic.role(role)["attempt"] == 1, detail

    print(
        f"chaos: {len(kills)} kills ({dict(sorted(per_role.items()))}) at steps {[k.global_step for k in kills]}; "
        f"accuracy {acc:.4f} vs fault-free {ref_acc:.4f}; retried steps {result['retried_steps']}, "
        f"stale dropped {result['sync']['stale_dropped']} (fault-free {reference['sync']['stale_dropped']}); "
        f"training {result['seconds']:.1f}s vs {reference['seconds']:.1f}s; "
        f"wall: fault-free run {clean_seconds:.1f}s, chaos run {chaos_seconds:.1f}s"
    )


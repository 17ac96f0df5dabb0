"""``psctl scale NAME worker=N ps=M``: change a running cluster's number of workers or ps.

This side checks the request against the spec (the bounds, the mode, the framework) and leaves it for the
supervisor, which adds or retires the replicas (:func:`psctl.supervisor.policy` ``scale``); the chief takes
new workers in, drains removed ones and reshards the variables onto a new ps count (``Chief._reshard``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from psctl.errors import PsctlError, UsageError
from psctl.home import ClusterDir, exclusive_lock, release
from psctl.observe import supervisor_alive
from psctl.runtime.atomic import write_json_atomic
from psctl.spec import ClusterSpec
from psctl.spec.checks import seconds_text
from psctl.supervisor.policy import members
from psctl.supervisor.state import ClusterRecord, cluster_spec, load_state

_TARGET = re.compile(r"(?P<role>[a-z]+)=(?P<replicas>\d+)")


@dataclass(frozen=True)
class Change:
    role: str
    was: int
    now: int


def parse_targets(targets: Sequence[str]) -> dict[str, int]:
    """``["worker=4", "ps=3"]`` -> ``{"worker": 4, "ps": 3}``; a UsageError says what is malformed."""
    if not targets:
        raise UsageError("say what to scale, e.g. `psctl scale NAME worker=4` (or ps=3)")
    out: dict[str, int] = {}
    for target in targets:
        match = _TARGET.fullmatch(target.strip())
        if match is None:
            raise UsageError(f"{target!r} is not ROLE=N; write e.g. worker=4 or ps=3")
        role = match["role"]
        if role not in ("worker", "ps"):
            raise UsageError(f"{role} cannot be scaled: only worker and ps have replicas to change")
        if role in out:
            raise UsageError(f"{role} is given twice; give it once")
        out[role] = int(match["replicas"])
    return out


def check_request(cdir: ClusterDir, spec: ClusterSpec, record: ClusterRecord, wanted: Mapping[str, int]) -> None:
    """Refuse, in one line that says how to fix it, what the cluster cannot do now."""
    if record.state.terminal:
        raise UsageError(f"cluster {record.name!r} has {record.state.value}; there is nothing to scale",
                         hint=f"start it again with `{record.up_command()}`")
    if not supervisor_alive(cdir, record):
        raise UsageError(f"cluster {record.name!r} has no supervisor running to carry out the change",
                         hint=f"start one with `psctl supervise {record.name}`, then scale")
    if spec.training.get("framework") == "tensorflow":
        raise UsageError("a TensorFlow program's cluster is fixed when it starts (its TF_CONFIG): it cannot be "
                         "scaled; change the spec and `psctl up` again")
    for role, n in wanted.items():
        rs = spec.roles[role]
        high = rs.slots
        if n > high:
            where = spec.source.where(("roles", role, "max_replicas" if rs.max_replicas else "replicas"))
            raise UsageError(
                f"{role}={n} is more than roles.{role}.max_replicas ({high}) in {where}",
                hint="raise max_replicas there and `psctl up` again: every replica's certificate and port "
                     "are made at up",
            )
        if n < rs.min_replicas:
            where = spec.source.where(("roles", role, "min_replicas"))
            raise UsageError(f"{role}={n} is fewer than roles.{role}.min_replicas ({rs.min_replicas}) in "
                             f"{where}", hint=f"scale to at least {rs.min_replicas}")
        aggregated = spec.training.get("replicas_to_aggregate")
        if (role == "worker" and spec.training.get("mode") == "sync" and spec.training.get("distinct_replicas")
                and aggregated and n < int(aggregated)):  # (else fewer workers compute several batches a step)
            raise UsageError(f"worker={n} is fewer than training.replicas_to_aggregate ({aggregated}), and "
                             "distinct_replicas takes one gradient from each worker per step: no step could "
                             "complete", hint=f"scale to at least {aggregated}")
        leaving = [r.name for r in record.roles if r.role == role and r.retired and r.pid is not None]
        if leaving:
            # (status shows them stopped already: they were told to go, and finish the steps they run first)
            raise UsageError(f"{', '.join(leaving)} of the last scale-down are still finishing their steps",
                             hint=f"try again in a moment: they leave within supervision.preemption_grace "
                                  f"({seconds_text(spec.supervision.preemption_grace)})")


def scale(cdir: ClusterDir, wanted: Mapping[str, int], *, timeout: float = 30.0) -> list[Change]:
    """Ask the supervisor for ``wanted`` replicas and wait (bounded) until its record shows them. One scale of a
    cluster at a time: a second waits (within ``timeout``) for the first to be carried out, then starts from
    the replicas it left."""
    held = exclusive_lock(cdir.scale_lock, wait=timeout)
    if held is None:
        raise PsctlError(f"another `psctl scale {cdir.name}` is still waiting for its change after {timeout:.0f}s",
                         hint=f"see `psctl events {cdir.name}`; try again once it has finished")
    try:
        return _scale_holding_the_lock(cdir, wanted, timeout)
    finally:
        release(held)


def _scale_holding_the_lock(cdir: ClusterDir, wanted: Mapping[str, int], timeout: float) -> list[Change]:
    record = load_state(cdir.state_file)
    spec = cluster_spec(cdir.spec_file, record)
    check_request(cdir, spec, record, wanted)
    before = {role: len(members(record, role)) for role in wanted}
    if cdir.scale_request.exists():
        raise UsageError("an earlier scale request has not been taken by the supervisor yet",
                         hint=f"see `psctl status {cdir.name}`; try again in a moment")
    write_json_atomic(cdir.scale_request, {"replicas": dict(wanted)})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = load_state(cdir.state_file)
        taken = not cdir.scale_request.exists()  # (the next scale must not find this one's request)
        if taken and all(len(members(record, role)) == n for role, n in wanted.items()):
            return [Change(role, before[role], n) for role, n in wanted.items()]
        if record.state.terminal:
            break
        time.sleep(0.1)
    cdir.scale_request.unlink(missing_ok=True)
    raise PsctlError(f"the supervisor of {cdir.name!r} did not carry out the change within {timeout:.0f}s "
                     f"(the cluster is {record.state.value})", hint=f"see `psctl events {cdir.name}`")

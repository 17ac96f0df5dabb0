"""The training section of a cluster spec, as the runtime receives it (JSON in PSCTL_CLUSTER).

The launcher validates the spec with line numbers and fills its defaults; this class only gives the
runtime typed access, with the same defaults for a runtime started by hand from TF_CONFIG.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from psctl.proto import psctl_pb2 as pb


@dataclass(frozen=True)
class TrainingConfig:
    program: str = "psctl.models.mlp"
    args: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=lambda: {"name": "digits"})
    batch_size: int = 100
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "adam", "learning_rate": 0.01})
    mode: str = "async"
    replicas_to_aggregate: int | None = None
    total_replicas: int | None = None
    staleness: int | None = None
    #: Synchronous mode: seconds to wait for missing replicas, the fewest a step may proceed with after
    #: that, and whether distinct replicas (not gradients) count towards replicas_to_aggregate.
    replica_timeout: float | None = None
    min_replicas: int | None = None
    distinct_replicas: bool | None = None
    #: Asynchronous mode: two steps in flight per worker, its communication overlapping its computation.
    pipelined: bool = False
    #: Asynchronous mode: steps a worker runs per call from the chief (TensorFlow's steps_per_execution): the
    #: chief's round trip is paid once per call instead of once per step. "auto": sized from the steps'
    #: durations (psctl.runtime.call_size).
    steps_per_execution: int | str = "auto"
    steps: int = 1000
    #: Where variables go: "balanced" (by bytes, psctl's default) or "round_robin" (TensorFlow's order).
    placement: str = "balanced"
    #: The training data's shards (the worker count at ``up``); any worker may read any shard.
    data_shards: int | None = None
    seed: int = 0
    partitioner: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    log_every_seconds: float = 1.0
    eval_every_steps: int = 0
    #: The evaluator stops after this many evaluations (0: when training is done).
    max_evaluations: int = 0
    #: Seconds a step may run before it is re-scheduled on another worker (0: no deadline), counted from when the
    #: chief sends it: an asynchronous step queued behind another on its worker spends part of it waiting. A call
    #: of several steps (steps_per_execution) has this for each of them. "auto": from the steps' durations
    #: (psctl.runtime.coordinator.AUTO).
    step_timeout: float | str = "auto"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainingConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown training keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in raw.items() if v is not None or k in ("partitioner", "checkpoint")})

    def optimizer_proto(self) -> pb.OptimizerConfig:
        opt = dict(self.optimizer)
        name = str(opt.pop("name", "adam"))
        lr = float(opt.pop("learning_rate", 0.01))
        return pb.OptimizerConfig(name=name, learning_rate=lr, params={k: float(v) for k, v in opt.items()})

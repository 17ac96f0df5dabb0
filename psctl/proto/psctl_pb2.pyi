from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[Kind]
    IDS: _ClassVar[Kind]
    ROWS: _ClassVar[Kind]
    SLOT: _ClassVar[Kind]
    LEFT_FACTOR: _ClassVar[Kind]
    RIGHT_FACTOR: _ClassVar[Kind]
    PULL_IDS: _ClassVar[Kind]
DENSE: Kind
IDS: Kind
ROWS: Kind
SLOT: Kind
LEFT_FACTOR: Kind
RIGHT_FACTOR: Kind
PULL_IDS: Kind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "offset", "size")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    offset: int
    size: int
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "kind", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: Kind
    tensor: Tensor
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[Kind, str]] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class VariableSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "full_shape", "row_offset", "initializer", "init_scale", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    row_offset: int
    initializer: str
    init_scale: float
    seed: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., full_shape: _Optional[_Iterable[int]] = ..., row_offset: _Optional[int] = ..., initializer: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class OptimizerConfig(_message.Message):
    __slots__ = ("name", "learning_rate", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    params: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("variables", "optimizer", "cluster_id", "reset", "replicas_to_aggregate", "distinct_replicas", "chief_incarnation", "model_id")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableSpec]
    optimizer: OptimizerConfig
    cluster_id: str
    reset: bool
    replicas_to_aggregate: int
    distinct_replicas: bool
    chief_incarnation: int
    model_id: int
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableSpec, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., cluster_id: _Optional[str] = ..., reset: _Optional[bool] = ..., replicas_to_aggregate: _Optional[int] = ..., distinct_replicas: _Optional[bool] = ..., chief_incarnation: _Optional[int] = ..., model_id: _Optional[int] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("already_initialized", "global_step", "model_id")
    ALREADY_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    already_initialized: bool
    global_step: int
    model_id: int
    def __init__(self, already_initialized: _Optional[bool] = ..., global_step: _Optional[int] = ..., model_id: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("entries", "include_slots")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    include_slots: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., include_slots: _Optional[bool] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("entries", "global_step")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    global_step: int
    def __init__(self, entries: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., global_step: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("step_id", "task", "incarnation", "entries", "increment_global_step", "local_step", "shard", "position", "pull_dense", "chief_incarnation")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INCREMENT_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PULL_DENSE_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    task: str
    incarnation: int
    entries: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    increment_global_step: bool
    local_step: int
    shard: int
    position: int
    pull_dense: _containers.RepeatedScalarFieldContainer[str]
    chief_incarnation: int
    def __init__(self, step_id: _Optional[int] = ..., task: _Optional[str] = ..., incarnation: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., increment_global_step: _Optional[bool] = ..., local_step: _Optional[int] = ..., shard: _Optional[int] = ..., position: _Optional[int] = ..., pull_dense: _Optional[_Iterable[str]] = ..., chief_incarnation: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("applied", "global_step", "stale", "entries")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    global_step: int
    stale: bool
    entries: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, applied: _Optional[bool] = ..., global_step: _Optional[int] = ..., stale: _Optional[bool] = ..., entries: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("part",)
    PART_FIELD_NUMBER: _ClassVar[int]
    part: PushRequest
    def __init__(self, part: _Optional[_Union[PushRequest, _Mapping]] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("part",)
    PART_FIELD_NUMBER: _ClassVar[int]
    part: PullResponse
    def __init__(self, part: _Optional[_Union[PullResponse, _Mapping]] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("entries", "global_step", "shard_positions", "chief_incarnation", "sync_counters", "model_id")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SYNC_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    global_step: int
    shard_positions: _containers.RepeatedScalarFieldContainer[int]
    chief_incarnation: int
    sync_counters: SyncCounters
    model_id: int
    def __init__(self, entries: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ..., global_step: _Optional[int] = ..., shard_positions: _Optional[_Iterable[int]] = ..., chief_incarnation: _Optional[int] = ..., sync_counters: _Optional[_Union[SyncCounters, _Mapping]] = ..., model_id: _Optional[int] = ...) -> None: ...

class SyncCounters(_message.Message):
    __slots__ = ("gradients_applied", "stale_dropped", "timed_out_steps")
    GRADIENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_STEPS_FIELD_NUMBER: _ClassVar[int]
    gradients_applied: int
    stale_dropped: int
    timed_out_steps: int
    def __init__(self, gradients_applied: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., timed_out_steps: _Optional[int] = ...) -> None: ...

class AssignChunk(_message.Message):
    __slots__ = ("part",)
    PART_FIELD_NUMBER: _ClassVar[int]
    part: AssignRequest
    def __init__(self, part: _Optional[_Union[AssignRequest, _Mapping]] = ...) -> None: ...

class PushRequestFrame(_message.Message):
    __slots__ = ("header", "padding", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PushRequest
    padding: bytes
    payload: bytes
    def __init__(self, header: _Optional[_Union[PushRequest, _Mapping]] = ..., padding: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushResponseFrame(_message.Message):
    __slots__ = ("header", "padding", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PushResponse
    padding: bytes
    payload: bytes
    def __init__(self, header: _Optional[_Union[PushResponse, _Mapping]] = ..., padding: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PullRequestFrame(_message.Message):
    __slots__ = ("header", "padding", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PullRequest
    padding: bytes
    payload: bytes
    def __init__(self, header: _Optional[_Union[PullRequest, _Mapping]] = ..., padding: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PullResponseFrame(_message.Message):
    __slots__ = ("header", "padding", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PullResponse
    padding: bytes
    payload: bytes
    def __init__(self, header: _Optional[_Union[PullResponse, _Mapping]] = ..., padding: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class AssignRequestFrame(_message.Message):
    __slots__ = ("header", "padding", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: AssignRequest
    padding: bytes
    payload: bytes
    def __init__(self, header: _Optional[_Union[AssignRequest, _Mapping]] = ..., padding: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("global_step",)
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    def __init__(self, global_step: _Optional[int] = ...) -> None: ...

class SyncFlushRequest(_message.Message):
    __slots__ = ("step", "min_replicas", "chief_incarnation")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    step: int
    min_replicas: int
    chief_incarnation: int
    def __init__(self, step: _Optional[int] = ..., min_replicas: _Optional[int] = ..., chief_incarnation: _Optional[int] = ...) -> None: ...

class SyncFlushResponse(_message.Message):
    __slots__ = ("applied", "replicas", "global_step")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    replicas: int
    global_step: int
    def __init__(self, applied: _Optional[bool] = ..., replicas: _Optional[int] = ..., global_step: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("include_step_ids", "chief_incarnation", "release", "training_over")
    INCLUDE_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_OVER_FIELD_NUMBER: _ClassVar[int]
    include_step_ids: bool
    chief_incarnation: int
    release: bool
    training_over: bool
    def __init__(self, include_step_ids: _Optional[bool] = ..., chief_incarnation: _Optional[int] = ..., release: _Optional[bool] = ..., training_over: _Optional[bool] = ...) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("global_step", "variables", "applied_updates", "duplicate_updates", "fenced_updates", "initialized", "applied_step_ids", "shard_positions", "newest_step_id", "sync_gradients_applied", "stale_dropped", "timed_out_steps", "pending_replicas", "leaving")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    FENCED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEP_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_GRADIENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_STEPS_FIELD_NUMBER: _ClassVar[int]
    PENDING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    applied_updates: int
    duplicate_updates: int
    fenced_updates: int
    initialized: bool
    applied_step_ids: _containers.RepeatedScalarFieldContainer[int]
    shard_positions: _containers.RepeatedScalarFieldContainer[int]
    newest_step_id: int
    sync_gradients_applied: int
    stale_dropped: int
    timed_out_steps: int
    pending_replicas: int
    leaving: bool
    def __init__(self, global_step: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ..., applied_updates: _Optional[int] = ..., duplicate_updates: _Optional[int] = ..., fenced_updates: _Optional[int] = ..., initialized: _Optional[bool] = ..., applied_step_ids: _Optional[_Iterable[int]] = ..., shard_positions: _Optional[_Iterable[int]] = ..., newest_step_id: _Optional[int] = ..., sync_gradients_applied: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., timed_out_steps: _Optional[int] = ..., pending_replicas: _Optional[int] = ..., leaving: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "shard", "position", "function", "sync_step", "params_epoch", "steps", "chief_incarnation", "ps_addresses")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SYNC_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PS_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    shard: int
    position: int
    function: str
    sync_step: int
    params_epoch: int
    steps: int
    chief_incarnation: int
    ps_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step_id: _Optional[int] = ..., shard: _Optional[int] = ..., position: _Optional[int] = ..., function: _Optional[str] = ..., sync_step: _Optional[int] = ..., params_epoch: _Optional[int] = ..., steps: _Optional[int] = ..., chief_incarnation: _Optional[int] = ..., ps_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("loss", "examples", "metrics", "compute_seconds", "step_seconds", "global_step", "applied", "ps_global_steps", "steps")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    PS_GLOBAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    examples: int
    metrics: _containers.ScalarMap[str, float]
    compute_seconds: float
    step_seconds: float
    global_step: int
    applied: bool
    ps_global_steps: _containers.RepeatedScalarFieldContainer[int]
    steps: int
    def __init__(self, loss: _Optional[float] = ..., examples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., compute_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., global_step: _Optional[int] = ..., applied: _Optional[bool] = ..., ps_global_steps: _Optional[_Iterable[int]] = ..., steps: _Optional[int] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("chief_incarnation", "training_over", "feeding_stopped")
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TRAINING_OVER_FIELD_NUMBER: _ClassVar[int]
    FEEDING_STOPPED_FIELD_NUMBER: _ClassVar[int]
    chief_incarnation: int
    training_over: bool
    feeding_stopped: bool
    def __init__(self, chief_incarnation: _Optional[int] = ..., training_over: _Optional[bool] = ..., feeding_stopped: _Optional[bool] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("incarnation", "task")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    task: str
    def __init__(self, incarnation: _Optional[int] = ..., task: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("task", "incarnation", "pid", "global_step", "local_step", "loss", "steps_per_second", "rss_bytes", "status", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    task: str
    incarnation: int
    pid: int
    global_step: int
    local_step: int
    loss: float
    steps_per_second: float
    rss_bytes: int
    status: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, task: _Optional[str] = ..., incarnation: _Optional[int] = ..., pid: _Optional[int] = ..., global_step: _Optional[int] = ..., local_step: _Optional[int] = ..., loss: _Optional[float] = ..., steps_per_second: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., status: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("fenced", "addresses", "chief_incarnation")
    class AddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FENCED_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    fenced: bool
    addresses: _containers.ScalarMap[str, str]
    chief_incarnation: int
    def __init__(self, fenced: _Optional[bool] = ..., addresses: _Optional[_Mapping[str, str]] = ..., chief_incarnation: _Optional[int] = ...) -> None: ...

class RoleReport(_message.Message):
    __slots__ = ("name", "incarnation", "attempt", "pid", "create_time", "exited", "exit_code", "log_tail", "start_error", "heartbeat_age", "last")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    START_ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    attempt: int
    pid: int
    create_time: float
    exited: bool
    exit_code: int
    log_tail: str
    start_error: str
    heartbeat_age: float
    last: HeartbeatRequest
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., attempt: _Optional[int] = ..., pid: _Optional[int] = ..., create_time: _Optional[float] = ..., exited: _Optional[bool] = ..., exit_code: _Optional[int] = ..., log_tail: _Optional[str] = ..., start_error: _Optional[str] = ..., heartbeat_age: _Optional[float] = ..., last: _Optional[_Union[HeartbeatRequest, _Mapping]] = ...) -> None: ...

class AgentReport(_message.Message):
    __slots__ = ("host", "agent_pid", "agent_create_time", "heartbeat_address", "hello", "roles", "changed")
    HOST_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    AGENT_CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    host: str
    agent_pid: int
    agent_create_time: float
    heartbeat_address: str
    hello: bool
    roles: _containers.RepeatedCompositeFieldContainer[RoleReport]
    changed: bool
    def __init__(self, host: _Optional[str] = ..., agent_pid: _Optional[int] = ..., agent_create_time: _Optional[float] = ..., heartbeat_address: _Optional[str] = ..., hello: _Optional[bool] = ..., roles: _Optional[_Iterable[_Union[RoleReport, _Mapping]]] = ..., changed: _Optional[bool] = ...) -> None: ...

class StartRole(_message.Message):
    __slots__ = ("name", "incarnation", "attempt", "argv", "env", "cwd", "log_path", "files", "watched_only", "cpu_slot", "cpu_slots")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    WATCHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    CPU_SLOT_FIELD_NUMBER: _ClassVar[int]
    CPU_SLOTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    attempt: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    log_path: str
    files: _containers.ScalarMap[str, bytes]
    watched_only: bool
    cpu_slot: int
    cpu_slots: int
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., attempt: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., log_path: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ..., watched_only: _Optional[bool] = ..., cpu_slot: _Optional[int] = ..., cpu_slots: _Optional[int] = ...) -> None: ...

class StopRole(_message.Message):
    __slots__ = ("name", "incarnation", "grace_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: int
    grace_seconds: float
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[int] = ..., grace_seconds: _Optional[float] = ...) -> None: ...

class AddressMap(_message.Message):
    __slots__ = ("addresses",)
    class AddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.ScalarMap[str, str]
    def __init__(self, addresses: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("addresses", "chief_incarnation")
    class AddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: AddressMap
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[AddressMap, _Mapping]] = ...) -> None: ...
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.MessageMap[str, AddressMap]
    chief_incarnation: int
    def __init__(self, addresses: _Optional[_Mapping[str, AddressMap]] = ..., chief_incarnation: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class CpuSlots(_message.Message):
    __slots__ = ("cpu_slot", "cpu_slots")
    class CpuSlotEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CPU_SLOT_FIELD_NUMBER: _ClassVar[int]
    CPU_SLOTS_FIELD_NUMBER: _ClassVar[int]
    cpu_slot: _containers.ScalarMap[str, int]
    cpu_slots: int
    def __init__(self, cpu_slot: _Optional[_Mapping[str, int]] = ..., cpu_slots: _Optional[int] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("start", "stop", "view", "shutdown", "cpus")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    start: StartRole
    stop: StopRole
    view: ClusterView
    shutdown: Shutdown
    cpus: CpuSlots
    def __init__(self, start: _Optional[_Union[StartRole, _Mapping]] = ..., stop: _Optional[_Union[StopRole, _Mapping]] = ..., view: _Optional[_Union[ClusterView, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., cpus: _Optional[_Union[CpuSlots, _Mapping]] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    WAITING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    EXPORTING: _ClassVar[JobState]
    FINISHED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    PROBING: _ClassVar[JobState]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType
JOB_STATE_UNSPECIFIED: JobState
WAITING: JobState
RUNNING: JobState
EXPORTING: JobState
FINISHED: JobState
FAILED: JobState
PROBING: JobState

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "momentum", "dampening", "nesterov", "weight_decay", "beta1", "beta2", "eps", "trust_coefficient", "exclude_1d")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    TRUST_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_1D_FIELD_NUMBER: _ClassVar[int]
    name: str
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    trust_coefficient: float
    exclude_1d: bool
    def __init__(self, name: _Optional[str] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., trust_coefficient: _Optional[float] = ..., exclude_1d: _Optional[bool] = ...) -> None: ...

class LrSchedule(_message.Message):
    __slots__ = ("base_lr", "scaled_lr", "warmup_steps", "scaling")
    BASE_LR_FIELD_NUMBER: _ClassVar[int]
    SCALED_LR_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    base_lr: float
    scaled_lr: float
    warmup_steps: int
    scaling: str
    def __init__(self, base_lr: _Optional[float] = ..., scaled_lr: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., scaling: _Optional[str] = ...) -> None: ...

class ParamSpec(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("job_id", "model_factory", "model_kwargs_json", "data_factory", "data_kwargs_json", "loss", "optimizer", "lr_schedule", "per_device_batch", "global_batch", "total_devices", "workers", "devices_per_worker", "steps", "seed", "ps_shards", "total_params", "params", "chunk_bytes", "push_timeout_s", "pull_timeout_s", "heartbeat_s", "devices", "layer_policies", "prefetch", "pinned_limit_bytes", "checkpoint_every_steps", "checkpoint_dir", "checkpoint_keep", "on_nonfinite", "coordinator_timeout_s", "bucket_bytes", "push_dtype", "shared_memory_off", "max_waiting_pulls", "max_waiting_pulls_per_peer", "bulk_sockets_off", "offload_params", "embeddings", "profile_blocks", "profile_batches", "memory_profile", "data_prefetch_off")
    class LayerPoliciesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FACTORY_FIELD_NUMBER: _ClassVar[int]
    MODEL_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FACTORY_FIELD_NUMBER: _ClassVar[int]
    DATA_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    PER_DEVICE_BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PS_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PULL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LAYER_POLICIES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PINNED_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEEP_FIELD_NUMBER: _ClassVar[int]
    ON_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_OFF_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_PULLS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_PULLS_PER_PEER_FIELD_NUMBER: _ClassVar[int]
    BULK_SOCKETS_OFF_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PROFILE_FIELD_NUMBER: _ClassVar[int]
    DATA_PREFETCH_OFF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    model_factory: str
    model_kwargs_json: str
    data_factory: str
    data_kwargs_json: str
    loss: str
    optimizer: OptimizerSpec
    lr_schedule: LrSchedule
    per_device_batch: int
    global_batch: int
    total_devices: int
    workers: int
    devices_per_worker: int
    steps: int
    seed: int
    ps_shards: int
    total_params: int
    params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    chunk_bytes: int
    push_timeout_s: float
    pull_timeout_s: float
    heartbeat_s: float
    devices: _containers.RepeatedScalarFieldContainer[str]
    layer_policies: _containers.ScalarMap[str, str]
    prefetch: int
    pinned_limit_bytes: int
    checkpoint_every_steps: int
    checkpoint_dir: str
    checkpoint_keep: int
    on_nonfinite: str
    coordinator_timeout_s: float
    bucket_bytes: int
    push_dtype: DType
    shared_memory_off: bool
    max_waiting_pulls: int
    max_waiting_pulls_per_peer: int
    bulk_sockets_off: bool
    offload_params: bool
    embeddings: _containers.RepeatedCompositeFieldContainer[EmbeddingTableSpec]
    profile_blocks: _containers.RepeatedScalarFieldContainer[str]
    profile_batches: _containers.RepeatedScalarFieldContainer[int]
    memory_profile: str
    data_prefetch_off: bool
    def __init__(self, job_id: _Optional[str] = ..., model_factory: _Optional[str] = ..., model_kwargs_json: _Optional[str] = ..., data_factory: _Optional[str] = ..., data_kwargs_json: _Optional[str] = ..., loss: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., lr_schedule: _Optional[_Union[LrSchedule, _Mapping]] = ..., per_device_batch: _Optional[int] = ..., global_batch: _Optional[int] = ..., total_devices: _Optional[int] = ..., workers: _Optional[int] = ..., devices_per_worker: _Optional[int] = ..., steps: _Optional[int] = ..., seed: _Optional[int] = ..., ps_shards: _Optional[int] = ..., total_params: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., push_timeout_s: _Optional[float] = ..., pull_timeout_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., devices: _Optional[_Iterable[str]] = ..., layer_policies: _Optional[_Mapping[str, str]] = ..., prefetch: _Optional[int] = ..., pinned_limit_bytes: _Optional[int] = ..., checkpoint_every_steps: _Optional[int] = ..., checkpoint_dir: _Optional[str] = ..., checkpoint_keep: _Optional[int] = ..., on_nonfinite: _Optional[str] = ..., coordinator_timeout_s: _Optional[float] = ..., bucket_bytes: _Optional[int] = ..., push_dtype: _Optional[_Union[DType, str]] = ..., shared_memory_off: _Optional[bool] = ..., max_waiting_pulls: _Optional[int] = ..., max_waiting_pulls_per_peer: _Optional[int] = ..., bulk_sockets_off: _Optional[bool] = ..., offload_params: _Optional[bool] = ..., embeddings: _Optional[_Iterable[_Union[EmbeddingTableSpec, _Mapping]]] = ..., profile_blocks: _Optional[_Iterable[str]] = ..., profile_batches: _Optional[_Iterable[int]] = ..., memory_profile: _Optional[str] = ..., data_prefetch_off: _Optional[bool] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("shard_id", "worker_id", "step", "device_count", "dtype", "numel", "skip", "piece_start", "shm_nonce", "bulk_ticket", "pull_after")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    PIECE_START_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    PULL_AFTER_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    worker_id: int
    step: int
    device_count: int
    dtype: DType
    numel: int
    skip: bool
    piece_start: int
    shm_nonce: bytes
    bulk_ticket: bytes
    pull_after: bool
    def __init__(self, shard_id: _Optional[int] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., device_count: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., numel: _Optional[int] = ..., skip: _Optional[bool] = ..., piece_start: _Optional[int] = ..., shm_nonce: _Optional[bytes] = ..., bulk_ticket: _Optional[bytes] = ..., pull_after: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version", "duplicate", "completed", "skipped", "pulled")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    version: int
    duplicate: bool
    completed: bool
    skipped: bool
    pulled: PullReply
    def __init__(self, version: _Optional[int] = ..., duplicate: _Optional[bool] = ..., completed: _Optional[bool] = ..., skipped: _Optional[bool] = ..., pulled: _Optional[_Union[PullReply, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("shard_id", "min_version", "piece_start", "shm_worker", "shm_nonce", "bulk_ticket", "bulk_numel", "board")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PIECE_START_FIELD_NUMBER: _ClassVar[int]
    SHM_WORKER_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_NUMEL_FIELD_NUMBER: _ClassVar[int]
    BOARD_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    min_version: int
    piece_start: int
    shm_worker: int
    shm_nonce: bytes
    bulk_ticket: bytes
    bulk_numel: int
    board: bool
    def __init__(self, shard_id: _Optional[int] = ..., min_version: _Optional[int] = ..., piece_start: _Optional[int] = ..., shm_worker: _Optional[int] = ..., shm_nonce: _Optional[bytes] = ..., bulk_ticket: _Optional[bytes] = ..., bulk_numel: _Optional[int] = ..., board: _Optional[bool] = ...) -> None: ...

class PullAtRequest(_message.Message):
    __slots__ = ("shard_id", "version")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    version: int
    def __init__(self, shard_id: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PullReply(_message.Message):
    __slots__ = ("version", "chunk", "board_slot")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BOARD_SLOT_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: TensorChunk
    board_slot: int
    def __init__(self, version: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., board_slot: _Optional[int] = ...) -> None: ...

class ShardStatusRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class SetWorkersRequest(_message.Message):
    __slots__ = ("from_version", "worker_ids", "scaled_lr")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    SCALED_LR_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    worker_ids: _containers.RepeatedScalarFieldContainer[int]
    scaled_lr: float
    def __init__(self, from_version: _Optional[int] = ..., worker_ids: _Optional[_Iterable[int]] = ..., scaled_lr: _Optional[float] = ...) -> None: ...

class SetWorkersReply(_message.Message):
    __slots__ = ("included_all", "included_any")
    INCLUDED_ALL_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_ANY_FIELD_NUMBER: _ClassVar[int]
    included_all: bool
    included_any: bool
    def __init__(self, included_all: _Optional[bool] = ..., included_any: _Optional[bool] = ...) -> None: ...

class ShardStatus(_message.Message):
    __slots__ = ("shard_id", "start", "end", "version", "pushes_waiting", "workers_expected", "bytes_held", "optimizer", "worker_step")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_WAITING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    start: int
    end: int
    version: int
    pushes_waiting: int
    workers_expected: int
    bytes_held: int
    optimizer: str
    worker_step: int
    def __init__(self, shard_id: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., version: _Optional[int] = ..., pushes_waiting: _Optional[int] = ..., workers_expected: _Optional[int] = ..., bytes_held: _Optional[int] = ..., optimizer: _Optional[str] = ..., worker_step: _Optional[int] = ...) -> None: ...

class NormPartial(_message.Message):
    __slots__ = ("param_index", "values")
    PARAM_INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    param_index: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, param_index: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class NormPost(_message.Message):
    __slots__ = ("from_shard", "step", "partials")
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    from_shard: int
    step: int
    partials: _containers.RepeatedCompositeFieldContainer[NormPartial]
    def __init__(self, from_shard: _Optional[int] = ..., step: _Optional[int] = ..., partials: _Optional[_Iterable[_Union[NormPartial, _Mapping]]] = ...) -> None: ...

class ShmRequest(_message.Message):
    __slots__ = ("shard_id", "worker_id")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    worker_id: int
    def __init__(self, shard_id: _Optional[int] = ..., worker_id: _Optional[int] = ...) -> None: ...

class ShmRegions(_message.Message):
    __slots__ = ("push_path", "pull_path", "numel", "header_bytes", "nonce", "board_path", "board_pieces", "board_nonce")
    PUSH_PATH_FIELD_NUMBER: _ClassVar[int]
    PULL_PATH_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BOARD_PATH_FIELD_NUMBER: _ClassVar[int]
    BOARD_PIECES_FIELD_NUMBER: _ClassVar[int]
    BOARD_NONCE_FIELD_NUMBER: _ClassVar[int]
    push_path: str
    pull_path: str
    numel: int
    header_bytes: int
    nonce: bytes
    board_path: str
    board_pieces: int
    board_nonce: bytes
    def __init__(self, push_path: _Optional[str] = ..., pull_path: _Optional[str] = ..., numel: _Optional[int] = ..., header_bytes: _Optional[int] = ..., nonce: _Optional[bytes] = ..., board_path: _Optional[str] = ..., board_pieces: _Optional[int] = ..., board_nonce: _Optional[bytes] = ...) -> None: ...

class BulkRequest(_message.Message):
    __slots__ = ("shard_id", "worker_id")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    worker_id: int
    def __init__(self, shard_id: _Optional[int] = ..., worker_id: _Optional[int] = ...) -> None: ...

class BulkGrant(_message.Message):
    __slots__ = ("port", "nonce")
    PORT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    port: int
    nonce: bytes
    def __init__(self, port: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class RegisterPsRequest(_message.Message):
    __slots__ = ("shard_id", "address", "metrics_address")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    address: str
    metrics_address: str
    def __init__(self, shard_id: _Optional[int] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class RegisterPsReply(_message.Message):
    __slots__ = ("job", "start", "end", "resume_step", "member_credential", "job_key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    JOB_KEY_FIELD_NUMBER: _ClassVar[int]
    job: JobSpec
    start: int
    end: int
    resume_step: int
    member_credential: str
    job_key: bytes
    def __init__(self, job: _Optional[_Union[JobSpec, _Mapping]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., resume_step: _Optional[int] = ..., member_credential: _Optional[str] = ..., job_key: _Optional[bytes] = ...) -> None: ...

class CheckpointWritten(_message.Message):
    __slots__ = ("shard_id", "step")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    step: int
    def __init__(self, shard_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class CheckpointAck(_message.Message):
    __slots__ = ("committed_step",)
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    committed_step: int
    def __init__(self, committed_step: _Optional[int] = ...) -> None: ...

class InitialParametersRequest(_message.Message):
    __slots__ = ("shard_id",)
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    def __init__(self, shard_id: _Optional[int] = ...) -> None: ...

class PsReadyRequest(_message.Message):
    __slots__ = ("shard_id",)
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    def __init__(self, shard_id: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "devices", "hostname", "metrics_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    hostname: str
    metrics_address: str
    def __init__(self, address: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., hostname: _Optional[str] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("worker_id", "job", "replacement", "devices", "device_memory_bytes", "host_memory_bytes", "start_step", "member_credential")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    job: JobSpec
    replacement: bool
    devices: _containers.RepeatedScalarFieldContainer[str]
    device_memory_bytes: int
    host_memory_bytes: int
    start_step: int
    member_credential: str
    def __init__(self, worker_id: _Optional[int] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., replacement: _Optional[bool] = ..., devices: _Optional[_Iterable[str]] = ..., device_memory_bytes: _Optional[int] = ..., host_memory_bytes: _Optional[int] = ..., start_step: _Optional[int] = ..., member_credential: _Optional[str] = ...) -> None: ...

class WaitForClusterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class ClusterView(_message.Message):
    __slots__ = ("ps_addresses", "state", "job", "probe")
    PS_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    ps_addresses: _containers.RepeatedScalarFieldContainer[str]
    state: JobState
    job: JobSpec
    probe: bool
    def __init__(self, ps_addresses: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[JobState, str]] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., probe: _Optional[bool] = ...) -> None: ...

class ProbeReport(_message.Message):
    __slots__ = ("worker_id", "per_device_batch", "device_peak_bytes", "host_peak_bytes", "limit_bytes", "profile")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PER_DEVICE_BATCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    per_device_batch: int
    device_peak_bytes: int
    host_peak_bytes: int
    limit_bytes: int
    profile: DeviceProfile
    def __init__(self, worker_id: _Optional[int] = ..., per_device_batch: _Optional[int] = ..., device_peak_bytes: _Optional[int] = ..., host_peak_bytes: _Optional[int] = ..., limit_bytes: _Optional[int] = ..., profile: _Optional[_Union[DeviceProfile, _Mapping]] = ...) -> None: ...

class LayerProfileEntry(_message.Message):
    __slots__ = ("name", "param_bytes", "saved_bytes_per_sample", "saved_bytes_fixed", "output_bytes_per_sample", "forward_s", "backward_s", "inputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIXED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_S_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    param_bytes: int
    saved_bytes_per_sample: float
    saved_bytes_fixed: float
    output_bytes_per_sample: float
    forward_s: float
    backward_s: float
    inputs: _containers.RepeatedCompositeFieldContainer[LayerInput]
    def __init__(self, name: _Optional[str] = ..., param_bytes: _Optional[int] = ..., saved_bytes_per_sample: _Optional[float] = ..., saved_bytes_fixed: _Optional[float] = ..., output_bytes_per_sample: _Optional[float] = ..., forward_s: _Optional[float] = ..., backward_s: _Optional[float] = ..., inputs: _Optional[_Iterable[_Union[LayerInput, _Mapping]]] = ...) -> None: ...

class LayerInput(_message.Message):
    __slots__ = ("bytes_per_sample", "bytes_fixed", "saved_by", "saved_here", "storage")
    BYTES_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIXED_FIELD_NUMBER: _ClassVar[int]
    SAVED_BY_FIELD_NUMBER: _ClassVar[int]
    SAVED_HERE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    bytes_per_sample: float
    bytes_fixed: float
    saved_by: str
    saved_here: bool
    storage: int
    def __init__(self, bytes_per_sample: _Optional[float] = ..., bytes_fixed: _Optional[float] = ..., saved_by: _Optional[str] = ..., saved_here: _Optional[bool] = ..., storage: _Optional[int] = ...) -> None: ...

class DeviceProfile(_message.Message):
    __slots__ = ("layers", "batch", "device", "device_total_bytes", "unprofiled_param_bytes", "unprofiled_saved_per_sample", "unprofiled_saved_fixed", "host_total_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNPROFILED_PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNPROFILED_SAVED_PER_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    UNPROFILED_SAVED_FIXED_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerProfileEntry]
    batch: int
    device: str
    device_total_bytes: int
    unprofiled_param_bytes: int
    unprofiled_saved_per_sample: float
    unprofiled_saved_fixed: float
    host_total_bytes: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerProfileEntry, _Mapping]]] = ..., batch: _Optional[int] = ..., device: _Optional[str] = ..., device_total_bytes: _Optional[int] = ..., unprofiled_param_bytes: _Optional[int] = ..., unprofiled_saved_per_sample: _Optional[float] = ..., unprofiled_saved_fixed: _Optional[float] = ..., host_total_bytes: _Optional[int] = ...) -> None: ...

class ProbeVerdict(_message.Message):
    __slots__ = ("done", "job", "limit_bytes", "message")
    DONE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    done: bool
    job: JobSpec
    limit_bytes: int
    message: str
    def __init__(self, done: _Optional[bool] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., limit_bytes: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DataShardRequest(_message.Message):
    __slots__ = ("worker_id", "request_seq")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    request_seq: int
    def __init__(self, worker_id: _Optional[int] = ..., request_seq: _Optional[int] = ...) -> None: ...

class DataShard(_message.Message):
    __slots__ = ("data_shard_id", "epoch", "indices")
    DATA_SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    data_shard_id: int
    epoch: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data_shard_id: _Optional[int] = ..., epoch: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class CompleteDataShardRequest(_message.Message):
    __slots__ = ("worker_id", "data_shard_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    data_shard_id: int
    def __init__(self, worker_id: _Optional[int] = ..., data_shard_id: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("worker_id", "step", "loss", "samples", "step_s", "nonfinite")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    loss: float
    samples: int
    step_s: float
    nonfinite: bool
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., step_s: _Optional[float] = ..., nonfinite: _Optional[bool] = ...) -> None: ...

class ModelRefusal(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    reason: str
    def __init__(self, worker_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("role", "id", "rss_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    id: int
    rss_bytes: int
    def __init__(self, role: _Optional[str] = ..., id: _Optional[int] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("stop", "state", "reason", "retryable")
    STOP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    state: JobState
    reason: str
    retryable: bool
    def __init__(self, stop: _Optional[bool] = ..., state: _Optional[_Union[JobState, str]] = ..., reason: _Optional[str] = ..., retryable: _Optional[bool] = ...) -> None: ...

class WatchProgressRequest(_message.Message):
    __slots__ = ("from_step",)
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    def __init__(self, from_step: _Optional[int] = ...) -> None: ...

class ProgressEvent(_message.Message):
    __slots__ = ("step", "loss", "lr", "global_batch", "samples_per_s", "state", "message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    lr: float
    global_batch: int
    samples_per_s: float
    state: JobState
    message: str
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., lr: _Optional[float] = ..., global_batch: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class JobStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("role", "id", "address", "alive", "last_seen_s_ago", "metrics_address")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    role: str
    id: int
    address: str
    alive: bool
    last_seen_s_ago: float
    metrics_address: str
    def __init__(self, role: _Optional[str] = ..., id: _Optional[int] = ..., address: _Optional[str] = ..., alive: _Optional[bool] = ..., last_seen_s_ago: _Optional[float] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "step", "steps", "per_device_batch", "global_batch", "lr", "members", "data_shards_todo", "data_shards_doing", "data_shards_done", "message", "metrics_address", "global_lr", "worker_device_memory_bytes", "worker_host_memory_bytes", "checkpoint_step", "skipped_steps", "ps_memory_forecast_bytes", "ps_memory_trend")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PER_DEVICE_BATCH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DATA_SHARDS_TODO_FIELD_NUMBER: _ClassVar[int]
    DATA_SHARDS_DOING_FIELD_NUMBER: _ClassVar[int]
    DATA_SHARDS_DONE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LR_FIELD_NUMBER: _ClassVar[int]
    WORKER_DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PS_MEMORY_FORECAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    PS_MEMORY_TREND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    step: int
    steps: int
    per_device_batch: int
    global_batch: int
    lr: float
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    data_shards_todo: int
    data_shards_doing: int
    data_shards_done: int
    message: str
    metrics_address: str
    global_lr: float
    worker_device_memory_bytes: int
    worker_host_memory_bytes: int
    checkpoint_step: int
    skipped_steps: int
    ps_memory_forecast_bytes: int
    ps_memory_trend: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., per_device_batch: _Optional[int] = ..., global_batch: _Optional[int] = ..., lr: _Optional[float] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., data_shards_todo: _Optional[int] = ..., data_shards_doing: _Optional[int] = ..., data_shards_done: _Optional[int] = ..., message: _Optional[str] = ..., metrics_address: _Optional[str] = ..., global_lr: _Optional[float] = ..., worker_device_memory_bytes: _Optional[int] = ..., worker_host_memory_bytes: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., skipped_steps: _Optional[int] = ..., ps_memory_forecast_bytes: _Optional[int] = ..., ps_memory_trend: _Optional[str] = ...) -> None: ...

class RejoinRequest(_message.Message):
    __slots__ = ("worker_id", "step", "inconsistent")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INCONSISTENT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    inconsistent: str
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., inconsistent: _Optional[str] = ...) -> None: ...

class SlotBuffersHeader(_message.Message):
    __slots__ = ("worker_id", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SlotBuffersPart(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: SlotBuffersHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[SlotBuffersHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class SlotBuffersRequest(_message.Message):
    __slots__ = ("worker_id", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "devices", "step", "last_step_s", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    step: int
    last_step_s: float
    state: str
    def __init__(self, worker_id: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., last_step_s: _Optional[float] = ..., state: _Optional[str] = ...) -> None: ...

class EmbeddingTableSpec(_message.Message):
    __slots__ = ("name", "rows", "dim", "init", "init_scale", "seed", "optimizer", "lr", "beta1", "beta2", "eps", "averaging", "lr_schedule")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    dim: int
    init: str
    init_scale: float
    seed: int
    optimizer: str
    lr: float
    beta1: float
    beta2: float
    eps: float
    averaging: str
    lr_schedule: str
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., init: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., averaging: _Optional[str] = ..., lr_schedule: _Optional[str] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("table", "ids", "values", "counts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    values: bytes
    counts: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ..., counts: _Optional[bytes] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("shard_id", "min_version", "blocks")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    min_version: int
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, shard_id: _Optional[int] = ..., min_version: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PullRowsReply(_message.Message):
    __slots__ = ("version", "blocks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, version: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PushRowsRequest(_message.Message):
    __slots__ = ("shard_id", "worker_id", "step", "device_count", "skip", "blocks")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    worker_id: int
    step: int
    device_count: int
    skip: bool
    blocks: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, shard_id: _Optional[int] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., device_count: _Optional[int] = ..., skip: _Optional[bool] = ..., blocks: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PushRowsReply(_message.Message):
    __slots__ = ("version", "duplicate", "completed", "skipped")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    version: int
    duplicate: bool
    completed: bool
    skipped: bool
    def __init__(self, version: _Optional[int] = ..., duplicate: _Optional[bool] = ..., completed: _Optional[bool] = ..., skipped: _Optional[bool] = ...) -> None: ...

class ReadTableRequest(_message.Message):
    __slots__ = ("shard_id", "table", "min_version", "rows_per_block")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    table: str
    min_version: int
    rows_per_block: int
    def __init__(self, shard_id: _Optional[int] = ..., table: _Optional[str] = ..., min_version: _Optional[int] = ..., rows_per_block: _Optional[int] = ...) -> None: ...

class RowsVersionRequest(_message.Message):
    __slots__ = ("shard_id", "worker_id")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    worker_id: int
    def __init__(self, shard_id: _Optional[int] = ..., worker_id: _Optional[int] = ...) -> None: ...

class RowsVersionReply(_message.Message):
    __slots__ = ("version", "worker_step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    worker_step: int
    def __init__(self, version: _Optional[int] = ..., worker_step: _Optional[int] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SectionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SECTION_KIND_UNSPECIFIED: _ClassVar[SectionKind]
    SHARED_TENSORS: _ClassVar[SectionKind]
    STAT_VECTORS: _ClassVar[SectionKind]
    SCALAR_SUMMARY: _ClassVar[SectionKind]
    PROTOTYPES: _ClassVar[SectionKind]
    CONTROL: _ClassVar[SectionKind]
    SECAGG: _ClassVar[SectionKind]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Decline(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECLINE_UNSPECIFIED: _ClassVar[Decline]
    DECLINE_DATA_BUDGET: _ClassVar[Decline]
SECTION_KIND_UNSPECIFIED: SectionKind
SHARED_TENSORS: SectionKind
STAT_VECTORS: SectionKind
SCALAR_SUMMARY: SectionKind
PROTOTYPES: SectionKind
CONTROL: SectionKind
SECAGG: SectionKind
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
UINT8: DType
INT8: DType
BOOL: DType
DECLINE_UNSPECIFIED: Decline
DECLINE_DATA_BUDGET: Decline

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SectionMeta(_message.Message):
    __slots__ = ("kind", "name", "tensors")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    kind: SectionKind
    name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, kind: _Optional[_Union[SectionKind, str]] = ..., name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class PayloadManifest(_message.Message):
    __slots__ = ("sections", "total_bytes", "crc32")
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    sections: _containers.RepeatedCompositeFieldContainer[SectionMeta]
    total_bytes: int
    crc32: int
    def __init__(self, sections: _Optional[_Iterable[_Union[SectionMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("protocol_version", "edge_id", "edge_secret", "join_token", "info", "state_fingerprint", "signing_key", "upload_key_share", "upload_key_proof")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    EDGE_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SIGNING_KEY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_KEY_PROOF_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    edge_id: str
    edge_secret: str
    join_token: str
    info: _containers.ScalarMap[str, str]
    state_fingerprint: str
    signing_key: bytes
    upload_key_share: bytes
    upload_key_proof: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., edge_id: _Optional[str] = ..., edge_secret: _Optional[str] = ..., join_token: _Optional[str] = ..., info: _Optional[_Mapping[str, str]] = ..., state_fingerprint: _Optional[str] = ..., signing_key: _Optional[bytes] = ..., upload_key_share: _Optional[bytes] = ..., upload_key_proof: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("protocol_version", "session", "config_json", "fingerprint", "chunk_bytes", "upload_key_share", "task_hints", "download_idle_timeout", "download_min_rate", "download_window", "poll_timeout", "presence_interval", "upload_idle_timeout", "upload_min_rate")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_KEY_SHARE_FIELD_NUMBER: _ClassVar[int]
    TASK_HINTS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MIN_RATE_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_WINDOW_FIELD_NUMBER: _ClassVar[int]
    POLL_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MIN_RATE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    session: str
    config_json: str
    fingerprint: str
    chunk_bytes: int
    upload_key_share: bytes
    task_hints: bool
    download_idle_timeout: float
    download_min_rate: float
    download_window: int
    poll_timeout: float
    presence_interval: float
    upload_idle_timeout: float
    upload_min_rate: float
    def __init__(self, protocol_version: _Optional[int] = ..., session: _Optional[str] = ..., config_json: _Optional[str] = ..., fingerprint: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., upload_key_share: _Optional[bytes] = ..., task_hints: _Optional[bool] = ..., download_idle_timeout: _Optional[float] = ..., download_min_rate: _Optional[float] = ..., download_window: _Optional[int] = ..., poll_timeout: _Optional[float] = ..., presence_interval: _Optional[float] = ..., upload_idle_timeout: _Optional[float] = ..., upload_min_rate: _Optional[float] = ...) -> None: ...

class PresenceRequest(_message.Message):
    __slots__ = ("edge_id", "session")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    session: str
    def __init__(self, edge_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class PresenceEvent(_message.Message):
    __slots__ = ("server_time", "task_ready")
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    TASK_READY_FIELD_NUMBER: _ClassVar[int]
    server_time: float
    task_ready: bool
    def __init__(self, server_time: _Optional[float] = ..., task_ready: _Optional[bool] = ...) -> None: ...

class TaskRequest(_message.Message):
    __slots__ = ("edge_id", "session", "cached_common", "no_wait", "task_id", "offset", "decline")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_COMMON_FIELD_NUMBER: _ClassVar[int]
    NO_WAIT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DECLINE_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    session: str
    cached_common: str
    no_wait: bool
    task_id: int
    offset: int
    decline: Decline
    def __init__(self, edge_id: _Optional[str] = ..., session: _Optional[str] = ..., cached_common: _Optional[str] = ..., no_wait: _Optional[bool] = ..., task_id: _Optional[int] = ..., offset: _Optional[int] = ..., decline: _Optional[_Union[Decline, str]] = ...) -> None: ...

class TaskHeader(_message.Message):
    __slots__ = ("status", "round", "task_id", "phase", "spec_json", "common_id", "common_cached", "common", "personal", "task_nonce", "common_base_id")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[TaskHeader.Status]
        TASK: _ClassVar[TaskHeader.Status]
        WAIT: _ClassVar[TaskHeader.Status]
        DONE: _ClassVar[TaskHeader.Status]
    STATUS_UNSPECIFIED: TaskHeader.Status
    TASK: TaskHeader.Status
    WAIT: TaskHeader.Status
    DONE: TaskHeader.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    COMMON_ID_FIELD_NUMBER: _ClassVar[int]
    COMMON_CACHED_FIELD_NUMBER: _ClassVar[int]
    COMMON_FIELD_NUMBER: _ClassVar[int]
    PERSONAL_FIELD_NUMBER: _ClassVar[int]
    TASK_NONCE_FIELD_NUMBER: _ClassVar[int]
    COMMON_BASE_ID_FIELD_NUMBER: _ClassVar[int]
    status: TaskHeader.Status
    round: int
    task_id: int
    phase: str
    spec_json: str
    common_id: str
    common_cached: bool
    common: PayloadManifest
    personal: PayloadManifest
    task_nonce: bytes
    common_base_id: str
    def __init__(self, status: _Optional[_Union[TaskHeader.Status, str]] = ..., round: _Optional[int] = ..., task_id: _Optional[int] = ..., phase: _Optional[str] = ..., spec_json: _Optional[str] = ..., common_id: _Optional[str] = ..., common_cached: _Optional[bool] = ..., common: _Optional[_Union[PayloadManifest, _Mapping]] = ..., personal: _Optional[_Union[PayloadManifest, _Mapping]] = ..., task_nonce: _Optional[bytes] = ..., common_base_id: _Optional[str] = ...) -> None: ...

class TaskMessage(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: TaskHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[TaskHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EvaluationResult(_message.Message):
    __slots__ = ("split", "num_classes", "counts", "loss_sum", "brier_sum", "correct", "total")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    BRIER_SUM_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    split: str
    num_classes: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    loss_sum: float
    brier_sum: float
    correct: int
    total: int
    def __init__(self, split: _Optional[str] = ..., num_classes: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., loss_sum: _Optional[float] = ..., brier_sum: _Optional[float] = ..., correct: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class SubmitHeader(_message.Message):
    __slots__ = ("protocol_version", "edge_id", "session", "round", "task_id", "phase", "num_examples", "payload", "evaluation", "metrics", "task_nonce", "signature", "body_mac_iv", "resume_offset")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TASK_NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    BODY_MAC_IV_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    edge_id: str
    session: str
    round: int
    task_id: int
    phase: str
    num_examples: int
    payload: PayloadManifest
    evaluation: _containers.RepeatedCompositeFieldContainer[EvaluationResult]
    metrics: _containers.ScalarMap[str, float]
    task_nonce: bytes
    signature: bytes
    body_mac_iv: bytes
    resume_offset: int
    def __init__(self, protocol_version: _Optional[int] = ..., edge_id: _Optional[str] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[int] = ..., phase: _Optional[str] = ..., num_examples: _Optional[int] = ..., payload: _Optional[_Union[PayloadManifest, _Mapping]] = ..., evaluation: _Optional[_Iterable[_Union[EvaluationResult, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., task_nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., body_mac_iv: _Optional[bytes] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class SubmitMessage(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SubmitHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SubmitHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class UploadOffsetRequest(_message.Message):
    __slots__ = ("edge_id", "session", "round", "phase", "task_id")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    session: str
    round: int
    phase: str
    task_id: int
    def __init__(self, edge_id: _Optional[str] = ..., session: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[str] = ..., task_id: _Optional[int] = ...) -> None: ...

class UploadOffsetReply(_message.Message):
    __slots__ = ("held", "offset", "total_bytes")
    HELD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    held: bool
    offset: int
    total_bytes: int
    def __init__(self, held: _Optional[bool] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("edge_id", "session", "reason")
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    session: str
    reason: str
    def __init__(self, edge_id: _Optional[str] = ..., session: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

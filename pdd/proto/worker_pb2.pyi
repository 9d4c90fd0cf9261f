from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "prior_output_tokens", "logit_bias", "min_p", "allowed_token_ids", "prompt_logprobs", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    ignore_eos: bool
    min_tokens: int
    prior_output_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., prior_output_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_stage", "kv_in", "cache_salt", "constraint", "prompt_ref", "session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_STAGE_FIELD_NUMBER: _ClassVar[int]
    KV_IN_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_REF_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_stage: bool
    kv_in: KvIn
    cache_salt: str
    constraint: Constraint
    prompt_ref: PromptRef
    session: Session
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_stage: _Optional[bool] = ..., kv_in: _Optional[_Union[KvIn, _Mapping]] = ..., cache_salt: _Optional[str] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., prompt_ref: _Optional[_Union[PromptRef, _Mapping]] = ..., session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "keep")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    id: str
    keep: bool
    def __init__(self, id: _Optional[str] = ..., keep: _Optional[bool] = ...) -> None: ...

class PromptRef(_message.Message):
    __slots__ = ("kv_request_id", "tokens")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    tokens: int
    def __init__(self, kv_request_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "spec", "resume", "param")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    resume: _containers.RepeatedScalarFieldContainer[int]
    param: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., resume: _Optional[_Iterable[int]] = ..., param: _Optional[str] = ...) -> None: ...

class KvIn(_message.Message):
    __slots__ = ("source", "kv_request_id", "wait_s")
    class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[KvIn.Source]
        TRANSFER: _ClassVar[KvIn.Source]
        DRC: _ClassVar[KvIn.Source]
    NONE: KvIn.Source
    TRANSFER: KvIn.Source
    DRC: KvIn.Source
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    source: KvIn.Source
    kv_request_id: str
    wait_s: float
    def __init__(self, source: _Optional[_Union[KvIn.Source, str]] = ..., kv_request_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "stop_token_id", "kv_staged_blocks", "kv_loaded_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_token_id: int
    kv_staged_blocks: int
    kv_loaded_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ..., kv_staged_blocks: _Optional[int] = ..., kv_loaded_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PeerAddress(_message.Message):
    __slots__ = ("transport", "host", "port", "ucx_address", "host_id", "name", "probes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    host: str
    port: int
    ucx_address: bytes
    host_id: str
    name: str
    probes: bool
    def __init__(self, transport: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., ucx_address: _Optional[bytes] = ..., host_id: _Optional[str] = ..., name: _Optional[str] = ..., probes: _Optional[bool] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("peer", "first_block", "landing_key", "tail")
    PEER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LANDING_KEY_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    peer: PeerAddress
    first_block: int
    landing_key: str
    tail: bool
    def __init__(self, peer: _Optional[_Union[PeerAddress, _Mapping]] = ..., first_block: _Optional[int] = ..., landing_key: _Optional[str] = ..., tail: _Optional[bool] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("kv_request_id", "destinations", "deadline_s")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    destinations: _containers.RepeatedCompositeFieldContainer[KvDestination]
    deadline_s: float
    def __init__(self, kv_request_id: _Optional[str] = ..., destinations: _Optional[_Iterable[_Union[KvDestination, _Mapping]]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class SendKvResponse(_message.Message):
    __slots__ = ("staged_blocks", "bytes_per_destination", "wire_bytes_per_destination")
    STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_PER_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    staged_blocks: int
    bytes_per_destination: _containers.RepeatedScalarFieldContainer[int]
    wire_bytes_per_destination: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, staged_blocks: _Optional[int] = ..., bytes_per_destination: _Optional[_Iterable[int]] = ..., wire_bytes_per_destination: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareKvRequest(_message.Message):
    __slots__ = ("kv_request_id", "prompt_token_ids", "lease_s", "cache_salt")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    cache_salt: str
    def __init__(self, kv_request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrepareKvResponse(_message.Message):
    __slots__ = ("cached_blocks", "reserved_blocks", "address", "landing_key", "keeps_prompt")
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LANDING_KEY_FIELD_NUMBER: _ClassVar[int]
    KEEPS_PROMPT_FIELD_NUMBER: _ClassVar[int]
    cached_blocks: int
    reserved_blocks: int
    address: PeerAddress
    landing_key: str
    keeps_prompt: bool
    def __init__(self, cached_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., address: _Optional[_Union[PeerAddress, _Mapping]] = ..., landing_key: _Optional[str] = ..., keeps_prompt: _Optional[bool] = ...) -> None: ...

class AwaitKvRequest(_message.Message):
    __slots__ = ("kv_request_id", "timeout_s")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    timeout_s: float
    def __init__(self, kv_request_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AwaitKvResponse(_message.Message):
    __slots__ = ("state", "bytes_received", "blocks_ready", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: str
    bytes_received: int
    blocks_ready: int
    reason: str
    def __init__(self, state: _Optional[str] = ..., bytes_received: _Optional[int] = ..., blocks_ready: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelKvRequest(_message.Message):
    __slots__ = ("kv_request_id", "reason", "background")
    KV_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    kv_request_id: str
    reason: str
    background: bool
    def __init__(self, kv_request_id: _Optional[str] = ..., reason: _Optional[str] = ..., background: _Optional[bool] = ...) -> None: ...

class CancelKvResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class DrcEventsRequest(_message.Message):
    __slots__ = ("since",)
    SINCE_FIELD_NUMBER: _ClassVar[int]
    since: int
    def __init__(self, since: _Optional[int] = ...) -> None: ...

class DrcEventsResponse(_message.Message):
    __slots__ = ("json", "snapshot")
    JSON_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    json: str
    snapshot: bool
    def __init__(self, json: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "worker_id", "role", "model", "instance_id", "geometry")
    READY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    worker_id: str
    role: str
    model: str
    instance_id: str
    geometry: KvGeometry
    def __init__(self, ready: _Optional[bool] = ..., worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., geometry: _Optional[_Union[KvGeometry, _Mapping]] = ...) -> None: ...

class KvGeometry(_message.Message):
    __slots__ = ("fingerprint", "num_layers", "total_kv_heads", "kv_head_start", "kv_head_end", "head_dim", "block_size", "kv_dtype", "device", "layout", "tensor_parallel_size")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    num_layers: int
    total_kv_heads: int
    kv_head_start: int
    kv_head_end: int
    head_dim: int
    block_size: int
    kv_dtype: str
    device: str
    layout: str
    tensor_parallel_size: int
    def __init__(self, fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., device: _Optional[str] = ..., layout: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "role", "running_requests", "waiting_requests", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits", "num_generated_tokens", "max_model_len", "pinned_slots", "open_transfers", "drc_capacity_blocks", "drc_used_blocks", "drc_query_tokens", "drc_hit_tokens", "drc_evictions", "wan_bandwidth_bps", "wan_rtt_s", "kv_bytes_sent", "kv_bytes_received", "block_size", "kv_block_bytes", "max_num_seqs", "wan_wire_ratio", "kv_wire_bytes_sent", "kv_refused_chunks", "kv_in_waits", "prefill_tokens_per_s", "prefill_fixed_s", "own_blocks_stored", "kv_arena_blocks", "kv_free_blocks", "kv_address", "wan_links", "md_sessions", "md_session_turns")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DRC_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRC_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRC_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRC_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRC_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    WAN_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    WAN_RTT_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    WAN_WIRE_RATIO_FIELD_NUMBER: _ClassVar[int]
    KV_WIRE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_REFUSED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_IN_WAITS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    OWN_BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_ARENA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAN_LINKS_FIELD_NUMBER: _ClassVar[int]
    MD_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MD_SESSION_TURNS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_generated_tokens: int
    max_model_len: int
    pinned_slots: int
    open_transfers: int
    drc_capacity_blocks: int
    drc_used_blocks: int
    drc_query_tokens: int
    drc_hit_tokens: int
    drc_evictions: int
    wan_bandwidth_bps: float
    wan_rtt_s: float
    kv_bytes_sent: int
    kv_bytes_received: int
    block_size: int
    kv_block_bytes: int
    max_num_seqs: int
    wan_wire_ratio: float
    kv_wire_bytes_sent: int
    kv_refused_chunks: int
    kv_in_waits: int
    prefill_tokens_per_s: float
    prefill_fixed_s: float
    own_blocks_stored: int
    kv_arena_blocks: int
    kv_free_blocks: int
    kv_address: PeerAddress
    wan_links: _containers.RepeatedCompositeFieldContainer[WanLink]
    md_sessions: int
    md_session_turns: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., open_transfers: _Optional[int] = ..., drc_capacity_blocks: _Optional[int] = ..., drc_used_blocks: _Optional[int] = ..., drc_query_tokens: _Optional[int] = ..., drc_hit_tokens: _Optional[int] = ..., drc_evictions: _Optional[int] = ..., wan_bandwidth_bps: _Optional[float] = ..., wan_rtt_s: _Optional[float] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., wan_wire_ratio: _Optional[float] = ..., kv_wire_bytes_sent: _Optional[int] = ..., kv_refused_chunks: _Optional[int] = ..., kv_in_waits: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_fixed_s: _Optional[float] = ..., own_blocks_stored: _Optional[int] = ..., kv_arena_blocks: _Optional[int] = ..., kv_free_blocks: _Optional[int] = ..., kv_address: _Optional[_Union[PeerAddress, _Mapping]] = ..., wan_links: _Optional[_Iterable[_Union[WanLink, _Mapping]]] = ..., md_sessions: _Optional[int] = ..., md_session_turns: _Optional[int] = ...) -> None: ...

class WanLink(_message.Message):
    __slots__ = ("peer", "bandwidth_bps", "rtt_s", "queued_bytes")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bandwidth_bps: float
    rtt_s: float
    queued_bytes: int
    def __init__(self, peer: _Optional[str] = ..., bandwidth_bps: _Optional[float] = ..., rtt_s: _Optional[float] = ..., queued_bytes: _Optional[int] = ...) -> None: ...

class WarmKvRequest(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerAddress]
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerAddress, _Mapping]]] = ...) -> None: ...

class WarmKvResponse(_message.Message):
    __slots__ = ("warming",)
    WARMING_FIELD_NUMBER: _ClassVar[int]
    warming: int
    def __init__(self, warming: _Optional[int] = ...) -> None: ...

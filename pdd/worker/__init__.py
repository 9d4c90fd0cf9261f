"""The worker process: one vLLM engine behind the router-facing gRPC service (pdd/proto).

The shell every role shares (STYLE.md section 3: one shell, thin role policies plugged in):

    service    the gRPC servicer: admission, status codes, KV RPCs dispatched to the role
    roles      the role contract (RolePolicy, its typed KV capabilities and the dataclasses
               they take and return), PlainRole
    convert    proto <-> engine / role types: the only place the wire meets a role
    kv_plane   shared-memory slot arena + fence board the connector maps, transports, bytes
    slots      SlotPool (staging slots by owner) and Fences (engine release confirmations)
    kv_run     one engine request with KV params and exactly one release of its slots
    landing    the inbound-KV landing state machine both receivers run over a slot source
    inbound    per-request inbound transfer state, waiters, recent outcomes, landing keys
    layout     the size of one KV block before the engine exists
    metrics    /metrics and /health

The role policies live in pdd.prefill, pdd.relay_decode and pdd.main_decode; the composition
root that picks one is pdd.launch.worker.
"""

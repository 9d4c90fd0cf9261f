"""The worker process: one vLLM engine behind the router-facing gRPC service (pdd/proto).

The shell every role shares (STYLE.md section 3: one shell, thin role policies plugged in):

    main       composition root: role policy, KV plane, engine, service, metrics
    service    the gRPC servicer: admission, status codes, KV RPCs dispatched to the role
    roles      the role interface (RolePolicy, GenerateCall, KvDelta, KvStats), PlainRole
    kv_plane   shared-memory slot arena + fence board the connector maps, transports, bytes
    slots      SlotPool (staging slots by owner) and Fences (engine release confirmations)
    kv_run     one engine request with KV params and exactly one release of its slots
    inbound    per-request inbound transfer state, waiters, recent outcomes (RLD, MD)
    layout     the size of one KV block before the engine exists
    convert    proto <-> engine / role types;  metrics: /metrics and /health

The role policies live in pdd.prefill, pdd.relay_decode and pdd.main_decode.
"""

"""The worker process: one vLLM engine behind the router-facing gRPC service (pdd/proto).

``main`` is the composition root of one worker process; ``service`` is the gRPC servicer;
``convert`` maps proto messages to and from pdd.engine types; ``metrics`` is its /metrics.
"""

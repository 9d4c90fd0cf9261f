"""pdd.router: the OpenAI-compatible HTTP front door and the request flow behind it.

The router owns text (tokenization, chat template, incremental detokenization, stop strings),
admission, routing policy (``routing.choose``), the pipeline drivers that talk gRPC to workers,
and the per-request record (route, timings, token counts) that feeds ``/metrics``.

It never imports torch, vLLM or numpy; ``tests/router/test_main.py`` keeps it that way. Modules:

- ``schemas``      OpenAI request bodies (pydantic)
- ``validation``   request body -> typed ``GenerationRequest`` (400 on bad parameters)
- ``tokenizer``    ``tokenizers`` + jinja2 chat template (no transformers)
- ``detokenizer``  incremental detokenization that never splits a character
- ``stops``        stop-string matcher with hold-back
- ``output``       token events -> text deltas (detokenizer + stops + logprob text)
- ``fleet``        the snapshot policy reads (``FleetView``, ``RouteRequest``) and ``Decision``
- ``routing``      pure policy: ``choose(view, request) -> Decision``; ``policy`` the pdd and
                   pd-baseline branches (p_md vs p_rld_md, handoff mode)
- ``workers``      one gRPC client per worker (Generate + KV plane RPCs); ``pool`` health
                   polling and the fleet view; ``drc_views`` each MainDecode's DRC replica
- ``pipeline``     the driver protocol, ``ColocatedPipeline`` and ``build_drivers``
- ``pdd_pipeline`` ``PddPipeline`` (p_md, p_rld_md) and ``PdPipeline`` (pd_wan, pd_local)
- ``p_stage``      prefill on P, KV staging, PrepareKv / SendKv to the destinations
- ``handoff``      RLD -> MD: One-Shot, Catch-Up, the anomaly filter
- ``request_run``  one request's emitted tokens and the KV every worker holds for it
- ``service``      admission, routing, running a request, the per-request record
- ``record``       ``RequestRecord`` and ``PddTrace`` (the response's ``pdd`` object)
- ``responses``    OpenAI response/chunk bodies; ``sse`` the streaming response
- ``http_errors``  the one error handler; ``limits`` the body-size limit
- ``routes`` / ``app`` / ``main``  the HTTP surface, the app factory, ``pdd router``
- ``status``       ``pdd status``: the fleet as a running router sees it
"""

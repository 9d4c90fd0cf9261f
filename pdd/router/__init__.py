"""pdd.router: the OpenAI-compatible HTTP front door and the request flow behind it.

The router owns text (tokenization, chat template, incremental detokenization, stop strings),
admission, routing policy (``routing.choose``), the pipeline drivers that talk gRPC to workers,
and the per-request record (route, timings, token counts) that feeds ``/metrics``.

It never imports torch, vLLM or numpy (the import-linter contracts in pyproject.toml and
``tests/router/test_main.py`` keep it that way). Five wings, each one job, and the few modules
that tie them together:

- ``http/``     ``routes`` (start here), ``schemas``, ``validation``, ``responses``, ``sse``,
                ``auth`` (API keys), ``errors`` (the one error handler), ``limits``,
                ``admission`` (the request deadline), ``drain`` (SIGTERM)
- ``text/``     ``tokenizer``, ``detokenizer``, ``stops``, ``output``
- ``fleet/``    ``pool`` (membership, health polling, the fleet view), ``workers`` (one gRPC
                client per worker), ``worker_auth``, ``drc_views``, ``routed_prefixes``,
                ``registry`` (registrations), ``discovery`` (DNS)
- ``decide/``   ``view`` (FleetView, RouteRequest, Decision), ``routing.choose``, ``policy``,
                ``recovery``: pure functions of a snapshot
- ``drive/``    ``pipeline``, ``pdd_pipeline``, ``p_stage``, ``handoff``, ``request_run``
- ``service``   admission -> routing -> driver -> text, the per-request record
- ``types``     the typed request and token events every wing shares; ``record`` the
                per-request record (``RequestRecord``, ``PddTrace``); ``metrics``; ``debug``
- ``state``     the shared objects on ``app.state.pdd``; ``app`` the factory; ``main``
                ``pdd router``; ``status`` ``pdd status``
"""

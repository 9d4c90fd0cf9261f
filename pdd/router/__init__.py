"""pdd.router: the OpenAI-compatible HTTP front door and the request flow behind it.

The router owns text (tokenization, chat template, incremental detokenization, stop strings),
admission, routing policy (``routing.choose``), the pipeline drivers that talk gRPC to workers,
and the per-request record (route, timings, token counts) that feeds ``/metrics``.

It never imports torch or vLLM; ``tests/router/test_imports.py`` keeps it that way. Modules:

- ``schemas``      OpenAI request bodies (pydantic)
- ``validation``   request body -> typed ``GenerationRequest`` (400 on bad parameters)
- ``tokenizer``    ``tokenizers`` + jinja2 chat template (no transformers)
- ``detokenizer``  incremental detokenization that never splits a character
- ``stops``        stop-string matcher with hold-back
- ``output``       token events -> text deltas (detokenizer + stops + logprob text)
- ``routing``      pure policy: ``choose(view, request) -> Decision``
- ``workers``      one gRPC client per worker; ``pool`` health polling and the fleet view
- ``pipeline``     pipeline drivers (``ColocatedPipeline``); one per serving flow
- ``service``      admission, routing, running a request, the per-request record
- ``responses``    OpenAI response/chunk bodies; ``sse`` the streaming response
- ``http_errors``  the one error handler; ``limits`` the body-size limit
- ``routes`` / ``app`` / ``main``  the HTTP surface, the app factory, ``pdd router``
- ``status``       ``pdd status``: the fleet as a running router sees it
"""

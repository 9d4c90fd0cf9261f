"""pdd.observability: what every pdd process shares to be watched and debugged.

- ``catalog``  the one list of every metric pdd processes export (name, type, unit, labels,
               which process), read by the dashboard test, the docs and the live scrape test
- ``context``  the request id of the work a task is doing (a contextvar), and the gRPC
               interceptors that carry it from the router to workers as ``x-request-id``
- ``logging``  ``setup_logging``: text or JSON lines, each with the request id when known
- ``dashboard`` the Grafana dashboard's panels and the metric names its PromQL reads

A low layer: it imports only the standard library and grpc (never torch, vLLM or numpy).
"""

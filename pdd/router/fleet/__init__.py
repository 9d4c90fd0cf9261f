"""The fleet as this router knows it: membership (``pool``: static config, ``registry``:
registrations, ``discovery``: DNS), one gRPC client per worker (``workers``, credentials in
``worker_auth``), health polling and the snapshot views (``pool``, ``drc_views``: each MD's DRC
replica, ``routed_prefixes``: what the router sent each P). Start at ``pool``."""

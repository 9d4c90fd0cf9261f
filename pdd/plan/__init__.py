"""``pdd plan``: size a two-datacenter fleet by simulating pdd's own routing (simpy).

    profile   chip profiles (schema, YAML loading, the time models)
    workload  synthetic agentic conversations, JSONL traces
    cache     P's prefix cache and MD's DRC: pdd.cache.radix.RadixIndex, or its O(1) twin
    servers   decode batches, shared links (simpy callbacks)
    fleet     instance counts per role and chip
    sim       one run: routing.choose per request, the drivers' steps (pipeline: router.mode pdd)
    stats     TTFT/TPOT/goodput/BCR of a run
    search    the fleet with the highest BCR meeting the SLA, or the resource that binds
    report    table, JSON, plot;  cli: ``pdd plan``

Layering: imports only pdd's pure modules (protocol, errors, config, cache.radix, router.decide);
only the CLI imports it (pyproject.toml's import-linter contracts).
"""

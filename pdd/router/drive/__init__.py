"""The drivers that run one request over gRPC: ``pipeline`` (the driver protocol, colocated,
``build_drivers``), ``pdd_pipeline`` (p_md, p_rld_md, pd_wan, pd_local), ``p_stage`` (prefill on
P, PrepareKv / SendKv), ``handoff`` (RLD -> MD), ``request_run`` (one request's emitted tokens
and the KV every worker holds for it). Start at ``pdd_pipeline``."""

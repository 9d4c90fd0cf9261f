"""The vLLM wrapper (engine.py), the default model (model.py) and pdd's KV connector.

This package is the only place that imports vLLM; import its submodules directly
(``pdd.engine.engine``, ``pdd.engine.model``) so that importing ``pdd.engine`` stays cheap.
"""

"""A poll interval for NIXL's progress thread in the `vllm_nixl` benchmark mode (a vLLM general
plugin: vLLM calls ``register()`` in every process it starts).

NIXL's Python API (1.5) builds every agent with ``pthrDelay = 0``: its progress thread polls its
backends without pause, a whole core per agent even while idle. On a GPU server with dozens of
cores that is one core of many; on this lab's 2 cores, two agents (P and D) would take both
cores from the engines. With ``PDD_NIXL_PROGRESS_DELAY_US`` set (the mode sets it from
``nixl_progress_delay_us``), every agent this process makes sleeps that many microseconds
between polls instead; unset, or 0, NIXL is left as it is. Nothing else of NIXL or vLLM
changes. Idempotent; a process without NIXL never imports it.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

ENV = "PDD_NIXL_PROGRESS_DELAY_US"
# under "vllm": the engine processes log through vLLM's handler
log = logging.getLogger("vllm.pdd.nixl_progress")


class _Bindings(types.ModuleType):
    """NIXL's bindings module, with ``nixlAgent`` setting the poll interval first."""

    def __init__(self, real: types.ModuleType, delay_us: int):
        super().__init__(real.__name__)
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (NIXL's name)
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def register() -> None:
    delay_us = int(os.environ.get(ENV, "0") or 0)
    if delay_us <= 0:
        return
    try:
        import nixl._api as api  # the variant (nixl_cu12, ...) vLLM's nixl_utils loads too
    except ImportError:
        return
    if isinstance(api.nixlBind, _Bindings):
        return
    api.nixlBind = _Bindings(api.nixlBind, delay_us)
    log.info("NIXL progress threads poll every %d us (%s)", delay_us, ENV)

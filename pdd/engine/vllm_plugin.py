"""pdd's vLLM general plugin: what pdd must run inside every engine process vLLM starts.

Two things, CPU platforms only: the seeded-chunked-prefill workaround below, and the engine
core's heap trimmer (``pdd.engine.heap``: started when the environment asks for it).

Registered as the entry point ``vllm.general_plugins: pdd_cpu_generators`` (pyproject.toml);
vLLM calls ``register()`` in each process it starts (engine core, workers), possibly more than
once: it must be idempotent.

The bug (vLLM 0.32 on CPU): when a seeded request (``seed`` with temperature > 0) is prefilled
in chunks, the model runner discards the token sampled after a partial chunk and rewinds the
request's generator with ``gen.set_offset(gen.get_offset() - 4)``. CPU generators have no
offset: the call raises "CPU Generator does not use offset" and the engine core dies, taking
every request on it down. Any client that sends ``seed`` with a long prompt could kill a worker.

The workaround, on CPU only: ``torch.Generator`` becomes a subclass whose offset calls are
no-ops on CPU devices (``get_offset`` 0, ``set_offset`` ignored). A partial chunk's discarded
sample then consumes random numbers instead of rewinding: seeded output stays reproducible for
the same prompt scheduled the same way, but can differ when other requests change how the
prompt is chunked. CUDA generators (which support offsets) are untouched.
"""

from __future__ import annotations

import logging

import torch

from pdd.engine import heap

log = logging.getLogger(__name__)


class _CpuOffsetSafeGenerator(torch.Generator):
    """A generator whose offset calls do nothing on CPU devices (see the module docstring)."""

    def get_offset(self) -> int:
        if self.device.type == "cpu":
            return 0
        return super().get_offset()

    def set_offset(self, offset: int) -> torch.Generator:
        if self.device.type == "cpu":
            return self
        return super().set_offset(offset)


def register() -> None:
    """vLLM's plugin hook: on CPU platforms, install the generator workaround and start the
    heap trimmer (``pdd.engine.heap``; only where ``Engine`` asked for it in the environment)."""
    if torch.Generator is _CpuOffsetSafeGenerator:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    heap.start_from_env()
    torch.Generator = _CpuOffsetSafeGenerator  # type: ignore[misc]
    log.debug("pdd: CPU generators ignore offset rewinds (seeded chunked prefill)")

"""KV arena sizes checked against the context they must serve (issue 16, Build item 7).

Every KV role keeps blocks in fixed shared-memory arenas sized in GiB by its config: P's
staging (``kv_staging_gib``: a prompt's blocks until they are sent), RLD's landing (the same
setting: the blocks of a request it decodes) and MD's DRC (``cache.host_capacity_gib``; MD
stores its own blocks straight into it, ``pdd.main_decode.store``). A request
is refused by an arena that cannot hold its blocks, so an arena smaller than one request at
``max_model_len`` would refuse every long prompt for ever (a 429 the client retries): such a
worker refuses to start instead, naming the setting and the size it needs. An arena that
holds one request but not ``max_num_seqs`` of them at ``max_model_len`` serves every prompt
alone but may answer 429 (busy, retry) under concurrent long prompts: a warning at start.

Pure: the roles describe their arenas (``ArenaSize``, in their ``plane_spec``) and the
composition root (pdd.launch.worker) calls ``check_arenas`` before any arena is created.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.config import PddConfig, WorkerConfig
from pdd.config.cache import GIB
from pdd.errors import ConfigError


@dataclass(frozen=True)
class ArenaSize:
    """One arena of a worker: what it is, the setting that sizes it, the blocks it holds."""

    what: str  # e.g. "KV staging arena"
    setting: str  # the --set key, e.g. "workers.0.kv_staging_gib"
    gib: float  # its configured size
    slots: int  # KV blocks it holds
    per_sequence: bool = True  # at full load it holds one request per running sequence


def setting_of(config: PddConfig, worker: WorkerConfig, key: str) -> str:
    """The ``--set`` key of a worker's field ``key`` (``workers.N.key``)."""
    index = next((i for i, w in enumerate(config.workers) if w.id == worker.id), None)
    return f"workers.{index}.{key}" if index is not None else key


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    """KV blocks of one request at ``max_model_len`` (a partial last block counts whole)."""
    return -(-max_model_len // block_size)


def gib_for(blocks: int, block_bytes: int) -> float:
    """GiB that hold ``blocks`` blocks of ``block_bytes``, rounded up to 0.001 GiB."""
    return math.ceil(blocks * block_bytes / GIB * 1000) / 1000


def check_arenas(
    arenas: tuple[ArenaSize, ...],
    *,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    block_bytes: int,
) -> list[str]:
    """Raise ConfigError (every short arena named) if one cannot hold a request at
    ``max_model_len``; return a warning for each that cannot hold ``max_num_seqs`` of them."""
    one = blocks_per_request(max_model_len, block_size)
    short, warnings = [], []
    for a in arenas:
        held = f"the {a.what} ({a.setting}={a.gib:g}) holds {a.slots} KV blocks of {block_bytes} B"
        if a.slots < one:
            short.append(
                f"{held}; one request at max_model_len {max_model_len} needs {one} "
                f"(block_size {block_size}): set {a.setting} >= {gib_for(one, block_bytes):g}"
            )
        elif a.per_sequence and a.slots < one * max_num_seqs:
            need = gib_for(one * max_num_seqs, block_bytes)
            warnings.append(
                f"{held}: fewer than max_num_seqs {max_num_seqs} requests at max_model_len "
                f"{max_model_len} ({one * max_num_seqs} blocks, {a.setting} >= {need:g}); "
                f"concurrent long prompts may be refused as busy (429)"
            )
    if short:
        raise ConfigError("KV arena too small for max_model_len: " + "; ".join(short))
    return warnings

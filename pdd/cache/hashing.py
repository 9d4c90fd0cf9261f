"""Block hash chains: the names of KV blocks, identical in every process and on every machine.

A prompt is cut into whole blocks of ``block_size`` tokens; a trailing partial block has no
hash (only whole blocks are cached). Block ``i`` is named by a 16-byte BLAKE2b digest of its
parent's name and its own tokens, so one name stands for the whole prefix up to that block:

    root  = H("pdd-block-hash/v1" | block_size | salt)
    h[0]  = H(root | tokens[0 : B])
    h[i]  = H(h[i-1] | tokens[i*B : (i+1)*B])            B = block_size

    tokens: [t0 .. t31][t32 .. t63][t64 .. t95][t96 t97]
    hashes:    h[0]  ->    h[1]  ->    h[2]       (partial block: no hash)

Tokens are encoded as little-endian uint32, never with Python's ``hash()`` (salted per process).
The salt separates models: ``model_salt(name, dtype, block_size)`` so blocks of two models or
two KV dtypes never alias. Prefill, MainDecode and the router all compute these names; the
router imports this module, so it stays free of torch, vLLM and numpy.

Cost: ~0.5-1 us per block (a 6K-token prompt in ~0.15 ms on this machine; see
tests/cache/test_cache_hashing.py and the report).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

from pdd.errors import InvalidRequestError

BlockHash = bytes
"""A block's 16-byte chain hash (names the block and everything before it)."""

HASH_BYTES = 16
_VERSION = b"pdd-block-hash/v1"
_TOKEN_BYTES = 4
_TYPECODE = next(code for code in "IL" if array(code).itemsize == _TOKEN_BYTES)


def model_salt(model_name: str, dtype: str, block_size: int, extra: str = "") -> bytes:
    """The salt for one model's KV: blocks of other models, dtypes or block sizes never alias.

    ``extra`` separates further namespaces (e.g. a per-tenant cache salt).
    """
    fields = [model_name, dtype, str(block_size), extra]
    encoded = b"".join(len(f.encode()).to_bytes(4, "little") + f.encode() for f in fields)
    return hashlib.blake2b(encoded, digest_size=HASH_BYTES).digest()


def root_hash(block_size: int, salt: bytes = b"") -> BlockHash:
    """The parent of block 0: binds the chain to its block size and salt."""
    if block_size <= 0:
        raise InvalidRequestError(f"block_size must be positive, got {block_size}")
    head = _VERSION + block_size.to_bytes(4, "little") + salt
    return hashlib.blake2b(head, digest_size=HASH_BYTES).digest()


def encode_tokens(token_ids: Iterable[int]) -> bytes:
    """Canonical bytes of token ids: little-endian uint32 each."""
    try:
        packed = array(_TYPECODE, token_ids)
    except OverflowError:
        raise InvalidRequestError("token ids must be in [0, 2**32)") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chain hashes of every whole block of ``token_ids``.

    ``parent`` continues an existing chain: ``token_ids`` are then the tokens after the
    parent's block (they start on a block boundary), e.g. the blocks MainDecode generated
    after a prompt. Raises InvalidRequestError for token ids outside [0, 2**32).
    """
    prev = root_hash(block_size, salt) if parent is None else parent
    whole = len(token_ids) - len(token_ids) % block_size
    data = memoryview(encode_tokens(token_ids[:whole]))
    step = block_size * _TOKEN_BYTES
    out: list[BlockHash] = []
    for start in range(0, len(data), step):
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(data[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out

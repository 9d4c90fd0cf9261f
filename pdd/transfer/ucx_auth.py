"""The credential of the UCX KV transport: a sender proves it holds the worker token.

UCX carries P -> RLD KV inside a datacenter (shared memory on one host, TCP or RDMA across
hosts) without TLS, so the receiver checks a proof in the connect handshake instead:

    sender -> receiver  hello = [sender id, pid, pid namespace, proof (4 x u64)]
    proof = HMAC-SHA256(token, "pdd-ucx-hello" | sender id)

The token itself never crosses the wire. A receiver with a token refuses (closes the
connection of) a sender whose proof does not match: it never gets the welcome, so none of its
headers are accepted (they are matched to senders that passed the handshake) and its
transfers fail on its side. Over plain UCX the KV bytes are not encrypted and the proof can be
replayed by someone who can already read that link: that is why WAN links use the TCP transport
with mutual TLS (``transfer.tls``), never UCX.

The token is process-wide (one worker, one fleet credential): the worker's composition root
calls ``set_kv_token`` before it starts its transports; each ``UcxTransport`` takes the value
at construction (``token`` attribute, tests set it directly).
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np

PROOF_WORDS = 4  # 32 bytes of HMAC-SHA256 as uint64 words
_CONTEXT = b"pdd-ucx-hello"
_token: bytes | None = None


def set_kv_token(token: bytes | None) -> None:
    """Set (or clear) the token of every UcxTransport this process builds from now on."""
    global _token
    _token = token


def kv_token() -> bytes | None:
    return _token


def hello_proof(token: bytes | None, sender_id: int) -> np.ndarray:
    """The proof words a sender puts in its hello (zeros without a token)."""
    if token is None:
        return np.zeros(PROOF_WORDS, np.uint64)
    return np.frombuffer(_mac(token, sender_id), np.uint64).copy()


def proof_ok(token: bytes | None, sender_id: int, proof: np.ndarray) -> bool:
    """Whether a hello's proof is valid (always, when this receiver has no token).
    Constant-time comparison."""
    if token is None:
        return True
    return hmac.compare_digest(np.ascontiguousarray(proof, np.uint64).tobytes(),
                               _mac(token, sender_id))  # fmt: skip


def _mac(token: bytes, sender_id: int) -> bytes:
    return hmac.new(token, _CONTEXT + int(sender_id).to_bytes(8, "little"), hashlib.sha256).digest()

"""The credential of KV senders: a sender proves it holds the worker token, afresh on every
connection (UCX for P -> RLD, TCP for P -> MD; the name is historical).

The receiver opens each connection with a challenge, a fresh 32-byte random nonce; the sender
answers with

    proof = HMAC-SHA256(token, "pdd-ucx-hello" | sender id | nonce)

    UCX  receiver -> sender  challenge (4 x u64);  sender -> receiver  hello = [sender id,
         pid, pid namespace, proof (4 x u64)];  receiver -> sender  welcome
    TCP  (inside mutual TLS when transfer.tls) CHALLENGE, then HELLO and AUTH (wire frames)

The token itself never crosses the wire, and a recorded proof is worthless on any other
connection (its nonce is gone): a proof cannot be replayed. A receiver with a token refuses
(closes) a sender whose proof does not match: it never gets the welcome, so none of its
headers or chunks are accepted, and its transfers fail on its side. Over plain UCX the KV bytes
are not encrypted: WAN links use the TCP transport with mutual TLS (``transfer.tls``).

The token is process-wide (one worker, one fleet credential): the worker's composition root
calls ``set_kv_token`` before it starts its transports; each transport takes the value at
construction (``token`` attribute, tests set it directly).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import numpy as np

PROOF_WORDS = 4  # 32 bytes of HMAC-SHA256 as uint64 words
NONCE_BYTES = 32
_CONTEXT = b"pdd-ucx-hello"
_token: bytes | None = None


def set_kv_token(token: bytes | None) -> None:
    """Set (or clear) the token of every KV transport this process builds from now on."""
    global _token
    _token = token


def kv_token() -> bytes | None:
    return _token


def new_nonce() -> bytes:
    """A receiver's challenge for one connection."""
    return secrets.token_bytes(NONCE_BYTES)


def hello_proof(token: bytes | None, sender_id: int, nonce: bytes = b"") -> np.ndarray:
    """The proof words a sender puts in its hello (zeros without a token)."""
    if token is None:
        return np.zeros(PROOF_WORDS, np.uint64)
    return np.frombuffer(_mac(token, sender_id, nonce), np.uint64).copy()


def proof_ok(token: bytes | None, sender_id: int, proof: np.ndarray, nonce: bytes = b"") -> bool:
    """Whether a hello's proof answers ``nonce`` (always, when this receiver has no token).
    Constant-time comparison."""
    if token is None:
        return True
    given = np.ascontiguousarray(proof, np.uint64).tobytes()
    return hmac.compare_digest(given, _mac(token, sender_id, nonce))


def _mac(token: bytes, sender_id: int, nonce: bytes) -> bytes:
    message = _CONTEXT + int(sender_id).to_bytes(8, "little") + nonce
    return hmac.new(token, message, hashlib.sha256).digest()

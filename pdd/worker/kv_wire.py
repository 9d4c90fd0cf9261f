"""Self-describing KV on the wire, in this worker's geometry (``pdd.kv_geometry``).

Sender (P): ``describe(geometry)`` gives the fields of every ``KVSegment`` it sends (one
block of every layer per segment): dtype, shape (layers, KV heads held, tokens per block,
2 x head_dim), layer range, KV-head range and paged layout, so each chunk header states what
it carries. Receiver (RLD, MD): ``KvWireCheck`` runs on every inbound chunk before it is
given a place in the arena (``allocate``): a chunk whose description differs from the
receiver's own geometry is refused (TransferError: the transfer fails, the request recomputes
its prompt, the landing slots go back), counted in ``refused`` (``KvPlane`` logs the failed
transfer), unless it differs only in fields the receiver converts (``converts``, from
``pdd.kv_geometry.RECEIVER_CONVERTS``: RelayDecode and MainDecode convert dtype, layout and
block size): then the check returns the chunk's geometry and the receiver lands it converted
(``pdd.worker.kv_convert``).

    header field      must equal (receiver's geometry)
    dtype             kv_dtype (or one it converts from)
    layout            layout (or one it converts from)
    shape             block_shape = (num_layers, heads held, block_size (or one it converts
                      from), 2 x head_dim)
    layer range       [0, num_layers)
    KV-head range     [kv_head_start, kv_head_end)
    segment bytes     one block in the chunk's geometry (``inbound.whole_slot``)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdd.errors import TransferError
from pdd.kv_geometry import KvGeometry, convertible, interiors_known
from pdd.transfer.wire import ChunkHeader
from pdd.worker.inbound import split_wire_id, whole_slot


def describe(geometry: KvGeometry | None) -> dict[str, Any]:
    """The ``KVSegment`` fields of one whole block in ``geometry`` ({} when unknown)."""
    if geometry is None:
        return {}
    return {
        "layer_start": 0,
        "layer_end": geometry.num_layers,
        "dtype": geometry.kv_dtype,
        "shape": geometry.block_shape,
        "kv_head_start": geometry.kv_head_start,
        "kv_head_end": geometry.kv_head_end,
        "layout": geometry.layout,
    }


def mismatch(header: ChunkHeader, own: KvGeometry,
             converts: frozenset[str] = frozenset()) -> str | None:  # fmt: skip
    """The first field of ``header`` that does not describe KV in ``own``'s geometry, nor KV
    converted into it (``converts``: geometry fields converted on landing), as "field: chunk
    X, here Y"; None when the chunk lands here."""
    layers, heads, block, width = own.block_shape
    shape = tuple(header.shape)
    checks = (
        ("dtype", header.dtype, _landing(header.dtype, own.kv_dtype, "kv_dtype", converts)),
        ("layout", header.layout, _landing(header.layout, own.layout, "layout", converts)),
        ("num_layers", shape[0] if len(shape) == 4 else None, layers),
        ("kv_heads", shape[1] if len(shape) == 4 else None, heads),
        ("block_size", shape[2] if len(shape) == 4 else None,
         _landing(shape[2] if len(shape) == 4 else None, block, "block_size", converts)),
        ("head_dim", shape[3] // 2 if len(shape) == 4 else None, width // 2),
        ("layer_range", (header.layer_start, header.layer_end), (0, own.num_layers)),
        ("kv_head_range", (header.kv_head_start, header.kv_head_end),
         (own.kv_head_start, own.kv_head_end)),
    )  # fmt: skip
    for name, got, want in checks:
        if got != want:
            return f"{name}: chunk {got}, here {want}"
    converted = (header.dtype, header.layout, shape[2]) != (own.kv_dtype, own.layout, block)
    if converted and not interiors_known(header.layout, own.layout):
        return f"layout: chunk {header.layout}, here {own.layout} (not converted)"
    return None


def _landing(got: object, own: object, field: str, converts: frozenset[str]) -> object:
    """What ``own`` accepts in ``field``: ``got`` when it converts it (into ``own``)."""
    if field in converts and convertible(field, got, own):
        return got
    return own


def chunk_geometry(header: ChunkHeader, own: KvGeometry) -> KvGeometry:
    """The geometry a chunk that passed ``mismatch`` is in: ``own``'s, with its dtype, layout
    and block size."""
    sent = {"kv_dtype": header.dtype, "layout": header.layout, "block_size": header.shape[2]}
    if all(getattr(own, k) == v for k, v in sent.items()):
        return own
    return own.model_copy(update=sent)


class KvWireCheck:
    """Every inbound chunk against this receiver's geometry, then its segment size.

    ``geometry`` is read per chunk (the engine's, known once it started; None: size only);
    ``converts``: the geometry fields this receiver converts on landing.
    Called on transport threads: the counter is under a lock.
    """

    def __init__(self, slot_bytes: int, geometry: Callable[[], KvGeometry | None],
                 converts: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self._slot_bytes = slot_bytes
        self._geometry = geometry
        self._converts = converts
        self._lock = threading.Lock()
        self.refused = 0  # chunks refused because they describe other KV than ours

    def __call__(self, header: ChunkHeader) -> KvGeometry | None:
        """The chunk's geometry when it lands converted, None when it is in this worker's
        own. Raises TransferError (the chunk and its transfer are refused)."""
        own = self._geometry()
        if own is None:
            whole_slot(header, self._slot_bytes)
            return None
        why = mismatch(header, own, self._converts)
        if why is not None:
            self._refuse(header.request_id, why)
        src = chunk_geometry(header, own)
        whole_slot(header, src.block_bytes if src is not own else self._slot_bytes)
        return src if src is not own else None

    def _refuse(self, wire_id: str, why: str) -> None:
        kv_id = split_wire_id(wire_id)[0]  # never a landing key in an error
        with self._lock:
            self.refused += 1
        raise TransferError(f"KV of {kv_id!r} is not in this worker's KV geometry ({why})")

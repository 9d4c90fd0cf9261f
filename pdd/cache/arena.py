"""Shared-memory arenas of fixed-size slots, and the release fences of the KV connector.

The worker shell (pdd's gRPC server process) and vLLM's engine core (a child process, where
PddConnector runs) meet here. The shell *owns* every arena: it creates it, decides what every
slot holds and when, and unlinks it. The engine core *attaches* by name (the ``ArenaRef`` in
``kv_connector_extra_config``) and only copies KV blocks between vLLM's paged cache and the
slots a request names (see pdd/engine/connector.py for that contract).

    /dev/shm/pdd-<owner pid>-<8 hex>     num_slots * slot_bytes bytes
    ┌──────────┬──────────┬─────┬────────────────┐
    │ slot 0   │ slot 1   │ ... │ slot n-1       │   one slot = one KV block of all layers
    └──────────┴──────────┴─────┴────────────────┘   (KvLayout wire order, see connector_worker)

Mechanism: a file in /dev/shm (POSIX shared memory on Linux) mapped with ``mmap``. Python's
``multiprocessing.shared_memory`` is deliberately not used: it registers every *attach* with
the resource tracker, which then unlinks (and warns about) a segment it believes leaked when
the attaching process exits. Here only the owner ever unlinks: explicitly (``unlink``), when
the owner object is garbage-collected, or at interpreter exit. A SIGKILLed owner cannot clean
up; its segments carry its pid, and ``unlink_stale`` removes those of dead owners.

The whole arena is reserved up front (``posix_fallocate``): a full /dev/shm fails ``create``
with CacheError instead of killing a later writer with SIGBUS.

``FenceBoard`` is an arena of 8-byte words: the connector writes a request's *ticket* into
its word once it will never touch that request's slots again; the shell frees or reuses the
slots only after reading its ticket back.

Not thread-safe for concurrent writers of one slot: slot ownership is the shell's job. No torch.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import weakref
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pdd.errors import CacheError, CacheFullError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME_RE = r"^[A-Za-z0-9_.-]{1,200}$"
_STALE_RE = re.compile(r"^(?P<prefix>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


class ArenaRef(BaseModel):
    """How another process finds an arena (JSON-safe: goes into kv_connector_extra_config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., pattern=_NAME_RE, description="File name under /dev/shm.")
    num_slots: int = Field(..., ge=1, description="Number of slots.")
    slot_bytes: int = Field(..., ge=1, description="Bytes per slot (one KV block, all layers).")

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """Shared read-write mapping, pre-faulted: no page faults later on the copy path."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink_path(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class SlotArena:
    """A mapping of one shared-memory arena; ``create`` (owner) or ``attach`` (others)."""

    def __init__(self, ref: ArenaRef, mm: mmap.mmap, owner: bool) -> None:
        """Use ``create`` or ``attach``."""
        self.ref = ref
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        self._buf: memoryview | None = memoryview(mm)
        self._unlinker = weakref.finalize(self, _unlink_path, SHM_DIR / ref.name) if owner else None

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, name_prefix: str = "pdd") -> SlotArena:
        """A new zeroed arena under a unique name ``<prefix>-<pid>-<hex>``; the caller owns it.

        Raises CacheFullError when /dev/shm cannot hold it, CacheError for a bad shape/prefix.
        """
        name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            ref = ArenaRef(name=name, num_slots=num_slots, slot_bytes=slot_bytes)
        except ValueError as exc:
            raise CacheError(f"bad arena {name!r}: {exc}") from exc
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, ref.nbytes)
            mm = _map(fd, ref.nbytes)
        except OSError as exc:
            _unlink_path(path)
            raise CacheFullError(f"cannot reserve {ref.nbytes} bytes in {SHM_DIR}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(ref, mm, owner=True)

    @classmethod
    def attach(cls, name: str, num_slots: int, slot_bytes: int) -> SlotArena:
        """Map an existing arena. Never unlinks it, not even when this process dies.

        Raises CacheError if it does not exist or its size is not num_slots * slot_bytes.
        """
        try:
            ref = ArenaRef(name=name, num_slots=num_slots, slot_bytes=slot_bytes)
        except ValueError as exc:
            raise CacheError(f"bad arena reference {name!r}: {exc}") from exc
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError as exc:
            raise CacheError(f"arena {name!r} does not exist in {SHM_DIR}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != ref.nbytes:
                raise CacheError(f"arena {name!r} has {size} bytes, expected {ref.nbytes}")
            mm = _map(fd, ref.nbytes)
        finally:
            os.close(fd)
        return cls(ref, mm, owner=False)

    @classmethod
    def attach_ref(cls, ref: ArenaRef) -> SlotArena:
        return cls.attach(ref.name, ref.num_slots, ref.slot_bytes)

    # --- access ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.ref.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.ref.slot_bytes

    @property
    def buffer(self) -> memoryview:
        """The whole arena, writable (e.g. HostTier(num_slots, slot_bytes, arena.buffer))."""
        if self._buf is None:
            raise CacheError(f"arena {self.ref.name!r} is closed")
        return self._buf

    def view(self, slot: int) -> memoryview:
        """Slot ``slot``: a writable view of exactly ``slot_bytes`` bytes."""
        if not 0 <= slot < self.ref.num_slots:
            raise CacheError(f"slot {slot} out of range [0, {self.ref.num_slots})")
        start = slot * self.ref.slot_bytes
        return self.buffer[start : start + self.ref.slot_bytes]

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this process's mapping. Idempotent. Views handed out earlier (and tensors made
        from them) keep the pages mapped until they are dropped too; never use them after."""
        buf, mm, self._buf, self._mm = self._buf, self._mm, None, None
        try:
            if buf is not None:
                buf.release()
            if mm is not None:
                mm.close()
        except BufferError:  # a view is still exported: unmapped when the last one dies
            log.debug("arena %s: views still alive at close", self.ref.name)

    def unlink(self) -> None:
        """Owner only: remove the name (mappings stay valid until closed). Idempotent."""
        if self._unlinker is None:
            raise CacheError(f"arena {self.ref.name!r} is attached, not owned: cannot unlink")
        self._unlinker()

    def __enter__(self) -> SlotArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


def unlink_stale(name_prefix: str = "pdd") -> list[str]:
    """Unlink the arenas ``<name_prefix>-<pid>-<hex>`` whose owner process is gone.

    For a shell starting up after a crash (a SIGKILLed owner cannot clean up). Returns the
    names removed. A pid that was reused by another process keeps its arenas (conservative).
    """
    removed = []
    for path in SHM_DIR.iterdir():
        m = _STALE_RE.match(path.name)
        if m is None or m["prefix"] != name_prefix or _alive(int(m["pid"])):
            continue
        _unlink_path(path)
        removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FenceBoard:
    """Release fences: one unsigned 64-bit word per index, in a shared arena.

    Protocol (one request): the shell picks a free index and a ticket it never used before
    (a counter from 1), passes both in the request's kv_transfer_params, and frees the
    request's slots only once ``read(index) == ticket``. The connector calls ``post`` exactly
    once per request, after the last engine step that could touch the request's slots. An
    aligned 8-byte store is a single write on the machines pdd runs on: readers never see a
    torn value. The index is free again once its ticket was read back.
    """

    WORD = 8

    def __init__(self, arena: SlotArena) -> None:
        if arena.slot_bytes != self.WORD:
            raise CacheError(f"a fence board needs {self.WORD}-byte slots, not {arena.slot_bytes}")
        self.arena = arena
        self._words = arena.buffer.cast("Q")

    @classmethod
    def create(cls, size: int, name_prefix: str = "pdd-fence") -> FenceBoard:
        return cls(SlotArena.create(size, cls.WORD, name_prefix))

    @classmethod
    def attach(cls, ref: ArenaRef) -> FenceBoard:
        return cls(SlotArena.attach_ref(ref))

    @property
    def ref(self) -> ArenaRef:
        return self.arena.ref

    @property
    def size(self) -> int:
        return self.arena.num_slots

    def post(self, index: int, ticket: int) -> None:
        self._words[index] = ticket

    def read(self, index: int) -> int:
        return self._words[index]

    def close(self) -> None:
        self._words.release()
        self.arena.close()

    def unlink(self) -> None:
        self.arena.unlink()

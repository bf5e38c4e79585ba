"""A kind's committed entities on disk: an LMDB environment beside its changelog.

The changelog stays the source of truth; the store is a checkpoint of the committed
state that lets a kind hold more entities than memory and open without reading its whole
changelog. It holds, in the ``entities`` database, entity id -> ``u64 version | u64
source_set | record`` (the record as written: one from before a migration is shorter and
padded by the reader), and under ``meta`` the checkpoint: the changelog offset replay
resumes from and the counts that go with it (:class:`StoreMeta`). A checkpoint (the
entities changed since the previous one, and its meta) is one LMDB write transaction, so
the store always reflects exactly one changelog offset.

Writes run in the engine's worker threads; reads (a cold entity, a scan chunk) from any
thread, each in its own short read transaction (LMDB readers never wait for the writer).
LMDB is opened with ``sync`` on and ``metasync`` off: one fdatasync per checkpoint, and a
machine crash loses at most the last checkpoint, never the store's integrity. Under the
``none`` sync policy (the changelog is not synced either) the store is not synced.
"""

from __future__ import annotations

import logging
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

import lmdb

from headwater.engine.kinds.fields import MAX_SOURCE_ID
from headwater.errors import StorageError

log = logging.getLogger(__name__)

STORE_DIR = "store"
FORMAT_VERSION = 1
# Address space reserved per kind (LMDB maps its file; pages are only used as written).
# The most one kind's store can hold: reaching it fails checkpoints with a clear error.
MAP_BYTES = 64 << 30
SCAN_CHUNK = 1024  # entities read per read transaction by a scan

ENTITY_HEAD = struct.Struct("<QQ")  # version, source_set; the record follows
SOURCES = MAX_SOURCE_ID + 1
META = struct.Struct(f"<IQQQQ{SOURCES}Q")
META_KEY = b"checkpoint"

Stored: TypeAlias = tuple[int, int, bytes]
"""An entity as stored: ``(version, source_set, record)``; the record as written."""


@dataclass
class StoreMeta:
    """What a checkpoint reflects: the changelog below ``offset``."""

    offset: int = 0  # changelog offset the replay at open resumes from
    position: int = 0  # the kind's applied position at that offset
    next_sequence: int = 0  # an event kind's next sequence
    count: int = 0  # live entities
    held: list[int] = field(default_factory=lambda: [0] * SOURCES)  # entities per source

    def encode(self) -> bytes:
        return META.pack(
            FORMAT_VERSION, self.offset, self.position, self.next_sequence, self.count, *self.held
        )

    @classmethod
    def decode(cls, data: bytes) -> StoreMeta | None:
        """None for a checkpoint of another format (the store is then rebuilt)."""
        if len(data) != META.size:
            return None
        version, offset, position, sequence, count, *held = META.unpack(data)
        if version != FORMAT_VERSION:
            return None
        return cls(offset, position, sequence, count, list(held))


class StoreDamaged(StorageError):
    """The store cannot be opened or read; it is rebuilt from the changelog."""


def encode_entity(version: int, source_set: int, record: bytes) -> bytes:
    return ENTITY_HEAD.pack(version, source_set) + record


def decode_entity(data: bytes) -> Stored:
    version, source_set = ENTITY_HEAD.unpack_from(data)
    return version, source_set, data[ENTITY_HEAD.size :]


class KindStore:
    """One kind's LMDB store (see the module docstring)."""

    def __init__(self, directory: Path, *, sync: bool = True) -> None:
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(
                str(directory),
                map_size=MAP_BYTES,
                max_dbs=2,
                max_readers=1024,  # a reader per running scan or SQL query
                sync=sync,
                metasync=False,
                readahead=False,  # random reads of cold entities: no read-ahead
                meminit=False,
            )
            self.entities = self.env.open_db(b"entities")
            self.meta_db = self.env.open_db(b"meta")
        except lmdb.Error as exc:
            raise StoreDamaged(f"entity store {directory}: {exc}") from exc

    @classmethod
    def open(cls, directory: Path, *, sync: bool = True) -> KindStore:
        """Open (creating) the store; one found damaged is deleted and created empty
        (logged), for the changelog to rebuild."""
        try:
            return cls(directory, sync=sync)
        except StoreDamaged as exc:
            log.warning("%s: rebuilding it from the changelog", exc)
            shutil.rmtree(directory, ignore_errors=True)
            return cls(directory, sync=sync)

    def meta(self) -> StoreMeta | None:
        """The last checkpoint; None when there is none (new or unreadable)."""
        try:
            with self.env.begin(db=self.meta_db) as txn:
                data = txn.get(META_KEY)
        except lmdb.Error as exc:
            log.warning("entity store %s: %s", self.directory, exc)
            return None
        return None if data is None else StoreMeta.decode(bytes(data))

    def get(self, entity_id: bytes) -> Stored | None:
        with self.env.begin(db=self.entities) as txn:
            data = txn.get(entity_id)
        return None if data is None else decode_entity(bytes(data))

    def write(
        self,
        puts: Iterable[tuple[bytes, Stored]],
        deletes: Iterable[bytes],
        meta: StoreMeta,
    ) -> None:
        """One checkpoint, one transaction: entities put and deleted, and its meta."""
        try:
            with self.env.begin(write=True) as txn:
                rows = [(eid, encode_entity(*stored)) for eid, stored in puts]
                if rows:
                    txn.cursor(db=self.entities).putmulti(rows)
                for eid in deletes:
                    txn.delete(eid, db=self.entities)
                txn.put(META_KEY, meta.encode(), db=self.meta_db)
        except lmdb.MapFullError as exc:
            raise StorageError(
                f"entity store {self.directory} is full ({MAP_BYTES >> 30} GiB)"
            ) from exc

    def clear(self) -> None:
        """Drop every entity and the checkpoint (before a rebuild)."""
        with self.env.begin(write=True) as txn:
            txn.drop(self.entities, delete=False)
            txn.drop(self.meta_db, delete=False)

    def chunk(
        self, after: bytes | None, limit: int = SCAN_CHUNK, txn: lmdb.Transaction | None = None
    ) -> list[tuple[bytes, Stored]]:
        """Up to ``limit`` entities in id order, from the first after ``after`` (from
        the first when None); read in ``txn`` when given, else in a transaction of its own."""
        if txn is None:
            with self.env.begin(db=self.entities) as own:
                return self.chunk(after, limit, own)
        cursor = txn.cursor(db=self.entities)
        if after is None:
            found = cursor.first()
        else:
            found = cursor.set_range(after)
            if found and cursor.key() == after:
                found = cursor.next()
        out: list[tuple[bytes, Stored]] = []
        while found and len(out) < limit:
            key, value = cursor.item()
            out.append((bytes(key), decode_entity(bytes(value))))
            found = cursor.next()
        return out

    def snapshot(self) -> lmdb.Transaction:
        """A read transaction: the store as it is now, for a reader in another thread
        (the caller aborts it when done)."""
        return self.env.begin(db=self.entities)

    def close(self) -> None:
        self.env.close()

"""Which partition of a stream each event of a batch goes to.

Three rules, in this order, per event (the Rivven seed's "Message Partitioning", which is
Kafka's producer):

* **explicit**: the producer named a partition; it must exist (else InvalidRequest).
* **keyed**: ``toPositive(murmur2(key)) % partitions``, Kafka's default partitioner to
  the bit (``Utils.murmur2``, seed ``0x9747b28c``; ``toPositive`` clears the sign bit), so
  a key lands on the same partition here as in Kafka with the same partition count. An
  empty key is a key (it hashes); only a missing key (None) is keyless, as in Kafka.
* **keyless**: the sticky partitioner. Keyless events stick to one partition until
  ``batch_messages`` of them went there (16,384 by default) or ``linger_ms`` passed since
  it was chosen (100 ms), then the next partition in turn takes over, as Rivven's
  ``StickyPartitioner`` does. Partitioning is batch at a time: every keyless event of one
  batch goes to the same partition (a batch is never split by the rotation; the check
  runs when a batch begins), so a producer's batch stays one append.

A batch is hashed with numpy (:func:`murmur2_spans`, over the keys laid end to end and
their bounds, as an Arrow binary array holds them): block position by block position
across every key that reaches it, as uint32 columns (uint32 arithmetic wraps modulo
2**32 exactly as Java's int does), then the tail bytes and the final mix of all keys at
once; no Python step per key.
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from headwater.engine.kinds.reader import Buffer
from headwater.errors import InvalidRequest

SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
# Below this many keys (in a batch, or still hashing at a block position) the rest go one
# key at a time in Python: numpy's fixed cost per operation is more than theirs.
_FEW_KEYS = 16
# By tail length (0-3): the bytes of the last word that are the key's, and whether the
# tail is mixed (multiplied) at all.
_TAIL_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF], dtype=np.uint32)
_TAIL_MULTIPLIERS = np.array([1, _M, _M, _M], dtype=np.uint32)

DEFAULT_BATCH_MESSAGES = 16 * 1024
DEFAULT_LINGER_MS = 100

PartitionArray = npt.NDArray[np.int32]


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` as a signed 32-bit int (the value Kafka's tests show)."""
    unsigned = _murmur2_one(data)
    return unsigned - (1 << 32) if unsigned & 0x80000000 else unsigned


def murmur2_batch(keys: Sequence[bytes]) -> npt.NDArray[np.uint32]:
    """``murmur2`` of every key, unsigned (uint32), in the keys' order."""
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    bounds = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return murmur2_spans(b"".join(keys), bounds)


def _mix_words(h: int, words: Iterable[int]) -> int:
    """Mix 4-byte blocks (little-endian u32 values) into a hash, in Python ints."""
    for k in words:
        k = (k * _M) & _MASK
        k ^= k >> 24
        h = ((h * _M) & _MASK) ^ ((k * _M) & _MASK)
    return h


def _murmur2_one(key: Buffer) -> int:
    """murmur2 (unsigned) of one key in Python ints: what :func:`murmur2_spans` does for
    a handful of keys, where numpy's cost per call is more than the hash's."""
    length = len(key)
    blocks = length >> 2
    h = _mix_words((SEED ^ length) & _MASK, struct.unpack_from(f"<{blocks}I", key))
    tail = length & 3
    if tail:
        last = key[length - tail :]
        h = ((h ^ int.from_bytes(last, "little")) * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def murmur2_spans(data: Buffer, bounds: npt.ArrayLike) -> npt.NDArray[np.uint32]:
    """Kafka's murmur2 (unsigned, uint32) of every item ``data[bounds[i]:bounds[i + 1]]``
    (an Arrow binary array's data and offsets as they are; ``bounds`` need not start at
    0). The one murmur2 of headwater: the engine's partitioner and the Spark sink both
    place keys with it."""
    ends = np.asarray(bounds, dtype=np.int64)
    count = len(ends) - 1
    if count < _FEW_KEYS:
        view = memoryview(data).cast("B")
        edges = ends.tolist()
        hashes = [_murmur2_one(view[lo:hi]) for lo, hi in itertools.pairwise(edges)]
        return np.array(hashes, dtype=np.uint32)
    # Zeros past the end, so that a u32 can be read where any item ends (its tail).
    buf = np.concatenate((np.frombuffer(data, dtype=np.uint8), np.zeros(4, np.uint8)))
    # Every little-endian u32 of the buffer, at any byte offset (unaligned reads).
    words = np.ndarray((len(buf) - 3,), dtype="<u4", buffer=buf, strides=(1,))
    starts = ends[:-1]
    lengths = ends[1:] - starts
    m = np.uint32(_M)
    h = lengths.astype(np.uint32) ^ np.uint32(SEED)
    blocks = lengths >> 2
    most = int(blocks.max())
    if most:
        _mix_blocks(words, starts, blocks, most, h)
    # The 1-3 bytes after the last block, as Kafka's switch mixes them, all keys at once.
    tail = lengths & 3
    h ^= words[starts + lengths - tail] & _TAIL_MASKS[tail]
    h *= _TAIL_MULTIPLIERS[tail]
    h ^= h >> np.uint32(13)
    h *= m
    h ^= h >> np.uint32(15)
    return h


def _mix_blocks(
    words: npt.NDArray[np.uint32],
    starts: npt.NDArray[np.int64],
    blocks: npt.NDArray[np.int64],
    most: int,
    h: npt.NDArray[np.uint32],
) -> None:
    """Mix every key's 4-byte blocks into ``h``, one block position at a time across
    all keys that reach it. The keys still hashing at block j are those at j - 1 less
    the ones that ended, kept in their order (rows ascending: the reads of the keys'
    bytes and of ``h`` go forward through memory). Once fewer than ``_FEW_KEYS`` keys
    are left, their remaining blocks go in Python, one key at a time (a lone key of
    megabytes costs one Python step per block, not numpy's overhead per block)."""
    m = np.uint32(_M)
    shortest = int(blocks.min())
    for j in range(min(shortest, most)):  # every key reaches these: whole columns
        k = words[starts + 4 * j]
        k *= m
        k ^= k >> np.uint32(24)
        k *= m
        h *= m
        h ^= k
    rows = np.flatnonzero(blocks > shortest)
    j = shortest
    while j < most and len(rows) >= _FEW_KEYS:
        k = words[starts[rows] + 4 * j]
        k *= m
        k ^= k >> np.uint32(24)
        k *= m
        hashed = h[rows]
        hashed *= m
        hashed ^= k
        h[rows] = hashed
        j += 1
        rows = rows[blocks[rows] > j]
    for row in rows.tolist():
        rest = words[starts[row] + 4 * np.arange(j, int(blocks[row]))]
        h[row] = _mix_words(int(h[row]), rest.tolist())


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def keyed_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for one key: ``toPositive(murmur2(key)) % partitions``."""
    return (_murmur2_one(key) & 0x7FFFFFFF) % partitions


class Partitioner:
    """The partitioner of one stream for one producer (the sticky state is per stream
    and producer, as Kafka's and Rivven's are). ``clock`` returns monotonic milliseconds
    (integers, so the linger compares exactly); tests inject their own."""

    def __init__(
        self,
        *,
        batch_messages: int = DEFAULT_BATCH_MESSAGES,
        linger_ms: int = DEFAULT_LINGER_MS,
        first_partition: int = 0,
        clock: Callable[[], int] = _monotonic_ms,
    ) -> None:
        if batch_messages < 0 or linger_ms < 0:
            raise ValueError("batch_messages and linger_ms must not be negative")
        self.batch_messages = batch_messages  # 0: rotate on time only, as Rivven
        self.linger_ms = linger_ms
        self._clock = clock
        self.sticky = first_partition
        self.sticky_count = 0  # keyless events sent to ``sticky`` since it was chosen
        self.sticky_since = clock()
        self.rotations = 0

    def _sticky_for_batch(self, partitions: int) -> int:
        now = self._clock()
        full = self.batch_messages > 0 and self.sticky_count >= self.batch_messages
        if full or now - self.sticky_since >= self.linger_ms:
            self.sticky = (self.sticky + 1) % partitions
            self.sticky_count = 0
            self.sticky_since = now
            self.rotations += 1
        return self.sticky % partitions

    def partition(
        self,
        keys: Sequence[bytes | None],
        partitions: int,
        explicit: Sequence[int | None] | None = None,
    ) -> PartitionArray:
        """The partition of each event of one batch (``keys[i]`` None: keyless;
        ``explicit[i]`` not None: that partition). ``partitions`` is the stream's count
        now (it may grow between batches, never shrink)."""
        if partitions < 1:
            raise InvalidRequest(f"a stream has at least one partition, not {partitions}")
        count = len(keys)
        if explicit is not None and len(explicit) != count:
            raise InvalidRequest("one explicit partition (or None) per event")
        out = np.empty(count, dtype=np.int32)
        chosen = np.zeros(count, dtype=bool)
        if explicit is not None:
            for i, p in enumerate(explicit):
                if p is not None:
                    if not 0 <= p < partitions:
                        raise InvalidRequest(
                            f"partition {p} does not exist (the stream has {partitions})"
                        )
                    out[i] = p
                    chosen[i] = True
        keyless = np.fromiter((key is None for key in keys), dtype=bool, count=count)
        keyless &= ~chosen
        hashed = ~(keyless | chosen)
        if hashed.all():  # the common keyed batch: hash the keys as given
            hashes = murmur2_batch(keys)  # type: ignore[arg-type]
            out[:] = (hashes & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)
        elif hashed.any():
            rows = np.flatnonzero(hashed)
            hashes = murmur2_batch([keys[i] for i in rows.tolist()])  # type: ignore[misc]
            out[rows] = (hashes & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)
        keyless_count = int(keyless.sum())
        if keyless_count:
            out[keyless] = self._sticky_for_batch(partitions)
            self.sticky_count += keyless_count
        return out

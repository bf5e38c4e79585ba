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

A batch is hashed with numpy: keys are grouped by length and each group's 4-byte blocks
are mixed as uint32 columns, one numpy step per block position rather than a Python step
per key (uint32 arithmetic wraps modulo 2**32 exactly as Java's int does). Groups of a
single key take the pure Python path, which is cheaper below a few keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from headwater.errors import InvalidRequest

SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF

DEFAULT_BATCH_MESSAGES = 16 * 1024
DEFAULT_LINGER_MS = 100

PartitionArray = npt.NDArray[np.int32]


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` as a signed 32-bit int (the value Kafka's tests show)."""
    unsigned = _murmur2_unsigned(data)
    return unsigned - (1 << 32) if unsigned & 0x80000000 else unsigned


def _murmur2_unsigned(data: bytes) -> int:
    length = len(data)
    h = (SEED ^ length) & _MASK
    blocks = length // 4
    for k in np.frombuffer(data, dtype="<u4", count=blocks).tolist() if blocks else ():
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length & 3
    if tail:
        base = length & ~3
        if tail == 3:
            h ^= data[base + 2] << 16
        if tail >= 2:
            h ^= data[base + 1] << 8
        h ^= data[base]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def murmur2_batch(keys: Sequence[bytes]) -> npt.NDArray[np.uint32]:
    """``murmur2`` of every key, unsigned (uint32), in the keys' order."""
    out = np.empty(len(keys), dtype=np.uint32)
    if not keys:
        return out
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    order = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[order]
    # Runs of equal length in the sorted order: each run is one matrix of rows.
    starts = np.flatnonzero(np.diff(sorted_lengths, prepend=-1))
    ends = np.append(starts[1:], len(keys))
    m = np.uint32(_M)
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        rows = order[start:end]
        length = int(sorted_lengths[start])
        if end - start == 1:
            out[rows[0]] = _murmur2_unsigned(keys[int(rows[0])])
            continue
        data = np.frombuffer(b"".join([keys[i] for i in rows.tolist()]), dtype=np.uint8)
        data = data.reshape(len(rows), length)
        h = np.full(len(rows), (SEED ^ length) & _MASK, dtype=np.uint32)
        blocks = length // 4
        if blocks:
            words = np.ascontiguousarray(data[:, : blocks * 4]).view("<u4")
            for j in range(blocks):
                k = words[:, j] * m
                k ^= k >> np.uint32(24)
                k *= m
                h *= m
                h ^= k
        tail = length & 3
        if tail:
            base = length & ~3
            if tail == 3:
                h ^= data[:, base + 2].astype(np.uint32) << np.uint32(16)
            if tail >= 2:
                h ^= data[:, base + 1].astype(np.uint32) << np.uint32(8)
            h ^= data[:, base].astype(np.uint32)
            h *= m
        h ^= h >> np.uint32(13)
        h *= m
        h ^= h >> np.uint32(15)
        out[rows] = h
    return out


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def keyed_partition(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for one key: ``toPositive(murmur2(key)) % partitions``."""
    return (_murmur2_unsigned(key) & 0x7FFFFFFF) % partitions


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

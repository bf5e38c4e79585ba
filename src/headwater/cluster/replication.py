"""Followers fetch from leaders; leaders keep the ISR and the high watermark.

Every node runs a replication listener (its port advertised in ``nodes/<id>`` as
``replication``) speaking :mod:`headwater.protocols.replication`.

**Follower.** For each partition it holds a replica of and does not lead, a task fetches
from the leader its stored batches from the follower's end and appends them byte for
byte. Each fetch names the follower's latest leader epoch; a leader whose log parted
from the follower's there answers ``diverging`` and the follower cuts its tail (the
tail an old leader wrote that nobody else has) before fetching again. The leader's
epoch list comes with every answer: the follower keeps the entries below its end.

**Leader.** A follower's fetch offset is its end: the leader records it, and the high
watermark is the smallest end among the ISR (its own included). An ISR member that has
not caught up with the leader's end for ``replica_lag_s`` leaves the ISR; a replica
that reaches the high watermark (and the current epoch's start) joins it; both are
written to etcd by a txn guarded on the partition key's revision, and only while this
node still leads at the same epoch. On becoming leader a node adds its epoch at its log
end to its leader-epoch checkpoint before it serves anything.

**High watermarks** are checkpointed to ``replication-offset-checkpoint`` in the data dir
(storage/high_watermarks.py) each tick one moved: a restarted follower answers from it
until its leader's first answer, and a new leader counts a follower it has not heard
from yet as holding what the high watermark it knew covered (as Kafka's leader starts
from its checkpointed high watermark), instead of zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headwater.cluster.etcd import EtcdError, put_json, unchanged
from headwater.cluster.layout import NO_LEADER, PartitionKey, PartitionState
from headwater.cluster.peers import LISTENER
from headwater.errors import HeadwaterError, NotLeader, ProtocolError, StorageError
from headwater.errors import NotEnoughReplicas as NotEnoughReplicas  # acks=all's, re-exported
from headwater.errors import NotEnoughReplicasAfterAppend as NotEnoughReplicasAfterAppend
from headwater.errors import ReplicationTimedOut as ReplicationTimedOut
from headwater.protocols import replication as wire
from headwater.server.tls import Listening, listen_with
from headwater.storage.high_watermarks import read_high_watermarks, write_high_watermarks
from headwater.storage.leader_epochs import UNKNOWN
from headwater.tasks import cancel_and_wait

if TYPE_CHECKING:
    from headwater.cluster.node import ClusterNode

log = logging.getLogger("headwater.cluster.replication")

FETCH_MAX_BYTES = 1 << 20
LONG_POLL_S = 0.5  # a caught-up follower's fetch waits this long for new batches
RETRY_S = 0.25


@dataclass(frozen=True)
class ReplicaStats:
    """One partition replica on this node, as /metrics shows it."""

    key: PartitionKey
    leader: bool  # leads it now (Replication.leads), else a follower
    replicas: int
    isr: int
    high_watermark: int
    log_end: int
    # Leader only, per follower: records behind the leader's end as of its last fetch,
    # and seconds since it last had everything the leader had (0: caught up).
    lag_records: dict[int, int] = field(default_factory=dict)
    lag_seconds: dict[int, float] = field(default_factory=dict)

    @property
    def under_replicated(self) -> bool:
        """Kafka's UnderReplicatedPartitions: led here, fewer in sync than replicas."""
        return self.leader and self.isr < self.replicas


class Replication:
    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.replicas = node.api.replicas
        self.me = node.config.node_id
        self.port = 0
        # Leader side, per partition led: each follower's end and when it last had
        # caught up with the leader's end; when this node started leading.
        self._ends: dict[PartitionKey, dict[int, int]] = {}
        self._caught_up: dict[PartitionKey, dict[int, float]] = {}
        self._last_fetch: dict[PartitionKey, dict[int, tuple[float, int]]] = {}
        self._leading_since: dict[PartitionKey, tuple[int, float]] = {}  # (epoch, when)
        self._progress = asyncio.Event()  # set on every follower progress: acks=all waits
        # Follower side: the task per partition followed and the high watermark learned.
        self._followers: dict[PartitionKey, tuple[tuple[int, int], asyncio.Task[None]]] = {}
        self.follower_hw: dict[PartitionKey, int] = {}
        # The partitions this node held a replica of at the last reconcile: one that a
        # reassignment then moved away is dropped (its copy truncated to nothing).
        self._held: set[PartitionKey] = set()
        # The high watermarks last written to the checkpoint, and a leader's floor: what
        # it knew as follower (or from the checkpoint) when it took the partition.
        try:
            checkpoint = read_high_watermarks(self.replicas.data_dir)
        except StorageError as exc:
            # Only a head start: without it the high watermarks start from zero, as
            # before the checkpoint existed, and rise with the followers' fetches.
            log.warning("%s; high watermarks start from zero", exc)
            checkpoint = {}
        self._checkpointed = {PartitionKey(*where): hw for where, hw in checkpoint.items()}
        self._hw_floor: dict[PartitionKey, int] = {}
        self._server: Listening | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # one per follower connection

    # ---- life ---------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        # TLS, the cluster secret and [limits] as node.security says (cluster/peers.py).
        security = self.node.security

        def connection() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._serve)

        self._server = await listen_with(
            security.limits, security.server_tls, LISTENER, connection, host, port
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await cancel_and_wait(*(task for _, task in self._followers.values()))
        self._followers.clear()
        if self._server is not None:
            self._server.close()
            # A fetch waiting for batches would hold the close for its long poll.
            handlers = list(self._handlers)
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()

    # ---- what the front ends ask --------------------------------------------------------

    def leads(self, key: PartitionKey) -> bool:
        """Whether this node leads ``key`` now (and has taken its epoch).

        A leader whose lease etcd has not renewed for a lease may have been replaced:
        cut off from etcd, it leads on only while a follower still fetches from it
        (within a lease), which none does once another leader is elected (followers
        follow etcd). So during an etcd outage, when nobody can be elected and the
        followers stay, it serves on; cut off alone, it stops taking writes and stops
        naming itself leader, and clients find the new one."""
        state = self.node.partitions.get(key)
        if state is None or state.leader != self.me:
            return False
        since = self._leading_since.get(key)
        if since is None or since[0] != state.epoch:
            return False
        if self.node.lease_fresh():
            return True
        fetched = [at for at, _end in self._last_fetch.get(key, {}).values()]
        return bool(fetched) and time.monotonic() - max(fetched) < self.node.config.lease_s

    def fenced(self) -> bool:
        """Whether this node is out of the cluster as far as clients should know: etcd
        has not renewed its lease for a lease (so etcd has dropped it and elected others
        in its place) and it leads nothing (no follower fetches from it). Its Kafka
        Metadata then leaves it out of the brokers: a client talking only to it (the
        producer's one connection once it led) would otherwise ask it, and only it, for
        the leader forever, and be told none. Left out, librdkafka drops the broker and
        asks the others, who know the new leader. During an etcd outage the leaders
        still lead (their followers fetch), so they stay listed."""
        if self.node.lease_fresh():
            return False
        return not any(self.leads(key) for key in self._leading_since)

    def stats(self) -> list[ReplicaStats]:
        """Every partition this node holds a replica of (/metrics, at scrape time)."""
        now = time.monotonic()
        found = []
        for key, state in sorted(self.node.partitions.items()):
            if self.me not in state.replicas:
                continue
            try:
                end = self.replicas.end(key.tenant_id, key.stream, key.partition)
            except HeadwaterError:
                continue  # not created here yet: the next tick does
            leading = self.leads(key)
            lag_records: dict[int, int] = {}
            lag_seconds: dict[int, float] = {}
            if leading:
                ends = self._ends.get(key, {})
                caught_up = self._caught_up.get(key, {})
                started = self._leading_since[key][1]
                for follower in state.replicas:
                    if follower == self.me:
                        continue
                    lag_records[follower] = max(end - ends.get(follower, 0), 0)
                    behind = end > ends.get(follower, 0)
                    since = caught_up.get(follower, started)
                    lag_seconds[follower] = now - since if behind else 0.0
            found.append(
                ReplicaStats(
                    key,
                    leading,
                    len(state.replicas),
                    len(state.isr),
                    self.high_watermark(key),
                    end,
                    lag_records,
                    lag_seconds,
                )
            )
        return found

    def high_watermark(self, key: PartitionKey) -> int:
        """Offsets below it are on every in-sync replica: what consumers may read. A
        follower answers the one its leader last told it."""
        state = self.node.partitions.get(key)
        if state is None:
            return 0
        if state.leader != self.me:
            return self.follower_hw.get(key, self._checkpointed.get(key, 0))
        end = self.replicas.end(key.tenant_id, key.stream, key.partition)
        ends = self._ends.get(key, {})
        floor = min(self._hw_floor.get(key, 0), end)
        hw = end
        for member in state.isr:
            if member != self.me:
                hw = min(hw, ends.get(member, floor))
        return hw

    async def wait_replicated(self, key: PartitionKey, offset: int, timeout_s: float) -> None:
        """acks=all, after the append: return once every in-sync replica holds offsets
        below ``offset``. NotEnoughReplicasAfterAppend when the ISR is (or falls) below
        min_insync_replicas, ReplicationTimedOut when the time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.node.partitions.get(key)
            if state is None or len(state.isr) < self.node.config.min_insync_replicas:
                have = 0 if state is None else len(state.isr)
                raise NotEnoughReplicasAfterAppend(
                    f"{have} in-sync replicas, below min_insync_replicas "
                    f"({self.node.config.min_insync_replicas})"
                )
            if self.high_watermark(key) >= offset:
                return
            if not self.leads(key):  # replaced meanwhile: the client asks the new leader
                raise NotLeader(
                    f"no longer the leader of partition {key.partition} of {key.stream}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicationTimedOut("the in-sync replicas did not confirm in time")
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.1)):
                    await self._progress.wait()

    # ---- each tick ----------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Take new leaderships (epoch into the checkpoint), keep the ISR of those led,
        start and stop follower tasks to match etcd's leaders."""
        held = {key for key, state in self.node.partitions.items() if self.me in state.replicas}
        wanted = {
            key: (state.leader, state.epoch)
            for key, state in self.node.partitions.items()
            if self.me in state.replicas and state.leader not in (self.me, NO_LEADER)
        }
        # Follower tasks stop (a cut under way finished) before this node leads: a
        # fetch answer of the old leader taken after that would append its tail to the
        # new leader's log, cut it, or put back its leader epochs, so the producer table
        # and the log the new leader serves would not be what it acknowledged from.
        stopping = []
        for key, (leader_epoch, task) in list(self._followers.items()):
            if wanted.get(key) != leader_epoch or task.done():
                task.cancel()
                stopping.append(task)
                del self._followers[key]
        await asyncio.gather(*stopping, return_exceptions=True)
        # Replicas moved off this node go once their follower tasks have stopped: a
        # fetch answer taken after the cut would fill the dropped copy again.
        undropped = set()
        for key in self._held - held:
            if key in self.node.partitions and not await self._drop(key):  # placed elsewhere
                undropped.add(key)  # tried again next tick
        self._held = held | undropped
        for key, state in self.node.partitions.items():
            if self.me in state.replicas and state.leader == self.me:
                try:
                    self._take_leadership(key, state)
                    await self._keep_isr(key, state)
                except HeadwaterError:
                    continue  # the stream is not here yet: the next tick creates it
        for key, leader_epoch in wanted.items():
            if key not in self._followers:
                task = asyncio.create_task(self._follow(key, *leader_epoch), name=f"follow {key}")
                self._followers[key] = (leader_epoch, task)
        await self._checkpoint_high_watermarks()

    async def _checkpoint_high_watermarks(self) -> None:
        """Write the high watermark of every partition held here, if one moved."""
        current: dict[PartitionKey, int] = dict(self._checkpointed)
        for key, state in self.node.partitions.items():
            if self.me not in state.replicas:
                continue
            try:
                current[key] = self.high_watermark(key)
            except HeadwaterError:
                continue  # the stream is not here yet
        if current == self._checkpointed:
            return
        await asyncio.to_thread(
            write_high_watermarks,
            self.replicas.data_dir,
            {(k.tenant_id, k.stream, k.partition): hw for k, hw in current.items()},
        )
        self._checkpointed = current

    async def _drop(self, key: PartitionKey) -> bool:
        """A replica moved off this node by a reassignment: its copy goes (truncated to
        nothing, as Kafka deletes it), so it is neither served nor counted here. False
        when it could not be cut."""
        try:
            end = await self.replicas.truncate(key.tenant_id, key.stream, key.partition, 0)
        except (HeadwaterError, OSError) as exc:
            log.warning("cannot drop the replica of %s: %s", key.path(), exc)
            return False
        self.follower_hw.pop(key, None)
        self._leading_since.pop(key, None)
        log.info("replica dropped", extra={"partition": key.path(), "end": end})
        return True

    async def forget(self, tenant_id: int, stream: str) -> None:
        """A stream deleted in the cluster: its partitions' follower tasks stop (a cut
        under way finished) and what this node knew of them as leader or follower goes
        (epoch taken, followers' ends, high watermarks, the checkpoint's lines), so the
        name created again starts from nothing: its partitions start at epoch 1 again."""

        def of_stream(key: PartitionKey) -> bool:
            return key.tenant_id == tenant_id and key.stream == stream

        stopping = []
        for key in [key for key in self._followers if of_stream(key)]:
            _, task = self._followers.pop(key)
            task.cancel()
            stopping.append(task)
        await asyncio.gather(*stopping, return_exceptions=True)
        known = (self._ends, self._caught_up, self._last_fetch, self._leading_since,
                 self._hw_floor, self.follower_hw)  # fmt: skip
        for per_key in known:
            for key in [key for key in per_key if of_stream(key)]:
                del per_key[key]
        self._held = {key for key in self._held if not of_stream(key)}
        if any(of_stream(key) for key in self._checkpointed):
            kept = {key: hw for key, hw in self._checkpointed.items() if not of_stream(key)}
            await asyncio.to_thread(
                write_high_watermarks,
                self.replicas.data_dir,
                {(k.tenant_id, k.stream, k.partition): hw for k, hw in kept.items()},
            )
            self._checkpointed = kept

    def _take_leadership(self, key: PartitionKey, state: PartitionState) -> None:
        since = self._leading_since.get(key)
        if since is not None and since[0] == state.epoch:
            return
        epochs = self.replicas.epochs(key.tenant_id, key.stream, key.partition)
        end = self.replicas.end(key.tenant_id, key.stream, key.partition)
        epochs.assign(state.epoch, end)
        self._leading_since[key] = (state.epoch, time.monotonic())
        # Every in-sync replica held what the high watermark known here covered.
        self._hw_floor[key] = self.follower_hw.get(key, self._checkpointed.get(key, 0))
        self._ends[key] = {}
        self._caught_up[key] = {}
        self._last_fetch[key] = {}
        log.info("leading", extra={"partition": key.path(), "epoch": state.epoch, "end": end})

    async def _keep_isr(self, key: PartitionKey, state: PartitionState) -> None:
        now = time.monotonic()
        lag_s = self.node.config.replica_lag_s
        ends = self._ends.get(key, {})
        caught_up = self._caught_up.get(key, {})
        fetches = self._last_fetch.get(key, {})
        started = self._leading_since[key][1]
        hw = self.high_watermark(key)
        epochs = self.replicas.epochs(key.tenant_id, key.stream, key.partition)
        epoch_start = epochs.entries[-1][1] if epochs.entries else 0
        isr = [
            member
            for member in state.isr
            if member == self.me or now - caught_up.get(member, started) <= lag_s
        ]
        for replica in state.replicas:
            end = ends.get(replica)
            fetched = fetches.get(replica)
            # Back in on a fetch within the lag, as Kafka expands the ISR only on a
            # follower's fetch: a dead follower's last end, once caught up, would
            # otherwise put it back on every tick after it was dropped. A node etcd
            # no longer lists is dead: the controller took it out of the ISR, and its
            # last fetch (within the lag) must not put it back.
            if (
                replica not in isr
                and replica in self.node.nodes
                and end is not None
                and end >= max(hw, epoch_start)
                and fetched is not None
                and now - fetched[0] <= lag_s
            ):
                isr.append(replica)
        if set(isr) == set(state.isr):
            return
        await self._write_isr(key, state, tuple(isr))

    async def _write_isr(
        self, key: PartitionKey, state: PartitionState, isr: tuple[int, ...]
    ) -> None:
        path = self.node.keys.partition(key)
        try:
            kv = await self.node.etcd.get(path)
            if kv is None:
                return
            current = PartitionState.from_json(kv.json())
            if (current.leader, current.epoch) != (self.me, state.epoch):
                return  # no longer ours to change
            changed = PartitionState(current.replicas, current.leader, current.epoch, isr)
            if await self.node.etcd.txn([unchanged(kv)], [put_json(path, changed.to_json())]):
                self.node.partitions[key] = changed
                log.info(
                    "isr changed",
                    extra={"partition": key.path(), "from": list(current.isr), "isr": list(isr)},
                )
        except EtcdError as exc:
            log.warning("cannot change the isr of %s: %s", key.path(), exc)

    # ---- leader: answering fetches -------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = writer.get_extra_info("peername")
        peer = f"{address[0]}:{address[1]}" if address else "?"
        self._connections.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        frames = self.node.security.frame_reader()
        accepted = False
        try:
            accepted = await self.node.security.accept(reader, writer, peer)
            if not accepted:
                return
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    return
                for frame in frames.feed(data):
                    if frame.header.get("kind") == wire.TXN_MARKER:  # cluster/transactions.py
                        marker = wire.TxnMarker.from_header(frame.header)
                        writer.write(await self.node.transactions.answer_marker(marker))
                    else:
                        writer.write(await self._answer(wire.Fetch.from_header(frame.header)))
                    await writer.drain()
        except ProtocolError as exc:
            log.warning("replication peer %s sent a bad frame: %s", peer, exc)
        except asyncio.CancelledError:
            # stop() cancels waiting fetches. Ended normally: Python 3.11's stream
            # server logs a connection task that ends cancelled as an unhandled error.
            pass
        except (ConnectionError, OSError):
            pass
        finally:
            if accepted:
                self.node.security.release()
            self._connections.discard(writer)
            if task is not None:
                self._handlers.discard(task)
            writer.close()

    async def _answer(self, fetch: wire.Fetch) -> bytes:
        try:
            return await self._answer_fetch(fetch)
        except HeadwaterError:
            # Deleted here while the fetch was answered (a stream deleted in the
            # cluster, maybe created again with fewer partitions): the follower asks
            # again, and its copy goes at its next tick.
            return wire.encode({"error": wire.UNKNOWN_PARTITION})

    async def _answer_fetch(self, fetch: wire.Fetch) -> bytes:
        key = PartitionKey(fetch.tenant, fetch.stream, fetch.partition)
        replica, offset, last_epoch = fetch.replica, fetch.offset, fetch.epoch
        max_bytes = min(fetch.max_bytes, FETCH_MAX_BYTES)
        state = self.node.partitions.get(key)
        if state is None or not self.leads(key):
            return wire.encode({"error": wire.NOT_LEADER})
        try:
            epochs = self.replicas.epochs(key.tenant_id, key.stream, key.partition)
            end = self.replicas.end(key.tenant_id, key.stream, key.partition)
        except HeadwaterError:
            return wire.encode({"error": wire.UNKNOWN_PARTITION})
        answer: dict[str, object] = {
            "error": None,
            "leader_epoch": state.epoch,
            "epochs": [list(entry) for entry in epochs.entries],
            "diverging": None,
        }
        if last_epoch != UNKNOWN:
            epoch, epoch_end = epochs.end_offset_for(last_epoch, end)
            if epoch < last_epoch or epoch_end < offset:
                answer["diverging"] = [epoch, epoch_end]
        elif offset > end:
            answer["diverging"] = [UNKNOWN, end]
        if answer["diverging"] is not None:
            return wire.encode({**answer, "hw": self.high_watermark(key), "leader_end": end})
        self._record(key, replica, offset, end)
        data = b""
        if offset < end:
            data = await self.replicas.read_stored(
                key.tenant_id, key.stream, key.partition, offset, max_bytes
            )
        else:
            if await self.replicas.wait_for_end(
                key.tenant_id, key.stream, key.partition, offset, LONG_POLL_S
            ):
                data = await self.replicas.read_stored(
                    key.tenant_id, key.stream, key.partition, offset, max_bytes
                )
        end = self.replicas.end(key.tenant_id, key.stream, key.partition)
        return wire.encode({**answer, "hw": self.high_watermark(key), "leader_end": end}, data)

    def _record(self, key: PartitionKey, replica: int, offset: int, leader_end: int) -> None:
        """A follower fetching from ``offset`` holds everything below it."""
        now = time.monotonic()
        self._ends.setdefault(key, {})[replica] = offset
        previous = self._last_fetch.setdefault(key, {}).get(replica)
        caught_up = self._caught_up.setdefault(key, {})
        if offset >= leader_end:
            caught_up[replica] = now
        elif previous is not None and offset >= previous[1]:
            caught_up[replica] = previous[0]  # it had what the leader had at its last fetch
        self._last_fetch[key][replica] = (now, leader_end)
        self._progress.set()
        self.node.front_ends.moved(key)

    # ---- follower: fetching ---------------------------------------------------------------

    async def _follow(self, key: PartitionKey, leader: int, epoch: int) -> None:
        writer: asyncio.StreamWriter | None = None
        reader: asyncio.StreamReader | None = None
        frames = wire.FrameReader()
        complained = False
        try:
            while True:
                try:
                    if writer is None or reader is None:
                        node = self.node.nodes.get(leader)
                        if node is None or "replication" not in node.ports:
                            await asyncio.sleep(RETRY_S)
                            continue
                        reader, writer = await self.node.security.connect(
                            node.host, node.ports["replication"]
                        )
                        frames = wire.FrameReader()
                    if not await self._fetch_once(key, leader, epoch, reader, writer, frames):
                        return  # led elsewhere (or here) now: reconcile starts what is due
                    complained = False
                except (OSError, ProtocolError, HeadwaterError, asyncio.IncompleteReadError) as exc:
                    if not complained:
                        log.warning(
                            "replication of %s from node %d: %s",
                            key.path(),
                            leader,
                            exc or type(exc).__name__,
                        )
                        complained = True
                    if writer is not None:
                        writer.close()
                    writer = reader = None
                    await asyncio.sleep(RETRY_S)
        finally:
            if writer is not None:
                writer.close()

    def _follows(self, key: PartitionKey, leader: int, epoch: int) -> bool:
        """Whether etcd's state, as last read, still has this replica follow ``leader``
        in ``epoch`` (checked on the loop right before a fetch answer changes the log)."""
        state = self.node.partitions.get(key)
        return state is not None and (state.leader, state.epoch) == (leader, epoch)

    async def _fetch_once(
        self,
        key: PartitionKey,
        leader: int,
        leader_epoch: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        frames: wire.FrameReader,
    ) -> bool:
        """One fetch from ``leader`` and what its answer says done to this replica;
        False, with nothing done, once etcd's state no longer has it lead in
        ``leader_epoch`` (the answer is stale)."""
        where = (key.tenant_id, key.stream, key.partition)
        epochs = self.replicas.epochs(*where)
        end = self.replicas.end(*where)
        fetch = wire.Fetch(
            key.tenant_id, key.stream, key.partition, end, epochs.latest, self.me, FETCH_MAX_BYTES
        )
        writer.write(fetch.encode())
        await writer.drain()
        answer = None
        while answer is None:
            data = await reader.read(1 << 20)
            if not data:
                raise ConnectionError("the leader closed the connection")
            got = frames.feed(data)
            if got:
                answer = got[0]
        header = answer.header
        if not self._follows(key, leader, leader_epoch):
            return False
        if header.get("error"):
            await asyncio.sleep(RETRY_S)  # not (yet) the leader: etcd's next state tells
            return True
        diverging = header.get("diverging")
        if diverging is not None:
            epoch, epoch_end = int(diverging[0]), int(diverging[1])
            target = 0
            if epoch != UNKNOWN:
                mine_epoch, mine_end = epochs.end_offset_for(epoch, end)
                target = min(epoch_end, mine_end) if mine_epoch != UNKNOWN else 0
            cut = asyncio.ensure_future(self.replicas.truncate(*where, max(target, 0)))
            try:
                new_end = await asyncio.shield(cut)
            except asyncio.CancelledError:
                await cut  # the cut runs in a thread: it ends before this task does
                raise
            log.warning(
                "truncated a divergent tail",
                extra={"partition": key.path(), "from": end, "to": new_end, "epoch": epoch},
            )
            return True
        if answer.data:
            end = await self.replicas.append_stored(*where, answer.data)
            if not self._follows(key, leader, leader_epoch):
                return False  # its epochs are the new leader's to set
        leader_epochs = [(int(e), int(s)) for e, s in header.get("epochs", [])]
        held = [(e, s) for e, s in leader_epochs if s < end]  # the epochs of what it holds
        if held and held != epochs.entries:
            epochs.replace(held)
        self.follower_hw[key] = min(int(header.get("hw", 0)), end)
        self.node.front_ends.moved(key)
        return True

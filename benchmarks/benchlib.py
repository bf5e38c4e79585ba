"""What the benchmarks share: the machine's description, percentiles, CPU accounting,
the servers they start (headwater, redis-server) and a raw RESP client.

Benchmarks run as scripts from this directory (``python benchmarks/x_bench.py``), so they
import this module as ``benchlib``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from headwater.sql.projection import CATCH_UP_DELAY

HOST = "127.0.0.1"
RECV = 1 << 20
# settle(): idle this long in a row, sampled in steps of SETTLE_STEP_S.
QUIET_S = CATCH_UP_DELAY + 0.25
SETTLE_STEP_S = 0.25


# ---- environment ------------------------------------------------------------------------


def mount_of(path: Path) -> dict[str, str]:
    """The /proc/mounts entry (device, mountpoint, fstype) holding ``path``."""
    best = {"device": "?", "mountpoint": "/", "fstype": "?"}
    resolved = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) > best_len:
            best = {"device": parts[0], "mountpoint": mnt, "fstype": parts[2]}
            best_len = len(mnt)
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def git_revision() -> str:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=here,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            cwd=here,
            check=False,
        ).stdout.strip()
    except OSError:
        return "?"
    return (rev or "?") + ("+dirty-src" if dirty else "")


_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int, thread: int | None = None) -> float:
    """CPU seconds (user + system) used so far by process ``pid``: all its threads, or
    only ``thread`` (a thread id; ``pid`` itself is the main thread, the event loop's)."""
    stat = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def settle(pids: list[int], timeout: float, busy: float = 0.03) -> float:
    """Wait until every process in ``pids`` used under ``busy`` of a core over
    :data:`QUIET_S` in a row (a run must not pay for work left over from the previous
    one, such as headwater's SQL projections catching up); returns the seconds waited.

    The quiet span outlasts the projection's deferred start (``CATCH_UP_DELAY``, 0.5 s
    after a stream's first commit): with a shorter one, a produce over in under 0.25 s
    (400,000 events through Kimberlite) looked settled before its catch-up began, and
    that catch-up was charged to the next round."""
    started = time.perf_counter()
    quiet_since = started
    while time.perf_counter() - started < timeout:
        before = [proc_cpu(p) for p in pids]
        time.sleep(SETTLE_STEP_S)
        now = time.perf_counter()
        if not all(
            proc_cpu(p) - b < busy * SETTLE_STEP_S + 1 / _TICK
            for p, b in zip(pids, before, strict=True)
        ):
            quiet_since = now
        elif now - quiet_since >= QUIET_S:
            break
    return time.perf_counter() - started


def pct(samples: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fsync_latency(directory: Path, rounds: int, batch_bytes: int | None = None) -> dict[str, float]:
    """fdatasync latency after appending 4 KiB (``4k_p50_ms``, ``4k_p99_ms``) and, given
    ``batch_bytes``, after appending one batch (``batch_p50_ms``, ``batch_p99_ms``)."""
    path = directory / "fsync-probe"
    out: dict[str, float] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        sizes = [("4k", 4096)] + ([("batch", batch_bytes)] if batch_bytes else [])
        for label, size in sizes:
            buf = os.urandom(size)
            lat = []
            for _ in range(rounds):
                os.write(fd, buf)
                t = time.perf_counter()
                os.fdatasync(fd)
                lat.append(time.perf_counter() - t)
            lat.sort()
            out[f"{label}_p50_ms"] = lat[len(lat) // 2] * 1e3
            out[f"{label}_p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return out


# ---- servers ----------------------------------------------------------------------------


class ServerProcess:
    name = "?"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path: Path | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with code {self.proc.returncode}:\n{self.log_tail()}"
            )

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class HeadwaterServer(ServerProcess):
    name = "headwater"

    # Every listener this checkout has; an older revision (``src``) may know fewer, and
    # its config refuses a key it does not know.
    LISTENERS = ("kimberlite", "http", "convergedb", "ripple", "postgres", "rivven", "kafka")

    def __init__(
        self,
        src: Path | None = None,
        name: str = "headwater",
        known_listeners: tuple[str, ...] = LISTENERS,
    ) -> None:
        """``src``: run the server from that checkout's ``src/`` (another revision, for a
        before/after comparison in one run) instead of the installed package;
        ``known_listeners``: the listener keys that revision's config takes."""
        super().__init__()
        self.src = src
        self.name = name
        self.known_listeners = known_listeners

    def start(
        self, root: Path, extra_config: str = "", listeners: tuple[str, ...] = ("kimberlite",)
    ) -> None:
        """Start with the ``listeners`` on ephemeral ports (all found in :attr:`ports`)."""
        data_dir = root / "headwater-data"
        ports_file = root / "headwater-ports.json"
        config = root / "headwater.toml"
        listen = "".join(
            f'{name} = "{"127.0.0.1:0" if name in listeners else ""}"\n'
            for name in self.known_listeners
        )
        config.write_text("[listen]\n" + listen + '\n[logging]\nlevel = "WARNING"\n' + extra_config)
        self.log_path = root / "headwater.log"
        cmd = [
            sys.executable,
            "-m",
            "headwater.cli.main",
            "serve",
            "--data-dir",
            str(data_dir),
            "--ports-file",
            str(ports_file),
            "--config",
            str(config),
        ]
        env = dict(os.environ)
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while not ports_file.exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"headwater did not write {ports_file}:\n{self.log_tail()}")
            time.sleep(0.05)
        self.ports: dict[str, int] = json.loads(ports_file.read_text())
        self.port = self.ports.get("kimberlite", 0)


CLUSTER_NODES = (1, 2, 3)


@contextmanager
def cluster_and_single(
    root: Path, listeners: tuple[str, ...] = ("kafka", "kimberlite")
) -> Iterator[tuple[list[HeadwaterServer], HeadwaterServer]]:
    """A cluster of :data:`CLUSTER_NODES` on one etcd and a single node beside it (each
    under ``root``, with ``listeners``), for the cluster benchmarks to compare side by
    side in one run; every server and etcd stopped at the end."""
    from headwater.cluster.local import EtcdProcess  # only the cluster benchmarks need it

    etcd = EtcdProcess(root / "etcd").start()
    nodes: list[HeadwaterServer] = []
    single = HeadwaterServer(name="single")
    try:
        for node_id in CLUSTER_NODES:
            node = HeadwaterServer(name=f"node{node_id}")
            (root / f"node{node_id}").mkdir(parents=True, exist_ok=True)
            node.start(
                root / f"node{node_id}",
                f'[cluster]\nnode_id = {node_id}\netcd = ["{etcd.endpoint}"]\n',
                listeners=listeners,
            )
            nodes.append(node)
        (root / "single").mkdir(parents=True, exist_ok=True)
        single.start(root / "single", listeners=listeners)
        yield nodes, single
    finally:
        for node in [*nodes, single]:
            node.stop()
        etcd.stop()


def rounds_side_by_side(
    systems: dict[str, str], rounds: int, run_round: Callable[[str], dict[str, float]]
) -> tuple[dict[str, dict[str, float]], list[float]]:
    """``run_round`` against each system's address in turn, ``rounds`` times (the systems
    interleaved, so the machine's load falls on all alike): each system's median of
    every measure, and the 1-minute load average before and after each round."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    loads = [loadavg()[0]]
    for round_no in range(rounds):
        for name, address in systems.items():
            result = run_round(address)
            results[name].append(result)
            log(f"round {round_no + 1} {name}: {result}")
        loads.append(loadavg()[0])
    medians = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in results.items()
    }
    return medians, loads


def cluster_vs_single(
    medians: dict[str, dict[str, float]], loads: list[float], rate_key: str, rate_name: str
) -> str:
    """The line comparing a cluster's medians with one node's: the rate (``rate_key``),
    p50 (as a ratio and the milliseconds added) and p99, and the load over the run."""
    cluster, one = medians["cluster"], medians["single"]
    return (
        f"cluster / single: {rate_name} {cluster[rate_key] / one[rate_key]:.2f}x,"
        f" p50 {cluster['p50_ms'] / one['p50_ms']:.2f}x"
        f" (+{cluster['p50_ms'] - one['p50_ms']:.2f} ms),"
        f" p99 {cluster['p99_ms'] / one['p99_ms']:.2f}x;"
        f" load average {min(loads):.1f}-{max(loads):.1f}"
    )


class RedisServer(ServerProcess):
    name = "redis"

    def __init__(self, binary: str, appendfsync: str = "always") -> None:
        super().__init__()
        self.binary = binary
        self.appendfsync = appendfsync
        self.version = "?"

    def start(self, root: Path, aof_rewrite: bool) -> None:
        directory = root / "redis"
        directory.mkdir()
        self.log_path = root / "redis.log"
        self.port = free_port()
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--dir",
            str(directory),
            "--logfile",
            str(self.log_path),
        ]
        if not aof_rewrite:
            cmd += ["--auto-aof-rewrite-percentage", "0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            self.check_alive()
            try:
                client = RespClient(self.port)
                if client.call(b"PING") == b"PONG":
                    break
            except (OSError, RespError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer:\n{self.log_tail()}") from None
                time.sleep(0.05)
        info = client.call(b"INFO", b"server") + client.call(b"INFO", b"persistence")
        fields = dict(line.split(":", 1) for line in info.decode().splitlines() if ":" in line)
        self.version = fields.get("redis_version", "?")
        if fields.get("aof_enabled") != "1":
            raise RuntimeError("redis-server started without the append-only file")
        policy = client.call(b"CONFIG", b"GET", b"appendfsync")
        if policy != [b"appendfsync", self.appendfsync.encode()]:
            raise RuntimeError(f"redis appendfsync is {policy!r}, not {self.appendfsync}")
        client.close()


# ---- RESP -------------------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class RespError(Exception):
    pass


_INCOMPLETE = object()


def resp_command(*args: bytes | str | int) -> bytes:
    """One RESP command (an array of bulk strings) as bytes."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = (
            arg.encode() if isinstance(arg, str) else b"%d" % arg if isinstance(arg, int) else arg
        )
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def parse_reply(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One RESP2 reply at ``pos``: ``(value, next pos)``, or ``(_INCOMPLETE, pos)``.

    Bulk strings become bytes, arrays lists, errors RespError instances (not raised).
    """
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return _INCOMPLETE, pos
    kind = buf[pos]
    line = bytes(buf[pos + 1 : end])
    after = end + 2
    if kind == 43:  # +
        return line, after
    if kind == 45:  # -
        return RespError(line.decode(errors="replace")), after
    if kind == 58:  # :
        return int(line), after
    if kind == 36:  # $
        n = int(line)
        if n < 0:
            return None, after
        if len(buf) < after + n + 2:
            return _INCOMPLETE, pos
        return bytes(buf[after : after + n]), after + n + 2
    if kind == 42:  # *
        n = int(line)
        if n < 0:
            return None, after
        items = []
        for _ in range(n):
            item, after = parse_reply(buf, after)
            if item is _INCOMPLETE:
                return _INCOMPLETE, pos
            items.append(item)
        return items, after
    raise RespError(f"unexpected RESP type byte {kind!r}")


class RespClient:
    """A blocking RESP2 client over one socket, for setup and the latency tests."""

    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def feed(self, data: bytes) -> list[Any]:
        """Add received bytes; return every reply now complete."""
        self.buf += data
        replies = []
        pos = 0
        while pos < len(self.buf):
            reply, new = parse_reply(self.buf, pos)
            if reply is _INCOMPLETE:
                break
            replies.append(reply)
            pos = new
        del self.buf[:pos]
        return replies

    def read_reply(self) -> Any:
        while True:
            reply, pos = parse_reply(self.buf, 0)
            if reply is not _INCOMPLETE:
                del self.buf[:pos]
                return reply
            data = self.sock.recv(RECV)
            if not data:
                raise ConnectionError("redis closed the connection")
            self.buf += data

    def call(self, *args: bytes | str | int) -> Any:
        self.sock.sendall(resp_command(*args))
        reply = self.read_reply()
        if isinstance(reply, RespError):
            raise reply
        return reply


# ---- command line -----------------------------------------------------------------------


def default_root(prefix: str = "headwater-bench-") -> Path:
    """Scratch space on the disk under test: under /work when it exists (not /tmp, which
    may be tmpfs), else the system temp dir. Removed when the benchmark exits (each run
    leaves hundreds of MiB otherwise: seventeen runs filled the disk), unless
    HEADWATER_BENCH_KEEP=1 asks to keep it for a look afterwards."""
    base = Path("/work") if Path("/work").is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    if os.environ.get("HEADWATER_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except for on/off flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def timed(action: Callable[[], object]) -> float:
    """Seconds ``action()`` took."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def report(
    results: dict[str, Any], markdown: Callable[[dict[str, Any]], str], out: Path | None
) -> None:
    """A benchmark's ending: its results as JSON to ``out`` (when given), its markdown
    table to stdout."""
    if out is not None:
        out.write_text(json.dumps(results, indent=2))
    print(markdown(results))


# ---- Spark against Parquet (spark_bench, spark_partitions_bench) ------------------------


def spark_session(**conf: str) -> Any:
    """The Spark benchmarks' session: local[2] (the machine's 2 cores), no UI, 2 GB
    driver, UTC, errors only; ``conf`` adds settings. Imports pyspark only when called."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
    )
    for name, value in conf.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def spark_rates(events: int, runs: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """``runs[measurement][side]`` (side "headwater" or "parquet": seconds per run) as
    the median rows/s of each side plus the runs, per measurement."""
    return {
        name: {
            "headwater": events / statistics.median(sides["headwater"]),
            "parquet": events / statistics.median(sides["parquet"]),
            "runs_s": sides,
        }
        for name, sides in runs.items()
    }


def spark_table(results: dict[str, Any], with_runs: bool = False) -> list[str]:
    """The Markdown table of the read and write measurements (``spark_rates``), with
    each run's seconds when ``with_runs``."""
    lines = [
        "| measurement | headwater rows/s | Parquet rows/s | headwater / Parquet "
        + ("| runs s (hw / pq) |" if with_runs else "|"),
        "|---|--:|--:|--:|" + ("---|" if with_runs else ""),
    ]
    for name in ("read", "write"):
        r = results[name]
        runs = r["runs_s"]
        lines.append(
            f"| {name} | {r['headwater']:,.0f} | {r['parquet']:,.0f} | "
            f"**{r['headwater'] / r['parquet']:.2f}** |"
            + (
                f" {', '.join(f'{t:.2f}' for t in runs['headwater'])} / "
                f"{', '.join(f'{t:.2f}' for t in runs['parquet'])} |"
                if with_runs
                else ""
            )
        )
    return lines


# ---- Kafka ------------------------------------------------------------------------------


def kafka_consume_all(
    bootstrap: str, topic: str, partitions: int, count: int, deadline_s: float
) -> None:
    """``count`` messages read with confluent-kafka from offset 0 of every partition of
    ``topic`` (one consumer assigned them all); a message error raises, and so does
    not having them all within ``deadline_s``."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench_" + uuid.uuid4().hex[:8],
            "enable.auto.commit": False,
            "fetch.max.bytes": 8 << 20,
            "max.partition.fetch.bytes": 4 << 20,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got = 0
    deadline = time.monotonic() + deadline_s
    try:
        while got < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumed {got} of {count}")
            # Only what is left: consume() waits out its timeout for a number not coming.
            batch = consumer.consume(min(10_000, count - got), 1.0)
            for message in batch:
                if message.error() is not None:
                    raise KafkaException(message.error())
            got += len(batch)
    finally:
        consumer.close()

"""Child process for the killed-writer tests: a ConvergeDB source (the entities SDK) that
asserts some entities and then stays connected, heartbeating, until it is killed.

Usage::

    python cdb_writer.py ADDRESS KIND SOURCE_ID LIVENESS_MS FIRST COUNT [--wait]

It connects as source SOURCE_ID with a liveness deadline of LIVENESS_MS, asserts the
entities ``e<FIRST>`` .. ``e<FIRST+COUNT-1>`` of KIND (fields ``n: u32, owner: string``;
the kind must exist), flushes and prints ``READY <source_id>``. With ``--wait`` it first
prints ``WAITING`` (Python and headwater are loaded) and connects only once a line
arrives on stdin, so a parent can have it reconnect a slot within milliseconds.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from headwater import entities
from headwater.entities import FieldType, SourceConflict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for waiting.py
from waiting import wait_until

FIELDS = [("n", int(FieldType.U32)), ("owner", int(FieldType.STRING))]


def main() -> None:
    address, kind_name, source, liveness, first, count = sys.argv[1:7]
    if "--wait" in sys.argv[7:]:
        print("WAITING", flush=True)
        sys.stdin.readline()

    def connected() -> entities.EntityClient | None:
        try:
            return entities.connect(
                address,
                name=f"writer-{source}",
                source_id=int(source),
                liveness_ms=int(liveness),
                reconnect=False,
            )
        except SourceConflict:
            return None  # the server has not yet seen the old connection of this slot end

    client = wait_until(connected, 10, f"source {source} stayed taken")
    kind = client.kind_from_schema(kind_name, FIELDS)
    for i in range(int(first), int(first) + int(count)):
        client.assert_(kind, f"e{i}", {"n": i, "owner": f"source {source}"})
    client.flush()
    print(f"READY {client.source_id}", flush=True)
    while True:  # until killed; the client's loop thread heartbeats meanwhile
        signal.pause()


if __name__ == "__main__":
    main()

"""Rivven's BeginTransaction bindings: an instance replaced by a newer one may not
begin again, whatever the producer ids' order (a cluster's nodes hand out ids from
blocks of their own, so a newer instance may hold a lower id)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from headwater.engine.transactions import ProducerIdentity
from headwater.errors import ProducerFenced
from headwater.server.rivven.handlers import TransactionalIds


class Coordinator:
    """The engine's init_producer: the transactional id's epoch bumped each time."""

    def __init__(self) -> None:
        self.epoch = -1

    async def init_producer(self, tenant: int, txn_id: str, timeout: Any) -> ProducerIdentity:
        self.epoch += 1
        return ProducerIdentity(7, self.epoch)


def test_a_replaced_instance_is_fenced_and_a_newer_one_with_a_lower_id_is_not() -> None:
    async def main() -> None:
        ids, api = TransactionalIds(), Coordinator()
        await ids.begin(api, 0, "job", (100, 0), 0)  # type: ignore[arg-type]
        # A restarted producer whose InitProducerId another node answered: a lower id.
        await ids.begin(api, 0, "job", (5, 0), 0)  # type: ignore[arg-type]
        assert ids.identity(0, "job", (5, 0)) == ProducerIdentity(7, 1)
        with pytest.raises(ProducerFenced, match="was begun by a newer producer"):
            await ids.begin(api, 0, "job", (100, 0), 0)  # type: ignore[arg-type]
        ids.forget(0, "job")  # expired: anyone may begin it anew
        await ids.begin(api, 0, "job", (100, 0), 0)  # type: ignore[arg-type]
        assert ids.identity(0, "job", (100, 0)) == ProducerIdentity(7, 2)

    asyncio.run(main())

"""Exactly-once producers: producer ids, epochs and transactions (docs/transactions.md)."""

from headwater.engine.transactions.coordinator import (
    DEFAULT_TRANSACTION_TIMEOUT_MS,
    FIRST_PRODUCER_ID,
    TRANSACTIONAL_ID_EXPIRATION_MS,
    TXN_STATE_STREAM,
    ClusterHooks,
    ProducerIdentity,
    TenantTransactions,
    TransactionCoordinator,
    TxnBatchOptions,
    TxnState,
    append_transactional,
    create_state_stream,
    write_marker,
)
from headwater.engine.transactions.stable import stable_position

__all__ = [
    "DEFAULT_TRANSACTION_TIMEOUT_MS",
    "FIRST_PRODUCER_ID",
    "TRANSACTIONAL_ID_EXPIRATION_MS",
    "TXN_STATE_STREAM",
    "ClusterHooks",
    "ProducerIdentity",
    "TenantTransactions",
    "TransactionCoordinator",
    "TxnBatchOptions",
    "TxnState",
    "append_transactional",
    "create_state_stream",
    "stable_position",
    "write_marker",
]

"""The connection core under every SDK client (streams over Kimberlite, entities over
ConvergeDB, the Ripple worker).

* :mod:`.link`: one TCP connection through a sans-I/O codec of
  :mod:`headwater.protocols`: requests matched to their answers by key, pushes routed to
  their subscriptions.
* :mod:`.session`: connecting with the protocol's greeting (and auth token), reconnecting
  with exponential backoff and jitter (one round at a time: no reconnect storm),
  requests retried when safe, subscriptions recovered on a new connection.
* :mod:`.blocking`: the blocking clients, each an asyncio client run on a loop thread.
* :mod:`.batching`: many items (events, ops) split into requests within a protocol's
  limits.

It lives in the ``client`` package so that it can raise :mod:`headwater.client.errors`
(importing a module here always runs ``headwater.client`` first); the entities SDK and
the Ripple worker import it from here.

Each SDK adds only what its protocol says: which codec, how a message is routed, what
the greeting is, which requests are safe to repeat.
"""

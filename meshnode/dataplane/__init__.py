"""The shard data plane: sans-IO session machines, and their asyncio edges over any PeerLink.

Sans-IO (pure, time is a parameter; the :mod:`meshnode.sansio` convention):

- :mod:`.worker` — :class:`ShardWorker`, the node-wide worker state machine;
- :mod:`.client` — :class:`SessionClient`, one route session toward one peer hop;
- :mod:`.unary` — GetCapability, Health, Release and Cancel handlers;
- :mod:`.actions` — what the worker asks its edge to do;
- :mod:`.route` — the ``SessionRoute`` first frame;
- :mod:`.steps` — idempotency bookkeeping; :mod:`.payload` — tensors per hop role;
- :mod:`.errors` — every refusal, and the engine-error mapping table.

Asyncio edges (depend only on ``meshnode.transport.base``, so QUIC, relay channels
and the loopback are served alike):

- :mod:`.server` — :class:`ShardServer`, serving a worker on session and unary streams;
- :mod:`.session_link` — :class:`ShardSession`, the caller's async API (what a head uses);
- :mod:`.rpc` — the unary calls from the caller's side;
- :mod:`.service` — a node serving ``--model``/``--layers``: load, validate, announce;
- :mod:`.engine_thread`, :mod:`.wake_timer` — the engine's FIFO thread, the machines' timer.
"""

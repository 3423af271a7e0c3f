"""The shard data plane, sans-IO: the worker and client session machines and the unary handlers.

- :mod:`.worker` — :class:`ShardWorker`, the node-wide worker state machine;
- :mod:`.client` — :class:`SessionClient`, one route session toward one peer hop;
- :mod:`.unary` — GetCapability, Health, Release and Cancel handlers;
- :mod:`.actions` — what the worker asks its edge to do;
- :mod:`.route` — the ``SessionRoute`` first frame;
- :mod:`.steps` — idempotency bookkeeping; :mod:`.payload` — tensors per hop role;
- :mod:`.errors` — every refusal, and the engine-error mapping table.
"""

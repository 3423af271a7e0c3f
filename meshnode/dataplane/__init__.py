"""The shard data plane: sans-IO session machines here, their asyncio edges in :mod:`.edges`.

The layout tells the runtime: every module directly in this package is a machine (pure, time
and bytes passed in, the :mod:`meshnode.sansio` convention) and may not import asyncio, socket
or selectors, through any chain of imports (the import contract in pyproject.toml, checked by
tests/ops/test_import_contracts.py); :mod:`.edges` drives them over any PeerLink.

The worker (what a node serving a shard runs), composed in :mod:`.worker`:

- :mod:`.worker` — :class:`ShardWorker`: reads frames, composes the parts below;
- :mod:`.stream_rules` — which request is legal in which phase (a table), what an open or a
  unit must match; :mod:`.request_reader` — a stream's frames, read;
- :mod:`.stream_table` — streams, replies, credit, direct answers;
- :mod:`.session_table` — sessions, epochs, leases (:mod:`.lease` for the rules);
- :mod:`.admission` — what is admitted (pure limits);
- :mod:`.session_keeper` — which session a unit belongs to, and ending one;
- :mod:`.batch_former` — queues, the fair round robin (:mod:`.batching`), the hold, the
  running batch; :mod:`.unit_runner` — batches, results, forwarding, replay, giving units up;
  :mod:`.unit_steps` — a unit as an engine step, a result as an answer;
- :mod:`.actions` — what the worker asks its edge to do; :mod:`.unary` — GetCapability,
  Health, Release and Cancel.

The sender (what a head or a forwarding worker uses): :mod:`.client` (:class:`SessionClient`),
with :mod:`.client_book` (where each unit stands), :mod:`.client_requests` (what it writes),
:mod:`.client_units`, :mod:`.client_events`, :mod:`.step_outputs`.

Shared: :mod:`.route` (the ``SessionRoute`` first frame), :mod:`.envelope`, :mod:`.steps`
(idempotency), :mod:`.payload` (tensors per hop role), :mod:`.errors` (every refusal, and the
engine-error mapping table).
"""

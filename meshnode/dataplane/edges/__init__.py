"""The data plane's asyncio edges: they drive its sans-IO machines over any PeerLink.

They depend only on ``meshnode.transport.base``, so QUIC, relay channels and the loopback are
served alike:

- :mod:`.server` — :class:`ShardServer`, serving a :class:`~meshnode.dataplane.worker.ShardWorker`
  on session and unary streams, and the engine through :mod:`.engine_thread` (its FIFO thread);
- :mod:`.shard_session` — :class:`ShardSession`, the caller's async API over a
  :class:`~meshnode.dataplane.client.SessionClient` (what a head uses), with
  :mod:`.answer_stream` (the tail's direct answers), :mod:`.unit_futures` (the caller's futures)
  and :mod:`.stream_io`;
- :mod:`.rpc` — the unary calls from the caller's side;
- :mod:`.wake_timer` — the machines' timer, on :mod:`meshnode.timer_edge`.
"""

"""The one sans-IO convention of meshnode's protocol state machines.

It holds for the data plane's :class:`~meshnode.dataplane.worker.ShardWorker` and
:class:`~meshnode.dataplane.client.SessionClient`, the relay's
:class:`~relay.core.RelayCore`, the relay link's
:class:`~meshnode.relaylink.mux.ChannelMux` and
:class:`~meshnode.relaylink.seal.PeerSealer`, and the mesh's
:class:`~meshnode.mesh.state.MeshState`. It is aioquic's ``QuicConnection``
convention (``receive_datagram``, ``datagrams_to_send``, ``get_timer``/``handle_timer``,
``next_event``), so an edge that drives one machine can drive them all:

- **Inputs return nothing** (but for the one case below). What arrives from the peer is a ``receive_*`` call
  (``receive_frame``, ``receive_record``, ``receive_payload``); anything else that
  happened is a call named for it (``stream_closed``, ``batch_finished``,
  ``connection_made``); time passing is ``handle_timer(now_ns)``.
- **Outputs are drained, one way.** What a machine tells or asks its edge (a unit
  done, a frame to send, a step to run) waits inside it until the edge calls
  ``take_events()``, which returns everything since the last call, in order, as small
  frozen dataclasses. The edge drains after every input. Wire bytes that may leave
  only as fast as the edge's transport drains are the one exception: the edge pulls
  them when it has room (``SessionClient.requests_to_send(now_ns)``,
  ``RelayCore.next_frame(conn_id)``), as aioquic's ``datagrams_to_send(now)``, so a
  slow peer leaves them in the machine's bounded queues.
- **Commands return what they build.** A local command that makes a message or a
  name for its caller returns it (``SessionClient.start_stream()``'s frames,
  ``cancel_signal()``, ``ChannelMux.open_channel()``, ``PeerSealer.seal()``); a call
  that answers a question returns the answer (``ShardWorker.cancel()`` → how many
  units), and anything it caused is drained as above.
- **A request answered on its own stream returns the answer.** ``MeshState``'s
  ``receive_gossip`` and ``receive_gossip_reply`` are the two ends of one gossip
  request and its reply: the reply must go back on the stream the request came on,
  so they return it and what they admitted and merged (``GossipOutcome``,
  ``ReplyOutcome``), or raise the ``MeshRefusal`` the edge sends instead. What time
  passing causes there (``HeartbeatDue``, ``PeerStale``) is drained as above.
- **Time is monotonic nanoseconds, passed in.** Every call that needs the time takes
  ``now_ns: int`` (``time.monotonic_ns()`` at the edge), with no default; calls that do
  not need it do not take it. ``get_timer()`` is the absolute ``now_ns`` at which
  ``handle_timer`` next has work, or None; calling it early or late is harmless.
- **Wall-clock time only where a wall-clock instant is checked**, passed beside
  ``now_ns``, keyword-only and named for its unit: ``unix_now`` (float seconds) where
  a certificate, invite or membership proof's validity is verified or a signed peer
  record's incarnation is bounded, ``unix_now_ns`` where a wire deadline
  (``deadline_unix_nanos``) is read. A machine turns a wire deadline into its
  monotonic clock once, on arrival, and times liveness (a peer last heard, a
  tombstone) on ``now_ns`` alone, so stepping the wall clock moves neither a lease
  nor a timer already set, and makes no peer stale.
"""

from __future__ import annotations

SECOND_NS = 1_000_000_000

__all__ = ["SECOND_NS"]

"""The mesh-llm/1 control plane: decision rules (``rules``), validators
(``validation``), signed peer records (``signed_record``) and opening a frame's
records (``gossip_records``), the peer table (``peer_table``), the membership
state machine (``state``) and the stream dispatcher (``dispatcher``). Everything
but the dispatcher is pure and synchronous. Its refusals are
:mod:`meshnode.wire.mesh_refusal`."""

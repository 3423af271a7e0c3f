"""Sans-IO wire pieces: framing, tensor bundle codec, chunk planning, flow control,
and the refusals that travel on the wire (``errors``, ``mesh_refusal``)."""

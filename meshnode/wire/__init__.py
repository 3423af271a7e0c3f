"""Sans-IO wire pieces: framing, tensor bundle codec, chunk planning, flow control."""

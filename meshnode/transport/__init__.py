"""Byte streams to authenticated peers: the abstraction (``base``), framing over it
(``framed``), QUIC links (``quic``, ``quic_connection``) and an in-process loopback
pair (``loopback``). See :mod:`meshnode.transport.base` for the contract."""

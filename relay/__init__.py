"""The meshnode relay: forwards sealed frames between mesh members that cannot dial each other.

``relay.protocol`` and ``relay.ratelimit`` are shared with the node's relay
client (``meshnode.relaylink``); ``relay.core`` is the relay's sans-IO state
machine and ``relay.server`` its QUIC edge.
"""

"""The relay wire protocol, shared by the relay server (``relay``) and the node's
relay client (``meshnode.relaylink``): frames, codes and limits (``protocol``) and
the token buckets both ends pace frames with (``ratelimit``).

It sits below both users so each depends downward on it and neither on the
other; it needs only wire, identity and one membership limit (the invite token
size that bounds a registration frame).
"""

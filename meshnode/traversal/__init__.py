"""Direct links between members behind NAT: hole punching through the relay, the LAN shortcut,
and keeping the direct path only while it works.

The rules are pure (:mod:`.nat_mapping`, :mod:`.candidates`, :mod:`.pair_backoff`,
:mod:`.punch_messages`); :mod:`.puncher` runs one attempt over a relayed link and
:mod:`.direct_paths` decides when, watches the direct links it made, and reports what happened.
"""

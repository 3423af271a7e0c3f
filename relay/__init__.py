"""The meshnode relay server: forwards sealed frames between mesh members that cannot dial each other.

``relay.core`` is the relay's sans-IO state machine, ``relay.fair_queue`` the
queue that shares one destination fairly among its senders, ``relay.server``
the QUIC edge, ``relay.metrics`` its Prometheus endpoint (``--metrics-listen``),
``relay.status`` its answer to ``meshnode status``, and ``relay.command`` the
program that composes them (``python -m relay``, ``meshnode relay``). The wire
protocol and rate limiter it shares with the node's relay client live below
both, in ``meshnode.relaywire``.

Why a top-level package and not ``meshnode.relay``: the relay is a program of
its own, run apart from any node (``python -m relay``, the ``meshnode-relay``
unit, the compose file's relay service), and the product card fixes the top
level with ``relay/`` as the relay server. Being outside ``meshnode`` also makes
its one rule a package boundary: the relay depends only on meshnode's lower
layers (wire, transport, identity, membership's proof check,
``meshnode.relaywire``, and for its command line ``meshnode.commandline`` and
``meshnode.statussocket``), never on relaylink, node, head, api or app, its
entry point included. Only the app layer imports it (``meshnode relay`` is
``relay.command`` registered among the app's subcommands).
"""

"""The mesh package sits below the relay links, the data plane and the node runtime: the link it
keeps per peer and how it dials one reach the QUIC endpoint and the relay links through small
protocols, not imports. Function-local imports count, as in ``test_app_layer``."""

from ops.test_app_layer import importers_of

ABOVE_MESH = ("meshnode.dataplane", "meshnode.relaylink", "meshnode.node", "meshnode.head", "meshnode.api")


def test_mesh_imports_nothing_above_it():
    upward = [(above, path) for above in ABOVE_MESH for path in importers_of(above, ["meshnode/mesh"])]
    assert upward == []


def test_the_request_reply_exchange_sits_in_the_transport_below_mesh():
    assert importers_of("meshnode.mesh", ["meshnode/transport", "meshnode/wire"]) == []

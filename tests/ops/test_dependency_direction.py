"""Dependencies between the relay server and meshnode run one way: the relay server uses only
meshnode's lower layers, nothing in meshnode below the app layer uses the relay server, and
membership sits below mesh (the refusals both raise are wire vocabulary). Function-local
imports count, as in ``test_app_layer``."""

from ops.test_app_layer import ROOT, imported_modules, importers_of

# What the relay server may import from meshnode: the vocabulary it shares with the nodes, the
# sans-IO convention, and the QUIC transport it serves on. Not relaylink, node, head, api or app.
RELAY_SERVER_MAY_IMPORT = (
    "meshnode.sansio",
    "meshnode.gen",
    "meshnode.identity",
    "meshnode.wire",
    "meshnode.transport",
    "meshnode.membership",
    "meshnode.mesh",
    "meshnode.relaywire",
)
# ``python -m relay`` is an entry point into the app layer (test_app_layer pins that).
RELAY_ENTRY_POINT = "relay/__main__.py"


def is_within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_meshnode_below_the_app_layer_does_not_import_the_relay_server():
    importers = importers_of("relay", ["meshnode"])
    assert [path for path in importers if not path.startswith("meshnode/app/")] == []


def test_the_relay_server_imports_only_meshnodes_lower_layers():
    upward = [
        (path.relative_to(ROOT).as_posix(), name)
        for path in sorted((ROOT / "relay").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != RELAY_ENTRY_POINT
        for name in sorted(imported_modules(path))
        if is_within(name, ("meshnode",)) and not is_within(name, RELAY_SERVER_MAY_IMPORT)
    ]
    assert upward == []


def test_membership_does_not_import_mesh():
    assert importers_of("meshnode.mesh", ["meshnode/membership"]) == []

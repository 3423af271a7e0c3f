"""The console's HTTP side: the page's static files and the mesh view it polls.

:func:`add_console_routes` adds, to the API's application:

- ``GET /console``: the page (``static/index.html``), and ``GET /console/<file>`` its
  script and style sheet. They are package data, read from the installed package,
  with nothing fetched from elsewhere, so the console works on an air-gapped mesh.
- ``GET /meshnode/mesh``: :func:`meshnode.console.mesh_view.mesh_view` of this node's
  status report, as JSON.
- ``GET /``: a redirect to ``/console``, where a person opening the API's address lands.

The page sends ``Authorization: Bearer KEY`` (a key it keeps in the browser's
localStorage) with every request, so it keeps working when the API needs a key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web

from meshnode.console.mesh_view import Throughput, mesh_view
from meshnode.wire.pb import mesh

CONSOLE_PATH = "/console"
MESH_PATH = "/meshnode/mesh"
# The page's files and their content types: nothing else under /console is served.
STATIC_FILES = {
    "index.html": "text/html",
    "console.js": "text/javascript",
    "console.css": "text/css",
}


def static_file(name: str) -> bytes:
    """A console file's bytes, from the installed package."""
    return resources.files("meshnode.console").joinpath("static", name).read_bytes()


def standalone_status(served: mesh.ServedShard) -> dict[str, Any]:
    """A status report for ``meshnode serve``: one process, no mesh, serving every layer."""
    return {
        "node": {
            "id": "",
            "short_id": "standalone",
            "mesh_id": "",
            "member": False,
            "addresses": [],
            "directly_reachable": True,
            "relays": [],
            "serving": {
                "model": served.model_name,
                "model_digest": served.fingerprint.model_artifact_digest,
                "start_layer": served.shard_range.start_layer,
                "end_layer": served.shard_range.end_layer,
                "total_layers": served.total_layers,
                "numerics": served.numerics,
            },
        },
        "peers": [],
    }


def mesh_source(*, node: Any, driver: Any, server: Any, served: mesh.ServedShard) -> Callable[[], dict]:
    """What ``/meshnode/mesh`` serves, read afresh on each call.

    ``node``: the :class:`meshnode.node.Node` (``None`` for a standalone ``meshnode serve``);
    ``driver``: the head's :class:`~meshnode.head.driver.GenerationDriver`; ``server``: this
    node's :class:`~meshnode.dataplane.edges.server.ShardServer` (either may be ``None``)."""

    def read() -> dict[str, Any]:
        status = node.status().to_json() if node is not None else standalone_status(served)
        stats = driver.stats if driver is not None else None
        throughput = Throughput(
            at_s=round(time.monotonic(), 3),
            generated_tokens=stats.tokens if stats is not None else 0,
            active_generations=stats.active if stats is not None else 0,
            shard_tokens=server.worker.batch_stats.tokens if server is not None else 0,
        )
        return mesh_view(status, throughput)

    return read


def add_console_routes(app: web.Application, read_mesh: Callable[[], dict]) -> None:
    async def page(request: web.Request) -> web.Response:
        return _file_response("index.html")

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES:
            raise web.HTTPNotFound()
        return _file_response(name)

    async def mesh_json(request: web.Request) -> web.Response:
        return web.json_response(read_mesh(), headers={"Cache-Control": "no-store"})

    async def root(request: web.Request) -> web.Response:
        raise web.HTTPFound(CONSOLE_PATH)

    app.router.add_get(CONSOLE_PATH, page)
    app.router.add_get(CONSOLE_PATH + "/{name}", asset)
    app.router.add_get(MESH_PATH, mesh_json)
    app.router.add_get("/", root)


def _file_response(name: str) -> web.Response:
    return web.Response(
        body=static_file(name),
        content_type=STATIC_FILES[name],
        charset="utf-8",
        headers={"Cache-Control": "no-cache"},
    )


__all__ = [
    "CONSOLE_PATH",
    "MESH_PATH",
    "STATIC_FILES",
    "add_console_routes",
    "mesh_source",
    "standalone_status",
    "static_file",
]

"""How long a route may be, apart from the route itself (:mod:`meshnode.dataplane.route`, which
loads the engine contract and numpy) so that the command line reads it cheaply."""

from __future__ import annotations

# The most hops a route names: a longer one is refused.
MAX_ROUTE_HOPS = 64

__all__ = ["MAX_ROUTE_HOPS"]

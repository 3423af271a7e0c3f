"""How a planned route computes: its hops' numerics, as reports. Pure.

A route's hops share one hop contract (the fingerprint) but may compute it on
different backends, weight layouts or llama.cpp builds; each hop announces that
as its ``numerics``. Such a route is planned like any other. What this module
gives the head is the description of the mix: which layers ran under which
numerics (for logs and stats), and a short ``system_fingerprint`` that changes
exactly when the way the route computes may have changed, as OpenAI's field does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from meshnode.head.planner import Hop, Route
from meshnode.wire.pb import shard

# Shown for a hop whose node does not announce its numerics.
UNREPORTED = "unreported"
SYSTEM_FINGERPRINT_PREFIX = "fp_"
# Hex digits of the digest kept: short like OpenAI's, ample to tell configurations apart.
SYSTEM_FINGERPRINT_HEX = 12


@dataclass(frozen=True)
class NumericsRun:
    """Consecutive layers ``[start_layer, end_layer)`` computed under one numerics."""

    start_layer: int
    end_layer: int
    numerics: str

    def text(self) -> str:
        return f"[{self.start_layer},{self.end_layer}) {self.numerics or UNREPORTED}"


def numerics_runs(hops: Sequence[Hop]) -> tuple[NumericsRun, ...]:
    """The layers each numerics computed, adjacent hops with equal numerics merged.

    Merged because a float32 boundary makes a split bit-exact against the whole model:
    where a route is cut does not change its numbers, what computes each layer does."""
    runs: list[NumericsRun] = []
    for hop in hops:
        if runs and runs[-1].numerics == hop.numerics:
            runs[-1] = NumericsRun(runs[-1].start_layer, hop.end_layer, hop.numerics)
        else:
            runs.append(NumericsRun(hop.effective_start_layer, hop.end_layer, hop.numerics))
    return tuple(runs)


def mixes_numerics(route: Route) -> bool:
    return len({hop.numerics for hop in route.hops}) > 1


def describe_numerics(route: Route) -> str:
    """One line for logs: ``[0,3) llama-cpp-python 0.3.36; gpu; ... | [3,6) ...``."""
    return " | ".join(run.text() for run in numerics_runs(route.hops))


def system_fingerprint(route: Route, boundary_dtype: int = shard.DTYPE_FLOAT32) -> str:
    """A short digest of how the route computes: the contract, the boundary dtype and its
    numerics runs. Equal for any split of one configuration over a float32 boundary."""
    material: dict[str, object] = {
        "model": [route.model.model_artifact_digest, route.model.runtime_recipe_digest],
        "boundary": shard.DType.Name(boundary_dtype),
        "numerics": [[run.start_layer, run.end_layer, run.numerics] for run in numerics_runs(route.hops)],
    }
    if boundary_dtype != shard.DTYPE_FLOAT32:
        # A narrower boundary rounds the residual stream at every cut: the cuts change the numbers.
        material["cuts"] = [hop.end_layer for hop in route.hops[:-1]]
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return SYSTEM_FINGERPRINT_PREFIX + digest[:SYSTEM_FINGERPRINT_HEX]


__all__ = [
    "UNREPORTED",
    "NumericsRun",
    "describe_numerics",
    "mixes_numerics",
    "numerics_runs",
    "system_fingerprint",
]

"""A route's expected time per token: what its hops announce, summed. Pure.

A hop's share of a decode step is the decode time it announces for its range
(``ServedShard.speed``), scaled to the layers the route runs there, plus what reaching it
adds: the planner's fixed hop overhead and the round trip (:attr:`ShardCandidate.link_ms`).
The load penalty the planner adds to spread sessions over replicas is not time and stays
out. A hop that announces no speed leaves the route's figure unknown (None) rather than too
low: what acts on it (admission, :mod:`meshnode.api.request_fields`) acts only on a known
figure.

Prefill counts the hops whose prefill time is measured, the others as 0 (a calibration
times a decode step only): the prefill figure is an at-least one, so a route is never judged
slower than it is for want of a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from meshnode.head.planner import Route, ShardCandidate
from meshnode.identity import short_id


@dataclass(frozen=True)
class HopTime:
    node_id: bytes
    # The layers the route runs there: [effective start, end).
    start_layer: int
    end_layer: int
    # The announced decode time of those layers, ms per token; None when the hop announces none.
    decode_ms: float | None
    # The announced prefill time of one token through those layers, ms; 0 when not measured.
    prefill_ms: float
    # What reaching the hop adds to every step (ShardCandidate.link_ms).
    link_ms: float

    @property
    def step_ms(self) -> float | None:
        """The hop's share of a decode step: its compute and its link."""
        return None if self.decode_ms is None else self.decode_ms + self.link_ms

    def to_json(self, slow: bool = False) -> dict[str, Any]:
        return {
            "node": short_id(self.node_id),
            "layers": [self.start_layer, self.end_layer],
            "decode_ms": _ms(self.decode_ms),
            "link_ms": _ms(self.link_ms),
            "slow": slow,
        }


@dataclass(frozen=True)
class RouteTime:
    model_name: str
    hops: tuple[HopTime, ...]

    @property
    def decode_ms_per_token(self) -> float | None:
        """What a decode step of the route is expected to take, ms: every hop's compute and link;
        None while some hop announces no speed."""
        total = 0.0
        for hop in self.hops:
            step = hop.step_ms
            if step is None:
                return None
            total += step
        return total

    @property
    def prefill_ms_per_token(self) -> float:
        """What prefilling one prompt token through the route takes at least, ms."""
        return sum(hop.prefill_ms for hop in self.hops)

    @property
    def unannounced(self) -> tuple[bytes, ...]:
        """The hops that announce no speed (the route's figure is unknown while there are any)."""
        return tuple(hop.node_id for hop in self.hops if hop.decode_ms is None)

    def answer_ms(self, prompt_tokens: int, max_tokens: int) -> float | None:
        """The expected time of a whole answer: the prompt's prefill, then a decode step per token
        (the last prefill step yields the first token, and the figure counts one step more: it
        leaves out the prefill chunks' round trips). None while the decode figure is unknown."""
        step = self.decode_ms_per_token
        if step is None:
            return None
        return prompt_tokens * self.prefill_ms_per_token + max_tokens * step

    def tokens_within(self, budget_ms: float, prompt_tokens: int) -> int | None:
        """The most tokens an answer to a prompt of ``prompt_tokens`` is expected to reach within
        ``budget_ms`` (:meth:`answer_ms` inverted); None while the decode figure is unknown."""
        step = self.decode_ms_per_token
        if step is None:
            return None
        left = budget_ms - prompt_tokens * self.prefill_ms_per_token
        if left <= 0.0:
            return 0
        return math.floor(left / step) if step > 0.0 else None

    def to_json(self, slow: Collection[bytes] = frozenset()) -> dict[str, Any]:
        """The route as status shows it; ``slow``: the nodes whose stage slows every route through
        it (:mod:`meshnode.mesh.slow_stage`), marked on their hops."""
        step = self.decode_ms_per_token
        return {
            "model": self.model_name,
            "decode_ms_per_token": _ms(step),
            "tokens_per_s": round(1_000 / step, 2) if step else None,
            "prefill_ms_per_token": _ms(self.prefill_ms_per_token),
            "hops": [hop.to_json(hop.node_id in slow) for hop in self.hops],
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def route_time(route: Route, candidates: Iterable[ShardCandidate]) -> RouteTime:
    """The expected time of ``route`` from what ``candidates`` (the gossip it was planned from)
    announce of its hops. A hop missing from them counts as announcing no speed."""
    by_node = {c.node_id: c for c in candidates if c.model == route.model}
    hops = []
    for hop in route.hops:
        candidate = by_node.get(hop.node_id)
        layers = hop.end_layer - hop.effective_start_layer
        announced = candidate is not None and candidate.decode_ms_per_token > 0.0
        hops.append(
            HopTime(
                node_id=hop.node_id,
                start_layer=hop.effective_start_layer,
                end_layer=hop.end_layer,
                decode_ms=candidate.compute_ms(layers) if candidate is not None and announced else None,
                prefill_ms=candidate.prefill_ms(layers) if candidate is not None else 0.0,
                link_ms=candidate.link_ms if candidate is not None else 0.0,
            )
        )
    return RouteTime(route.model_name, tuple(hops))


__all__ = ["HopTime", "RouteTime", "route_time"]

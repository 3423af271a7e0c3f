"""A node's view of which stage slows every route through it: the asyncio edge of
:mod:`meshnode.mesh.slow_stage`, its log lines and its ``meshnode status`` section.

Every ``interval_s`` the node compares the speeds the serving nodes announce in their signed
records (its own included) and feeds them to a :class:`SlowStageWatch`. A verdict that changes
is logged: a warning when it is this node's own stage, since every route through it runs at its
pace. The section says this node's verdict and lists the stages found slow; the head shows the
same verdicts on the hops of its routes (:mod:`meshnode.app.head_service`).

A stage's work is priced in the weight bytes a decode step reads when this node's copy of the
model has every layer's tensors (:mod:`meshnode.autoplace.stage_balance`: the output projection
at the last stage), else in layers; :func:`range_work_of_file` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshnode.autoplace.stage_balance import StepCosts, step_costs
from meshnode.identity import short_id
from meshnode.mesh.slow_stage import (
    ModelKey,
    RangeWork,
    SlowStageWatch,
    SlowVerdict,
    layer_count,
    stage_figures,
)
from meshnode.sansio import SECOND_NS
from meshnode.wire.pb import mesh

if TYPE_CHECKING:
    from meshnode.node import Node

log = logging.getLogger(__name__)

SLOW_STAGE_SECTION = "slow_stages"
OBSERVE_INTERVAL_S = 5.0


def model_key(served: mesh.ServedShard) -> ModelKey:
    fingerprint = served.fingerprint
    return (fingerprint.model_artifact_digest, fingerprint.runtime_recipe_digest, served.total_layers)


def step_costs_of_file(path: Path) -> StepCosts | None:
    """The bytes each layer's decode step reads, from the GGUF at ``path``; None when the file
    lacks some layer's tensors (a slice of a range) or cannot be read."""
    from engines.gguf_file import GGUFFormatError, read_gguf
    from engines.gguf_info import model_info

    try:
        gguf = read_gguf(path)
        info = model_info(gguf)
    except (OSError, GGUFFormatError, ValueError):
        return None
    costs = step_costs(info.n_layers, {tensor.name: tensor.nbytes for tensor in gguf.tensors})
    return costs if all(costs.per_layer) else None


def range_work(costs: StepCosts) -> RangeWork:
    def work(model: ModelKey, start: int, end: int) -> float:
        return float(costs.stage((start, end)))

    return work


class SlowStageMonitor:
    def __init__(
        self,
        node: Node,
        watch: SlowStageWatch | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.node = node
        self.watch = watch or SlowStageWatch()
        # Monotonic ns: the verdicts' clock (a test's own).
        self._clock = clock
        # How the work of a model's ranges is priced, where better known than by layers.
        self._work: dict[ModelKey, RangeWork] = {}

    async def price_from_file(self, served: mesh.ServedShard, path: Path) -> None:
        """Price ``served``'s model by the bytes a decode step reads, if ``path`` holds every layer."""
        costs = await asyncio.to_thread(step_costs_of_file, path)
        if costs is not None and len(costs.per_layer) == served.total_layers:
            self._work[model_key(served)] = range_work(costs)

    def _work_of(self, model: ModelKey, start: int, end: int) -> float:
        return self._work.get(model, layer_count)(model, start, end)

    def observe(self, now_ns: int) -> list[SlowVerdict]:
        """Compare the mesh's stages as gossip has them now; log what changed."""
        pairs = [(entry.peer_id, entry.announcement) for entry in self.node.peers()]
        pairs.append((self.node.node_id, self.node.state.local))
        changed = self.watch.observe(now_ns, stage_figures(pairs, self._work_of))
        for verdict in changed:
            self._log(verdict)
        return changed

    def _log(self, verdict: SlowVerdict) -> None:
        lasting = self.watch.lasting_ns / SECOND_NS
        if verdict.node_id == self.node.node_id:
            if verdict.slow:
                log.warning(
                    "this node's stage has taken %.1fx the other stages' time for its layers for %.0f s: "
                    "every route through it runs at its pace (a faster replica of its layers would serve "
                    "them sooner)",
                    verdict.ratio,
                    lasting,
                )
            else:
                log.info(
                    "this node's stage keeps pace with the others again (%.1fx their time)", verdict.ratio
                )
            return
        state = "slows the routes through it" if verdict.slow else "keeps pace again"
        log.info("node %s %s (%.1fx the other stages' time)", short_id(verdict.node_id), state, verdict.ratio)

    def status(self) -> dict[str, Any]:
        """The ``slow_stages`` section: this node's verdict (None: its stage is not compared) and
        every stage found slow."""
        now_ns = self._clock()
        own = self.watch.verdict(self.node.node_id)
        slow = [self.watch.verdict(node_id) for node_id in sorted(self.watch.slow_nodes())]
        return {
            "this_node": None if own is None else own.to_json(now_ns),
            "slow": [verdict.to_json(now_ns) for verdict in slow if verdict is not None],
            "slow_ratio": self.watch.slow_ratio,
            "clear_ratio": self.watch.clear_ratio,
            "lasting_s": self.watch.lasting_ns / SECOND_NS,
        }

    async def _run(self, interval_s: float) -> None:
        while True:
            self.observe(self._clock())
            await asyncio.sleep(interval_s)

    @contextlib.asynccontextmanager
    async def watching(self, interval_s: float = OBSERVE_INTERVAL_S) -> AsyncIterator[SlowStageMonitor]:
        """Observe every ``interval_s`` while the block runs, shown in ``meshnode status``."""
        task = asyncio.ensure_future(self._run(interval_s))
        self.node.add_status_section(SLOW_STAGE_SECTION, self.status)
        try:
            yield self
        finally:
            self.node.remove_status_section(SLOW_STAGE_SECTION)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


__all__ = [
    "OBSERVE_INTERVAL_S",
    "SLOW_STAGE_SECTION",
    "SlowStageMonitor",
    "model_key",
    "range_work",
    "step_costs_of_file",
]

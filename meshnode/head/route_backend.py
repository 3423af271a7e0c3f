"""The HTTP API's :class:`~meshnode.head.backend.GenerationBackend` over the generation driver.

A node answers for the models it holds a GGUF of (the tokenizer and chat
template come from the file, never from a peer) and lists those a complete
route currently covers. A model is matched to what gossip offers by its
artifact digest, so peers may name their copy of the file differently; when
several runtime recipes serve it, the first one with a complete route wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.interface import SamplingParams
from engines.sampling import with_prompt_history
from meshnode.head.backend import GenerationFailed, PromptTokenizer, TokenStream, UnknownModel
from meshnode.head.candidates import identities_for_artifact
from meshnode.head.coverage import ModelCoverage, layer_coverage
from meshnode.head.driver import GenerationDriver
from meshnode.head.planner import ModelIdentity, NoRouteError, plan_route
from meshnode.head.route_time import RouteTime, route_time


@dataclass(frozen=True)
class LocalModel:
    name: str
    artifact_digest: str
    tokenizer: PromptTokenizer


class RouteBackend:
    def __init__(self, driver: GenerationDriver, models: Sequence[LocalModel]) -> None:
        self.driver = driver
        self.models = list(models)
        # Set while the node shuts down: new generations are refused (503), running ones finish.
        self.draining = False

    def model_names(self) -> list[str]:
        return [model.name for model in self.models if self._routable(model) is not None]

    def tokenizer(self, model: str) -> PromptTokenizer:
        return self._local(model).tokenizer

    def generate(
        self, model: str, prompt_tokens: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> TokenStream:
        local = self._local(model)
        if self.draining:
            raise GenerationFailed("this node is draining (shutting down); send the request to another node")
        identity = self._routable(local)
        if identity is None:
            raise GenerationFailed(self._why_not_routable(local))
        # The tail's penalties count the prompt too; only the head knows it.
        sampling = with_prompt_history(sampling, prompt_tokens)
        return self.driver.generate(identity, prompt_tokens, sampling, max_tokens)

    def context_tokens(self, model: str) -> int | None:
        """Tokens one session holds on the route a request for ``model`` would take now (its
        smallest hop's context); None when no route is complete or no hop says."""
        identity = self._routable(self._local(model))
        if identity is None:
            return None
        candidates = self.driver.env.candidates()
        route = plan_route(candidates, identity)
        on_route = set(route.node_ids)
        contexts = [
            c.max_context_tokens
            for c in candidates
            if c.node_id in on_route and c.model == identity and c.max_context_tokens > 0
        ]
        return min(contexts) if contexts else None

    def route_time(self, model: str) -> RouteTime | None:
        """What the route a request for ``model`` would take now is expected to take (the
        driver's own choice: around hops found dead, and full ones while others have room);
        None when no route is complete."""
        return self._route_time(self._local(model))

    def route_times(self) -> list[RouteTime]:
        """:meth:`route_time` of every model this node answers for that has a complete route."""
        found = (self._route_time(model) for model in self.models)
        return [time for time in found if time is not None]

    def _route_time(self, model: LocalModel) -> RouteTime | None:
        identity = self._routable(model)
        if identity is None:
            return None
        try:
            route = self.driver.plan(identity, set())
        except NoRouteError:
            return None
        return route_time(route, self.driver.env.candidates())

    def model_coverage(self, model: str) -> ModelCoverage | None:
        """The layers of the route a request for ``model`` would take (else of the first way it
        is served), with how many shards serve each span; None when no shard serves it."""
        local = self._local(model)
        candidates = self.driver.env.candidates()
        identity = self._routable(local)
        if identity is None:
            identities = identities_for_artifact(candidates, local.artifact_digest)
            if not identities:
                return None
            identity = identities[0]
        return layer_coverage(candidates, identity)

    def not_ready_reason(self) -> str | None:
        """Why this node cannot answer a generation now (draining, no complete route), or None."""
        if self.draining:
            return "draining: this node is shutting down"
        if not self.models:
            return "this node holds no model to answer for"
        if self.model_names():
            return None
        return "; ".join(self._why_not_routable(model) for model in self.models)

    def _local(self, requested: str) -> LocalModel:
        for model in self.models:
            if requested in (model.name, model.artifact_digest):
                return model
        raise UnknownModel(requested, [model.name for model in self.models])

    def _routable(self, model: LocalModel) -> ModelIdentity | None:
        candidates = self.driver.env.candidates()
        for identity in identities_for_artifact(candidates, model.artifact_digest):
            try:
                plan_route(candidates, identity)
            except NoRouteError:
                continue
            return identity
        return None

    def _why_not_routable(self, model: LocalModel) -> str:
        candidates = self.driver.env.candidates()
        identities = identities_for_artifact(candidates, model.artifact_digest)
        if not identities:
            return f"no node of the mesh serves {model.name} yet"
        try:
            plan_route(candidates, identities[0])
        except NoRouteError as exc:
            return f"{model.name}: {exc}"
        return f"{model.name}: no complete route"


__all__ = ["LocalModel", "RouteBackend"]

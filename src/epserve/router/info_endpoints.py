"""The router's endpoints that describe it rather than generate: the model list and card, ``/version``,
``/health`` and SageMaker's ``/ping`` (as vLLM serves it), ``/metrics`` and ``/expert_load``."""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from epserve.router.errors import not_found_model
from epserve.router.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from epserve.router.instances import Router
    from epserve.router.metrics import RouterMetrics


class InfoEndpoints:
    """The describing endpoints of :class:`~epserve.router.app.OpenAIServer` (which sets these fields)."""

    router: Router
    model_name: str
    created: int
    metrics: RouterMetrics

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model_card(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{model}``: the served model's card; 404 for any other id."""
        if model_id != self.model_name:
            raise not_found_model(model_id)
        return self._card()

    def _card(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created,
                                "owned_by": "epserve", "root": self.model_name}
        info = self.router.info
        if info is not None:
            card.update(max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        return card

    async def version(self) -> dict[str, str]:
        """The installed package's version (its metadata: the package root would reach the engine)."""
        return {"version": importlib.metadata.version("epserve")}

    async def health(self) -> JSONResponse:
        """Whether the router can serve, and how many of its engine instances can (not where they are)."""
        num_healthy, serving = len(self.router.healthy), self.router.serving
        body = {"status": "ok" if serving else "unavailable", "num_engines": len(self.router.instances),
                "num_healthy_engines": num_healthy}
        return JSONResponse(body, status_code=200 if serving else 503)

    async def ping(self) -> Response:
        """SageMaker's health check (``GET`` or ``POST /ping``): 200 with an empty body while the router
        can serve, else 503, as ``/health``."""
        return Response(status_code=200 if self.router.serving else 503)

    async def metrics_endpoint(self) -> Response:
        await self.router.refresh()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def expert_load(self) -> dict[str, Any]:
        """Each engine world's expert load since start-up (``epserve plan --expert-load`` reads it)."""
        return {"instances": [load.summary() for load in await self.router.expert_loads()]}


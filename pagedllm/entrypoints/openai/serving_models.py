"""The served model: its card (``GET /v1/models``, ``GET /v1/models/{id}``) and the check
of a request's ``model`` field."""
from __future__ import annotations

import time

from fastapi.responses import JSONResponse

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import error_response


class OpenAIServingModels:
    """The model card (``created``: this object's creation, fixed as vLLM's; ``root``: the
    served name, never a local path) and the ``model`` check, for ``engine``."""

    def __init__(self, engine: AsyncLLM):
        self.engine = engine
        self.created = int(time.time())

    def model_card(self) -> dict:
        e = self.engine
        return {"id": e.model_name, "object": "model", "created": self.created, "owned_by": "pagedllm",
                "root": e.model_name, "parent": None, "max_model_len": e.max_model_len}

    def show_available_models(self) -> dict:
        """The body of ``GET /v1/models``."""
        return {"object": "list", "data": [self.model_card()]}

    def retrieve_model(self, model_id: str) -> dict | JSONResponse:
        """The body of ``GET /v1/models/{model_id}``, or a 404 for another id."""
        if model_id != self.engine.model_name:
            return self.model_not_found(model_id)
        return self.model_card()

    @staticmethod
    def model_not_found(name: str) -> JSONResponse:
        return error_response(f"The model `{name}` does not exist.", "model", 404, "NotFoundError")

    def check_model(self, name: str | None) -> JSONResponse | None:
        """None when ``model`` is absent or names this model (served name or path); else a 404."""
        if name not in (None, "", self.engine.model_name, self.engine.model_path):
            return self.model_not_found(name)
        return None

"""/v1/models: the models this deployment serves (``service.served_models``), in OpenAI's Model
shape, plus boxcar's ``aliases`` (other names a request may use) and ``num_workers``."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from api.deps import ContextDep, TenantDep
from api.errors import ApiError
from service.objects import unix
from service.served_models import ModelEntry, ModelNotServed, resolve, served_models

router = APIRouter(tags=["models"])

OWNED_BY = "boxcar"


def model_object(entry: ModelEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "object": "model",
        # When a worker first announced it; a configured model no worker has loaded yet has
        # no such time and shows the present one (as vLLM does for every model).
        "created": unix(entry.created) if entry.created is not None else int(time.time()),
        "owned_by": OWNED_BY,
        "aliases": list(entry.aliases),
        "num_workers": entry.num_workers,
        # a LoRA adapter's base model (vLLM's field); None for a base model
        "parent": entry.parent,
        # "generation" or "embedding" once a worker has announced it (None before).
        "kind": entry.kind,
    }


@router.get("/v1/models")
def list_models(tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.read_session() as session:
        entries = served_models(session, ctx.settings)
    return {"object": "list", "data": [model_object(entry) for entry in entries]}


@router.get("/v1/models/{model:path}")
def retrieve_model(model: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    """By id or alias (the object carries the id)."""
    with ctx.db.read_session() as session:
        entries = served_models(session, ctx.settings)
    try:
        return model_object(resolve(entries, model))
    except ModelNotServed as exc:
        raise ApiError(404, str(exc), param="model", code="model_not_found") from exc

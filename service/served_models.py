"""Which models the deployment serves, and which of them a request names.

A worker loads one model. Its id is ``served_model_name`` or the last part of its ``model``
setting (a cached name, a folder, a ``.gguf`` file without the suffix); its aliases are the
other names it answers to (the cached name, the GGUF file's stem). Workers announce their model
in the ``models`` table when they start (its aliases, its kind, when it was first seen).

When a model was last seen is the latest of two times, so that no row is written by every
worker every few seconds (32 workers queued on the one ``models`` row of their model): its
workers' own heartbeats (``workers.model``, ``workers.heartbeat_at``, each worker's row written
only by that worker), and the row's ``last_seen_at``, which a worker's announcement (once a
minute) refreshes only when it is older than ``SEEN_REFRESH_FRACTION`` of ``model_ttl``, and a
worker's clean stop sets (its heartbeat row goes with it). So a model is seen until its last
worker's last heartbeat, or its stop, whether that worker's row is still there or not.

A model is of one kind (``KINDS``): it generates (chat and completions lines), it embeds
(embeddings lines, and rerank and score lines by cosine) or it is a cross-encoder (rerank and
score lines only). Workers announce the kind with the model; a batch or job whose endpoint the
model cannot serve is refused at create (``check_endpoint``). A configured model no worker has
announced yet has no kind, and is not refused (its worker fails such lines instead).

"Served" is the union of two sets, so that a batch is never refused because workers are
restarting (a clean stop, a crash, a rolling upgrade, a node that takes minutes to load):
- the deployment's configured models (``BOXCAR_MODELS``; unset, the one ``BOXCAR_MODEL``), which
  are served even before any worker has started; the first is the default for requests that
  name no model;
- every model a worker announced, heartbeat or stopped within ``model_ttl`` seconds (default
  one hour).
Work accepted for a served model with no live worker waits in that model's queue until one
starts (or its completion window ends); it never runs on another model.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from openai_format.types import EMBEDDINGS_URL, GENERATION_ENDPOINTS, SCORING_ENDPOINTS
from service.db import utcnow
from service.liveness import is_live
from service.models import ServedModel, WorkerStatus
from service.settings import Settings

# A model's row is refreshed by its workers' announcements once older than this fraction of
# model_ttl (six minutes at the default hour): one write by one worker, not one per worker per
# minute; between refreshes its workers' heartbeats say it is seen.
SEEN_REFRESH_FRACTION = 0.1

GENERATION = "generation"
EMBEDDING = "embedding"
CROSS_ENCODER = "cross_encoder"
KINDS = (GENERATION, EMBEDDING, CROSS_ENCODER)
# The endpoints each kind serves.
KIND_ENDPOINTS = {
    GENERATION: GENERATION_ENDPOINTS,
    EMBEDDING: (EMBEDDINGS_URL, *SCORING_ENDPOINTS),
    CROSS_ENCODER: SCORING_ENDPOINTS,
}


def model_id(model: str, served_model_name: str | None = None) -> str:
    """The id a model setting (a cached name, a folder or a .gguf path) is served under."""
    if served_model_name:
        return served_model_name
    name = os.path.basename(model.rstrip("/")) or model
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def setting_aliases(model: str, served_model_name: str | None = None) -> list[str]:
    """The names a model setting answers to besides its id: the setting's own last part (the
    cached name, or the file name) when the id differs from it."""
    name = os.path.basename(model.rstrip("/")) or model
    names = [model_id(model), name]
    own = model_id(model, served_model_name)
    return [n for n in dict.fromkeys(names) if n and n != own]


@dataclass(frozen=True)
class ModelEntry:
    """One served model as /v1/models shows it."""

    id: str
    aliases: tuple[str, ...]
    created: dt.datetime | None  # first announced by a worker; None: configured, never seen
    num_workers: int  # live workers loading it now
    configured: bool
    # A LoRA adapter's base model (its id); None for a base model. An adapter's work goes to
    # its parent's queue: any worker serving the parent loads the adapter.
    parent: str | None = None
    kind: str | None = None  # KINDS (an adapter: its parent's); None: no worker has said yet

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)


def announce(session: Session, *, model: str, aliases: list[str], model_ttl: float,
             kind: str | None = None, now: dt.datetime | None = None) -> None:
    """A worker says it serves ``model`` and what kind of model it is: insert the row, or merge
    aliases and kind into it. Its ``last_seen_at`` is written only when it is older than
    ``SEEN_REFRESH_FRACTION`` of ``model_ttl`` (the worker's heartbeat says the rest), so
    nothing is written at all when nothing changed."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    now = now or utcnow()
    row = session.get(ServedModel, model)
    if row is None:
        session.add(ServedModel(id=model, aliases=sorted(set(aliases)), kind=kind,
                                created_at=now, last_seen_at=now))
        return
    merged = sorted(set(row.aliases or []) | set(aliases))
    if merged != (row.aliases or []):
        row.aliases = merged
    if kind is not None and row.kind != kind:
        row.kind = kind
    due = now - dt.timedelta(seconds=SEEN_REFRESH_FRACTION * model_ttl)
    if row.last_seen_at < due:
        # Conditional: of a fleet that starts at once and finds the row due, one writes it;
        # the others' statements find it fresh once that one commits.
        session.execute(update(ServedModel)
                        .where(ServedModel.id == model, ServedModel.last_seen_at < due)
                        .values(last_seen_at=now).execution_options(synchronize_session=False))


def worker_stopped(session: Session, *, model: str, now: dt.datetime | None = None) -> None:
    """A worker of ``model`` stops (its heartbeat row is deleted): the model was seen now."""
    now = now or utcnow()
    session.execute(update(ServedModel)
                    .where(ServedModel.id == model, ServedModel.last_seen_at < now)
                    .values(last_seen_at=now).execution_options(synchronize_session=False))


class WrongModelKind(Exception):
    """A request's endpoint is not one its model serves (chat to an embedding model, ...)."""


def check_endpoint(entry: ModelEntry, endpoint: str) -> None:
    """Raise ``WrongModelKind`` when ``entry`` is known not to serve ``endpoint``."""
    if entry.kind is None or endpoint in KIND_ENDPOINTS.get(entry.kind, (endpoint,)):
        return
    served = ", ".join(KIND_ENDPOINTS[entry.kind])
    if entry.kind == GENERATION:
        to = ("an embedding model" if endpoint == EMBEDDINGS_URL
              else "a cross-encoder or an embedding model")
        raise WrongModelKind(f"The model {entry.id!r} generates text: it does not serve "
                             f"{endpoint}; name {to}.")
    what = "an embedding model" if entry.kind == EMBEDDING else "a cross-encoder"
    raise WrongModelKind(f"The model {entry.id!r} is {what}: it serves {served} only, not "
                         f"{endpoint}.")


def default_model(settings: Settings) -> str:
    """The model of a request that names none: the first configured model."""
    if settings.models:
        return model_id(settings.models[0])
    return model_id(settings.model, settings.served_model_name)


def configured_adapters(settings: Settings) -> dict[str, str]:
    """The LoRA adapters the workers register (``lora_modules`` of ``BOXCAR_ENGINE_OPTIONS``,
    ``NAME=PATH`` each): adapter id -> the id of the base model they are served on."""
    parent = model_id(settings.model, settings.served_model_name)
    adapters: dict[str, str] = {}
    for entry in settings.engine_options.get("lora_modules") or ():
        name = str(entry).partition("=")[0].strip()
        if name:
            adapters[name] = parent
    return adapters


def queue_model(settings: Settings, model: str) -> str:
    """The model whose workers run work on ``model``: an adapter's parent, else itself."""
    return configured_adapters(settings).get(model, model)


def configured_models(settings: Settings) -> dict[str, list[str]]:
    """The deployment's configured models: id -> aliases."""
    if settings.models:
        return {model_id(m): setting_aliases(m) for m in settings.models}
    return {model_id(settings.model, settings.served_model_name):
            setting_aliases(settings.model, settings.served_model_name)}


def served_models(session: Session, settings: Settings,
                  *, now: dt.datetime | None = None) -> list[ModelEntry]:
    """Every served model (see the module's docstring), configured ones first, then by id."""
    now = now or utcnow()
    seen_since = now - dt.timedelta(seconds=settings.model_ttl)
    # Seen: its row says so, or a worker's heartbeat does (off the heartbeat index: a row per
    # worker, however many lines or batches there are).
    beating = (select(WorkerStatus.model)
               .where(WorkerStatus.heartbeat_at >= seen_since, WorkerStatus.model.is_not(None))
               .distinct())
    announced = {row.id: row for row in session.scalars(
        select(ServedModel).where(or_(ServedModel.last_seen_at >= seen_since,
                                      ServedModel.id.in_(beating))))}
    configured = configured_models(settings)
    # Configured ids are looked up too: their first-seen time and workers' aliases.
    for row in session.scalars(select(ServedModel).where(ServedModel.id.in_(list(configured)))):
        announced.setdefault(row.id, row)
    live = dict(session.execute(
        select(WorkerStatus.model, func.count())
        .where(is_live(settings.worker_metrics_interval, now=now),
               WorkerStatus.model.is_not(None))
        .group_by(WorkerStatus.model)).all())
    entries = []
    for model in [*configured, *sorted(set(announced) - set(configured))]:
        row = announced.get(model)
        aliases = [*configured.get(model, []), *((row.aliases or []) if row else [])]
        entries.append(ModelEntry(
            id=model, aliases=tuple(a for a in dict.fromkeys(aliases) if a != model),
            created=row.created_at if row else None, num_workers=int(live.get(model, 0)),
            configured=model in configured, kind=row.kind if row else None))
    by_id = {entry.id: entry for entry in entries}
    for adapter, parent in configured_adapters(settings).items():
        if adapter not in by_id:
            base = by_id.get(parent)
            entries.append(ModelEntry(id=adapter, aliases=(), created=None,
                                      num_workers=base.num_workers if base else 0,
                                      configured=True, parent=parent,
                                      kind=base.kind if base else None))
    return entries


class ModelNotServed(Exception):
    """A request names a model no worker serves (or a name two models answer to)."""

    def __init__(self, name: str, served: list[ModelEntry], *, ambiguous: list[str] | None = None):
        self.name = name
        self.served_ids = [m.id for m in served]
        if ambiguous:
            message = (f"The model name {name!r} is ambiguous: it is an alias of "
                       f"{', '.join(ambiguous)}; name one of them by its id.")
        else:
            message = (f"The model {name!r} is not served by this deployment; served models: "
                       f"{', '.join(self.served_ids) or '(none)'}.")
        super().__init__(message)


def resolve(served: list[ModelEntry], name: str) -> ModelEntry:
    """The served model ``name`` names: by id first, then by a unique alias."""
    for entry in served:
        if entry.id == name:
            return entry
    matches = [entry for entry in served if name in entry.aliases]
    if len(matches) == 1:
        return matches[0]
    raise ModelNotServed(name, served, ambiguous=[m.id for m in matches] if matches else None)


def resolve_request_model(session: Session, settings: Settings, name: str | None) -> ModelEntry:
    """The served model a batch or job runs on: the one its requests name, else the default."""
    return resolve(served_models(session, settings), name or default_model(settings))

"""Strict checks of what boxcar writes against OpenAI's types: the ``openai`` package's pydantic
models (Batch, FileObject, ChatCompletion, Completion, Response), validated in strict mode with
no field they do not declare, and the batch output/error file line, which the package has no
type for (OpenAI's documented shape: ``BatchRequestOutput`` below)."""

from __future__ import annotations

from typing import Any, Literal

from openai.types import Batch, Completion, FileObject
from openai.types.chat import ChatCompletion
from openai.types.responses import Response as ResponseObject
from pydantic import BaseModel, ConfigDict

# Fields boxcar adds to the objects OpenAI defines (docs/openai-compatibility.md).
BOXCAR_EXTRAS = {
    Batch: {"priority", "prefix_cache_hit_rate", "estimated_completion_at", "deadline_at_risk"},
    FileObject: {"line_count", "error_count", "line_errors"},
}


def _no_extras(model: BaseModel, allowed: set[str], where: str) -> None:
    extra = set(model.model_extra or {}) - allowed
    assert not extra, f"{where}: fields OpenAI's type does not have: {sorted(extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, BaseModel):
                _no_extras(item, set(), f"{where}.{name}")


def strict(model_type: type[BaseModel], data: dict[str, Any]) -> Any:
    """``data`` validated strictly as ``model_type``, with no undeclared fields."""
    model = model_type.model_validate(data, strict=True)
    _no_extras(model, BOXCAR_EXTRAS.get(model_type, set()), model_type.__name__)
    return model


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorObject(_Closed):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Closed):
    error: ErrorObject


class Response(_Closed):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineErrorObject(_Closed):
    code: str
    message: str


class BatchRequestOutput(_Closed):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: Response | None
    error: LineErrorObject | None


def check_line(line: dict[str, Any], endpoint: str | None = None) -> BatchRequestOutput:
    """A line of an output or error file, strictly: a 200 holds a ChatCompletion, Completion or
    Response (as the endpoint says, or by its ``object``), a 4xx/5xx holds ``{error: {...}}``,
    a line that never ran has ``error`` and no response."""
    parsed = BatchRequestOutput.model_validate(line)
    assert parsed.id.startswith("batch_req_")
    if parsed.response is None:
        assert parsed.error is not None
        return parsed
    assert parsed.error is None
    assert parsed.response.request_id
    body = parsed.response.body
    if parsed.response.status_code == 200:
        kind = endpoint or _ENDPOINT_OF.get(body.get("object"), "/v1/completions")
        strict(_TYPE_OF[kind], body)
    else:
        assert parsed.response.status_code in (400, 500)
        ErrorBody.model_validate(body)
    return parsed


_ENDPOINT_OF = {"chat.completion": "/v1/chat/completions", "response": "/v1/responses"}
_TYPE_OF: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletion,
                                        "/v1/completions": Completion,
                                        "/v1/responses": ResponseObject}


def error_of(line: dict[str, Any]) -> dict[str, Any]:
    """{code, message} of an error-file line, whichever of OpenAI's two shapes it has."""
    check_line(line)
    if line["response"] is None:
        return line["error"]
    return line["response"]["body"]["error"]


Kind = Literal["chat", "completion"]

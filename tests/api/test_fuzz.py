"""schemathesis against the OpenAPI schema of the running API (uvicorn on loopback, SQLite and
a local folder): every operation, with generated valid and invalid parameters and bodies, must
answer without a server error (5xx), and every error must be in OpenAI's error shape."""

from __future__ import annotations

import shutil
import tempfile

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from api.app import build_context, create_app
from service.settings import Settings
from tests.api.conftest import RecordingQueue
from tests.conftest_services import make_key, migrated, serve_app
from tests.figures import record

COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def live_api(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    app_settings = Settings(database_url=f"sqlite:///{root / 'boxcar.db'}",
                            storage_url=str(root / "storage"), max_file_bytes=256 * 1024,
                            max_file_lines=100)
    ctx = build_context(app_settings, db=migrated(app_settings.database_url),
                        queue=RecordingQueue())
    key = make_key(ctx.db, "fuzz")
    with serve_app(create_app(context=ctx)) as base_url:
        yield base_url, key
    ctx.db.dispose()
    total = sum(COUNTS.values())
    if total:
        record("Fuzzing: schemathesis on the live API's OpenAPI schema",
               requests=total, **{f"http_{k}": v for k, v in sorted(COUNTS.items())},
               server_errors=sum(v for k, v in COUNTS.items() if k.startswith("5")))


def _schema():
    """The schema the live API serves at /openapi.json (the same app, built here at collection:
    schemathesis's lazy fixture loading does not work with this pytest)."""
    root = tempfile.mkdtemp(prefix="boxcar-fuzz-schema-")
    try:
        app = create_app(Settings(database_url=f"sqlite:///{root}/schema.db", storage_url=root))
        return schemathesis.openapi.from_dict(app.openapi())
    finally:
        shutil.rmtree(root, ignore_errors=True)


schema = _schema()


def test_the_schema_is_the_served_one(live_api):
    base_url, _ = live_api
    assert httpx.get(f"{base_url}/openapi.json").json() == schema.raw_schema


def _error_shape(ctx, response, case) -> bool | None:
    """A 4xx answer is OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""
    COUNTS[str(response.status_code)] = COUNTS.get(str(response.status_code), 0) + 1
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"], body
    return None


def _run(case, live_api) -> None:
    base_url, key = live_api
    case.call_and_validate(base_url=base_url, headers={"Authorization": f"Bearer {key}"},
                           checks=[not_a_server_error, _error_shape])


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live_api):
    _run(case, live_api)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_deep(case, live_api):
    _run(case, live_api)

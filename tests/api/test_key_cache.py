"""The API key cache: a key checked once is not looked up again for ``api_key_cache_seconds``;
an unknown key is never kept; 0 turns the cache off."""

from __future__ import annotations

from api.deps import KeyCache, TenantRef
from api.eta import EtaCache
from service.keys import revoke_key
from tests.api.test_batches import make_batch


def _statements(response) -> int:
    return int(response.headers["server-timing"].split('desc="')[1].split()[0])


def test_a_second_request_with_the_same_key_makes_no_auth_query(client, ctx):
    batch = make_batch(client).json()
    ctx.etas = EtaCache(ctx.settings.worker_metrics_interval, ttl=3600)  # computed once, below
    client.get(f"/v1/batches/{batch['id']}")
    ctx.keys = KeyCache(5.0)
    first = client.get(f"/v1/batches/{batch['id']}")
    second = client.get(f"/v1/batches/{batch['id']}")
    ctx.keys = KeyCache(0.0)
    uncached = client.get(f"/v1/batches/{batch['id']}")
    assert first.status_code == second.status_code == uncached.status_code == 200
    # The key's lookup (on SQLite its BEGIN too) is in the first and the uncached one only.
    assert _statements(second) < _statements(first) == _statements(uncached)


def test_without_the_cache_a_revoked_key_is_refused_at_once(client, ctx, key):
    ctx.keys = KeyCache(0.0)
    assert client.get("/v1/files").status_code == 200
    with ctx.db.session() as session:
        from sqlalchemy import select

        from service.models import ApiKey
        key_id = session.scalars(select(ApiKey.id)).first()
        assert revoke_key(session, key_id=key_id)
    response = client.get("/v1/files")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_entries_expire_and_a_zero_ttl_keeps_nothing():
    tenant = TenantRef("t", "acme")
    cache = KeyCache(60.0)
    cache.put("h", tenant)
    assert cache.get("h") == tenant and cache.get("other") is None
    expiring = KeyCache(1e-9)
    expiring.put("h", tenant)
    assert expiring.get("h") is None
    off = KeyCache(0.0)
    off.put("h", tenant)
    assert off.get("h") is None

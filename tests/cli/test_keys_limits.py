"""``boxcar keys create --max-enqueued-tokens`` and ``boxcar keys limit``: a key's own quota."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

import cli.main as cli
from service.db import Database
from service.models import ApiKey
from tests.conftest_services import migrated


def key_limit(url: str, key_id: str) -> int | None:
    db = Database(url)
    try:
        with db.read_session() as session:
            return session.scalar(select(ApiKey.max_enqueued_tokens)
                                  .where(ApiKey.id == key_id))
    finally:
        db.dispose()


def test_a_key_gets_and_changes_its_own_limit(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'boxcar.db'}"
    migrated(url).dispose()
    monkeypatch.setenv("BOXCAR_DATABASE_URL", url)
    assert cli.main(["keys", "create", "--tenant", "acme", "--max-enqueued-tokens", "5000",
                     "--json"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["max_enqueued_tokens"] == 5000
    assert key_limit(url, created["key_id"]) == 5000
    assert cli.main(["keys", "limit", created["key_id"], "--max-enqueued-tokens", "90000"]) == 0
    assert "90,000" in capsys.readouterr().out
    assert key_limit(url, created["key_id"]) == 90000
    assert cli.main(["keys", "limit", created["key_id"], "--default"]) == 0
    assert key_limit(url, created["key_id"]) is None
    assert cli.main(["keys", "limit", "key_missing", "--default"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["keys", "limit", created["key_id"], "--max-enqueued-tokens", "0"])

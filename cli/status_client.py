"""``boxcar status --api URL``: the report asked of a running API (``GET /v1/status`` with the
operator's key) instead of read from the database.

The API answers from its warm connections and the report it holds while asked
(``api.routes.status``), so a poll costs one HTTP request on a new TCP connection and no new
PostgreSQL backend: on a machine whose CPUs the workers keep busy, starting that backend was
most of the database path's time (``cli.status_reader``; docs/benchmarks.md, "Status polls
under load"). Plain ``http.client``: nothing heavier to import for one request.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlsplit

from cli.database import Refused

STATUS_PATH = "/v1/status"
TIMEOUT_S = 30.0


class ApiStatus:
    """Reports from the API at ``base_url`` (``http://host:port``, a path prefix kept), each on a
    new connection. Of the last report: ``connect_s``, seconds to connect; ``server_timing``,
    the answer's Server-Timing header."""

    def __init__(self, base_url: str, key: str, *, timeout: float = TIMEOUT_S) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise Refused(f"--api must be an http(s) URL such as http://127.0.0.1:8000, got "
                          f"{base_url!r}")
        self._url = url
        self._path = url.path.rstrip("/") + STATUS_PATH
        self._key = key
        self._timeout = timeout
        self.connect_s = 0.0
        self.server_timing: str | None = None

    def collect(self) -> dict[str, Any]:
        """The API's report; ``Refused`` saying why when there is none."""
        url = self._url
        conn_class = (http.client.HTTPSConnection if url.scheme == "https"
                      else http.client.HTTPConnection)
        conn = conn_class(url.hostname or "", url.port, timeout=self._timeout)
        where = f"{url.scheme}://{url.netloc}"
        try:
            start = time.perf_counter()
            conn.connect()
            self.connect_s = time.perf_counter() - start
            conn.request("GET", self._path, headers={"Authorization": f"Bearer {self._key}",
                                                     "Connection": "close"})
            response = conn.getresponse()
            body = response.read()
            self.server_timing = response.getheader("server-timing")
        except OSError as exc:  # refused, unreachable, timed out
            raise Refused(f"cannot reach the API at {where}: {exc}") from exc
        finally:
            conn.close()
        if response.status != 200:
            raise Refused(f"the API at {where} answered {response.status}: {_message(body)}")
        return json.loads(body)


def _message(body: bytes) -> str:
    """The API's error message (``{"error": {"message": ...}}``), else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")

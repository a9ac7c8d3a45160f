"""``Server-Timing`` on every response: the API's own time for the request (from its first byte
in to the response's headers out, inside the ASGI server) and the part of it spent in database
statements, so a client can tell the service's time from the network's and its own.

    Server-Timing: app;dur=2.41, db;dur=1.12;desc="3 statements"

The database time is the statements' (SQLAlchemy's cursor executes on the request's threads);
the connection pool's ping, BEGIN and COMMIT are not statements and count in ``app`` only.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

from sqlalchemy import event
from sqlalchemy.engine import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass
class RequestTiming:
    db_s: float = 0.0
    num_statements: int = 0


# The request being served by this task or thread (FastAPI's threadpool runs sync handlers and
# dependencies in a copy of the request's context, so they see it too).
_current: ContextVar[RequestTiming | None] = ContextVar("boxcar_request_timing", default=None)


def time_statements(engine: Engine) -> None:
    """Count ``engine``'s statement time into the current request's timing (if any)."""
    if getattr(engine, "_boxcar_timed", False):
        return
    engine._boxcar_timed = True  # type: ignore[attr-defined]

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn, cursor, statement, parameters, context, executemany) -> None:
        if _current.get() is not None:
            conn.info["boxcar_statement_start"] = time.perf_counter()

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn, cursor, statement, parameters, context, executemany) -> None:
        timing = _current.get()
        start = conn.info.pop("boxcar_statement_start", None)
        if timing is not None and start is not None:
            timing.db_s += time.perf_counter() - start
            timing.num_statements += 1


def add_statement_time(seconds: float) -> None:
    """Count a statement run outside SQLAlchemy (``api.poll_reads``) into the current
    request's timing, if any."""
    timing = _current.get()
    if timing is not None:
        timing.db_s += seconds
        timing.num_statements += 1


class ServerTiming:
    """ASGI middleware that adds the ``Server-Timing`` header (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        timing = RequestTiming()
        token = _current.set(timing)

        async def send_timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                app_ms = 1000 * (time.perf_counter() - start)
                value = (f'app;dur={app_ms:.2f}, db;dur={1000 * timing.db_s:.2f};'
                         f'desc="{timing.num_statements} statements"')
                message["headers"] = [*message.get("headers", []),
                                      (b"server-timing", value.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            _current.reset(token)


def server_timing_ms(header: str | None, name: str = "app") -> float | None:
    """The ``dur`` of metric ``name`` in a ``Server-Timing`` header value, or None."""
    for metric in (header or "").split(","):
        parts = [p.strip() for p in metric.split(";")]
        if parts[0] != name:
            continue
        for part in parts[1:]:
            key, _, value = part.partition("=")
            if key == "dur":
                try:
                    return float(value)
                except ValueError:
                    return None
    return None

"""A request body handed on about a MiB at a time, off the event loop: the uploads' and the
Message Batches create's way in (neither ever holds a whole body)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError

FEED_BYTES = 1 << 20  # hand the parser ~1 MiB at a time, off the event loop


async def feed_body(request: Request, feed: Callable[[bytes], None], *,
                    max_bytes: int | None = None, too_large: str = "") -> None:
    """Every byte of the body to ``feed``, in pieces of about ``FEED_BYTES``; past ``max_bytes``
    a 413 saying ``too_large``. After an error the rest is read and dropped, so the client gets
    the answer rather than a reset connection."""
    error: Exception | None = None
    pending = bytearray()
    size = 0
    async for chunk in request.stream():
        if error is not None:
            continue
        size += len(chunk)
        if max_bytes is not None and size > max_bytes:
            error = ApiError(413, too_large)
            continue
        pending += chunk
        if len(pending) >= FEED_BYTES:
            data = bytes(pending)
            pending.clear()
            try:
                await run_in_threadpool(feed, data)
            except Exception as exc:  # a bad body, or storage that is down (a 503)
                error = exc
    if error is not None:
        raise error
    await run_in_threadpool(feed, bytes(pending))

"""Ids, OpenAI style: a prefix and random hex digits (``batch_3f2a…``, ``chatcmpl-…``,
``req_…``). The one id generator of boxcar; ``service.ids`` names the kinds of object."""

from __future__ import annotations

import secrets


def new_id(prefix: str = "", nbytes: int = 12) -> str:
    """``prefix`` followed by ``2 * nbytes`` random hex digits."""
    return f"{prefix}{secrets.token_hex(nbytes)}"

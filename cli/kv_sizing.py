"""``boxcar run`` sizes the KV cache from its file: a short file never needs the gigabytes
``kv_cache_memory`` buys, and on a GPU those bytes are allocated and zeroed at start.

An upper bound, so no line is treated differently than with the default cache: a token is at
least one byte, so a line's prompt has at most as many tokens as the line has bytes (the whole
line counts: messages, tools, keys), plus ``TEMPLATE_TOKENS`` for what a chat template adds, plus
its ``max_tokens``; ``n`` sequences need that each. At most ``max_num_seqs`` sequences run at
once, so the largest ``max_num_seqs`` needs are summed. A line without a max_tokens may run to the
model's context: then, and for a file too big to read twice cheaply, there is no bound (None).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

MAX_SCAN_BYTES = 4 << 20
TEMPLATE_TOKENS = 256


def kv_blocks_needed(path: str | Path, *, block_size: int, max_num_seqs: int) -> int | None:
    """KV blocks enough for the requests of the batch file at ``path`` to run, or None."""
    try:
        if os.path.getsize(path) > MAX_SCAN_BYTES:
            return None
        raw_lines = Path(path).read_bytes().splitlines()
    except OSError:
        return None  # the run itself reports the file
    needs: list[int] = []
    for raw in raw_lines:
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line that does not parse never reaches the engine
        body = line.get("body") if isinstance(line, dict) else None
        if not isinstance(body, dict):
            continue
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return None
        n = body.get("n", 1)
        n = n if isinstance(n, int) and n >= 1 else 1
        blocks = math.ceil((len(raw) + TEMPLATE_TOKENS + max_tokens) / block_size)
        needs.extend([blocks] * min(n, max_num_seqs))
    if not needs:
        return None
    needs.sort(reverse=True)
    return max(2, sum(needs[:max_num_seqs]))

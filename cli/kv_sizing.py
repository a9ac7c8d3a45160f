"""``boxcar run`` sizes the KV cache from its file: a short file never needs the gigabytes
``kv_cache_memory`` buys, and on a GPU those bytes are allocated and zeroed at start.

An upper bound, so no line is treated differently than with the default cache: a token is at
least one byte, so a line's prompt has at most as many tokens as the line has bytes (the whole
line counts: messages, tools, keys), plus ``TEMPLATE_TOKENS`` for what a chat template adds, plus
the ``max_tokens`` the engine gets (its engine fields': a /v1/completions line's default 16, none
for an embeddings line); ``n`` sequences need that each. At most ``max_num_seqs`` sequences run
at once, so the largest ``max_num_seqs`` needs are summed. A line the engine lets run to the
model's context (a chat line without max_tokens): then, and for a file too big to read twice
cheaply, there is no bound (None). A line that does not parse never reaches the engine.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from openai_format.engine_fields import engine_fields, max_output_tokens
from openai_format.parse import LineError, parse_line

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
    for line_no, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        parsed = parse_line(raw, line_no=line_no, endpoint=None)
        if isinstance(parsed, LineError):
            continue
        fields = engine_fields(parsed.body)
        max_tokens = max_output_tokens(fields)
        if max_tokens is None:
            return None
        n = 1 if "embedding" in fields or "score" in fields else fields["sampling"]["n"]
        blocks = math.ceil((len(raw) + TEMPLATE_TOKENS + max_tokens) / block_size)
        needs.extend([blocks] * min(n, max_num_seqs))
    if not needs:
        return None
    needs.sort(reverse=True)
    return max(2, sum(needs[:max_num_seqs]))

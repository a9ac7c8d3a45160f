"""An admission order for a batch known in advance, measured by ``bench.admission_order``
(only the benchmark uses it: neither ``LLM.generate`` nor the worker reorders its requests).

The engine admits waiting requests of one priority in arrival order, so the order in which a
caller adds them decides the tail: steps at the end where only a few long requests still run.
``prefix_groups_longest_first`` keeps requests sharing a prompt prefix together (they hit the
prefix cache as a group) and starts the longest ones first; on ``bench.admission_order``'s mixed
workload it cut the steps by a third and the tail steps (< max_num_seqs / 4 running) from 59 to 2.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_groups_longest_first(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], group_tokens: int = 64
) -> list[int]:
    """Indices in admission order: groups sharing their first ``group_tokens`` prompt tokens stay
    together, groups by their longest ``max_tokens`` (longest first), then longest first inside."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"got {len(prompts)} prompts and {len(max_tokens)} max_tokens")
    keys = [tuple(p[:group_tokens]) for p in prompts]
    longest: dict[tuple[int, ...], int] = {}
    for key, n in zip(keys, max_tokens, strict=True):
        longest[key] = max(longest.get(key, 0), n)
    return sorted(range(len(prompts)), key=lambda i: (-longest[keys[i]], keys[i], -max_tokens[i]))

"""gpt-oss's harmony format read back: the final channel is the answer, the analysis channel the
reasoning.

A harmony completion (the prompt, rendered by the model's own chat template, ends with
``<|start|>assistant``) is a run of messages
``<|channel|>{channel}<|message|>{content}<|end|>`` then ``<|start|>assistant...``; the last one
ends with ``<|return|>`` (or ``<|call|>`` for a tool call). ``split_harmony`` walks the token ids
with those special tokens and returns the final channel's text as the content, the analysis
channel's text as the reasoning, and how many tokens the analysis messages took (headers and end
markers included): ``usage.completion_tokens_details.reasoning_tokens``. A vocabulary without the
harmony tokens is not a harmony model (``harmony_tokens`` is None) and its text is left alone.

Both read the vocabulary through two callables, so this package needs no tokenizer: ``lookup``
(a special token's id, or None) and ``decode`` (ids to text, special tokens skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Lookup = Callable[[str], int | None]
Decode = Callable[[list[int]], str]

_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


@dataclass(frozen=True)
class HarmonyTokens:
    start: int
    channel: int
    message: int
    end: int
    return_: int
    call: int

    @property
    def terminators(self) -> tuple[int, int, int]:
        return (self.end, self.return_, self.call)


def harmony_tokens(lookup: Lookup) -> HarmonyTokens | None:
    """The harmony special tokens' ids, or None if the vocabulary lacks any of them."""
    ids = [lookup(token) for token in _SPECIALS]
    if any(i is None for i in ids):
        return None
    return HarmonyTokens(*(i for i in ids if i is not None))


@dataclass(frozen=True)
class ReasoningSplit:
    content: str
    reasoning: str | None  # None: the completion had no analysis message
    reasoning_tokens: int


def split_harmony(token_ids: list[int], decode: Decode,
                  specials: HarmonyTokens) -> ReasoningSplit | None:
    """The completion's final and analysis channels; None when it is not harmony at all (no
    channel header), so the caller keeps the plain text."""
    messages: list[tuple[str, list[int], int]] = []  # (channel, content ids, tokens taken)
    channel_ids: list[int] = []
    content: list[int] | None = None
    in_channel = False
    taken = 0
    for token in token_ids:
        taken += 1
        if content is not None:  # inside a message's content
            if token in specials.terminators:
                messages.append((_channel_name(decode, channel_ids), content, taken))
                content, channel_ids, in_channel, taken = None, [], False, 0
            else:
                content.append(token)
        elif token == specials.channel:
            in_channel = True
        elif token == specials.message:
            content = []
        elif token == specials.start:
            channel_ids, in_channel = [], False  # a new message's header: role, then channel
        elif in_channel:
            channel_ids.append(token)
    if content is not None:  # cut off (length) inside a message
        messages.append((_channel_name(decode, channel_ids), content, taken))
    if not messages:
        return None
    final = [ids for channel, ids, _ in messages if channel == "final"]
    analysis = [(ids, n) for channel, ids, n in messages if channel == "analysis"]
    return ReasoningSplit(
        content="".join(decode(ids) for ids in final),
        reasoning="\n".join(decode(ids) for ids, _ in analysis) if analysis else None,
        reasoning_tokens=sum(n for _, n in analysis),
    )


def _channel_name(decode: Decode, ids: list[int]) -> str:
    # The header may go on past the name: a recipient (" to=functions.f"), "<|constrain|>json"
    words = decode(ids).split()
    return words[0] if words else ""

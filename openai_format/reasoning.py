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

A tool call is a message addressed to a function: ``to=functions.{name}`` in its header (after
the role or after the channel name), its content the arguments (JSON), ending with ``<|call|>``.
``split_harmony`` returns those as ``tool_calls``, and their messages are neither answer nor
reasoning.

Both read the vocabulary through two callables, so this package needs no tokenizer: ``lookup``
(a special token's id, or None) and ``decode`` (ids to text, special tokens skipped).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

Lookup = Callable[[str], int | None]
Decode = Callable[[list[int]], str]

_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
_FUNCTION_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


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
class HarmonyCall:
    """A message to ``functions.{name}``: its arguments as the model wrote them."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ReasoningSplit:
    content: str
    reasoning: str | None  # None: the completion had no analysis message
    reasoning_tokens: int
    tool_calls: tuple[HarmonyCall, ...] = ()


def split_harmony(token_ids: list[int], decode: Decode,
                  specials: HarmonyTokens) -> ReasoningSplit | None:
    """The completion's final and analysis channels and its function calls; None when it is
    not harmony at all (no channel header), so the caller keeps the plain text."""
    messages: list[_Message] = []
    role_ids: list[int] = []  # the header's part before <|channel|>
    channel_ids: list[int] = []
    content: list[int] | None = None
    in_channel = False
    taken = 0
    for token in token_ids:
        taken += 1
        if content is not None:  # inside a message's content
            if token in specials.terminators:
                messages.append(_Message(decode, role_ids, channel_ids, content, taken,
                                         token == specials.call))
                content, role_ids, channel_ids, in_channel, taken = None, [], [], False, 0
            else:
                content.append(token)
        elif token == specials.channel:
            in_channel = True
        elif token == specials.message:
            content = []
        elif token == specials.start:
            role_ids, channel_ids, in_channel = [], [], False  # a new message: role, channel
        else:
            (channel_ids if in_channel else role_ids).append(token)
    if content is not None:  # cut off (length) inside a message
        messages.append(_Message(decode, role_ids, channel_ids, content, taken, False))
    if not messages:
        return None
    calls = [m for m in messages if m.function is not None and m.called]
    said = [m for m in messages if m.function is None]
    final = [m.content for m in said if m.channel == "final"]
    analysis = [m for m in said if m.channel == "analysis"]
    return ReasoningSplit(
        content="".join(decode(ids) for ids in final),
        reasoning="\n".join(decode(m.content) for m in analysis) if analysis else None,
        reasoning_tokens=sum(m.taken for m in analysis),
        tool_calls=tuple(HarmonyCall(m.function or "", decode(m.content).strip())
                         for m in calls),
    )


class _Message:
    """One harmony message of a completion: channel, recipient function, content ids."""

    def __init__(self, decode: Decode, role_ids: list[int], channel_ids: list[int],
                 content: list[int], taken: int, called: bool) -> None:
        self.channel = _channel_name(decode, channel_ids)
        recipient = (_FUNCTION_RECIPIENT.search(decode(role_ids))
                     or _FUNCTION_RECIPIENT.search(decode(channel_ids)))
        self.function = recipient.group(1) if recipient else None
        self.content = content
        self.taken = taken  # tokens, header and end marker included
        self.called = called  # ended with <|call|>


def _channel_name(decode: Decode, ids: list[int]) -> str:
    # The header may go on past the name: a recipient (" to=functions.f"), "<|constrain|>json"
    words = decode(ids).split()
    return words[0] if words else ""

"""The items of one array in a JSON body (``{"requests": [item, ...]}``), read as the body
arrives: each item is decoded as soon as its bytes are in, so a 256 MB body is never held
whole; only the item being read and the chunk it came in.

A push parser: ``feed(chunk)`` returns the items the chunk completed, ``finish()`` says the body
ended where it may. The body's outer shape is checked as it goes (an object with the one key,
an array under it); an item is any JSON value, decoded by ``json``'s own decoder.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

# An item still unfinished after this many characters is refused rather than held (a body
# that is not JSON would otherwise be buffered to its end).
MAX_ITEM_CHARS = 64 << 20
_WHITESPACE = " \t\n\r"


class JsonBodyError(ValueError):
    """The body is not ``{"<key>": [...]}`` JSON; the message says where."""


class ArrayItems:
    def __init__(self, key: str, max_item_chars: int = MAX_ITEM_CHARS) -> None:
        self.key = key
        self.max_item_chars = max_item_chars
        self._decoder = json.JSONDecoder()
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""
        self._pos = 0
        # "{", "key", ":", "[", "item" (an item or "]"), "," ("," or "]"), "}", "end"
        self._expect = "{"
        self.num_items = 0

    def feed(self, data: bytes) -> list[Any]:
        try:
            self._buffer = self._buffer[self._pos:] + self._utf8.decode(data)
        except UnicodeDecodeError as exc:
            raise JsonBodyError(f"the body is not UTF-8: {exc}") from None
        self._pos = 0
        return self._items(final=False)

    def finish(self) -> None:
        try:
            self._buffer = self._buffer[self._pos:] + self._utf8.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise JsonBodyError(f"the body is not UTF-8: {exc}") from None
        self._pos = 0
        # An item only the body's end completes (``[1`` then nothing) belongs to a body that
        # ended early: no ``]`` followed it.
        self._items(final=True)
        if self._expect != "end":
            raise JsonBodyError(f"the body ended early: expected {self._what()}")

    def _what(self) -> str:
        return {"{": "a JSON object", "key": f'"{self.key}"', ":": "':'",
                "[": "an array", "item": "an item or ']'", ",": "',' or ']'", "}": "'}'",
                "end": "nothing more"}[self._expect]

    def _skip_whitespace(self) -> bool:
        """Past whitespace; False when the buffer ran out."""
        buffer, pos = self._buffer, self._pos
        while pos < len(buffer) and buffer[pos] in _WHITESPACE:
            pos += 1
        self._pos = pos
        return pos < len(buffer)

    def _items(self, *, final: bool) -> list[Any]:
        items: list[Any] = []
        while self._skip_whitespace():
            char = self._buffer[self._pos]
            if self._expect == "key":
                token = json.dumps(self.key)
                if len(self._buffer) - self._pos < len(token) and not final:
                    break  # wait for the whole key
                if not self._buffer.startswith(token, self._pos):
                    raise JsonBodyError(f"expected the key {token} at character "
                                        f"{self._pos}: the body holds only {token}")
                self._pos += len(token)
                self._expect = ":"
            elif self._expect in ("{", ":", "[", "}"):
                if char != self._expect:
                    raise JsonBodyError(f"expected {self._what()}, got {char!r}")
                self._pos += 1
                self._expect = {"{": "key", ":": "[", "[": "item", "}": "end"}[self._expect]
            elif self._expect == "," or (self._expect == "item" and char == "]"
                                         and self.num_items == 0):
                if char == "]":
                    self._pos += 1
                    self._expect = "}"
                elif char == "," and self._expect == ",":
                    self._pos += 1
                    self._expect = "item"
                else:
                    raise JsonBodyError(f"expected {self._what()}, got {char!r}")
            elif self._expect == "item":
                item = self._item(final=final)
                if item is _MORE:
                    break
                items.append(item)
                self.num_items += 1
                self._expect = ","
            else:  # "end"
                raise JsonBodyError(f"unexpected {char!r} after the body's object")
        return items

    def _item(self, *, final: bool) -> Any:
        try:
            item, end = self._decoder.raw_decode(self._buffer, self._pos)
        except json.JSONDecodeError as exc:
            if final:
                raise JsonBodyError(f"item {self.num_items}: {exc.msg} at character "
                                    f"{exc.pos}") from None
            if len(self._buffer) - self._pos > self.max_item_chars:
                raise JsonBodyError(f"item {self.num_items} is not valid JSON, or longer than "
                                    f"{self.max_item_chars:,} characters") from None
            return _MORE
        if not final and not isinstance(item, dict | list | str):
            # A number or literal is complete only where a delimiter follows it: "3" or "3."
            # at the buffer's end may go on ("3.14") in the next chunk.
            after = end
            while after < len(self._buffer) and self._buffer[after] in _WHITESPACE:
                after += 1
            if after == len(self._buffer) or self._buffer[after] not in ",]":
                if len(self._buffer) - self._pos > self.max_item_chars:
                    raise JsonBodyError(f"item {self.num_items} is not valid JSON, or longer "
                                        f"than {self.max_item_chars:,} characters")
                return _MORE
        self._pos = end
        return item


_MORE = object()

"""Stop strings: the first of a request's ``stop`` strings in its decoded output, checked after
each token. Only the tail can hold a new match (the text before it was checked at the last
token), so a step's cost does not grow with the output's length beyond the decode."""

from __future__ import annotations

from collections.abc import Callable

from engine.core.request import Request


def match_stop_string(request: Request, decode: Callable[[list[int], bool], str]) -> str | None:
    """The stop string the output now holds, earliest first, or None. Sets ``request.text`` to
    the output decoded by ``decode(token_ids, skip_special_tokens)``, cut at the match (after it
    with ``include_stop_str_in_output``)."""
    params = request.sampling_params
    # (not the placeholders of steps in flight: async scheduling)
    text = decode(request.token_ids[request.num_prompt_tokens:request.num_sampled_tokens],
                  params.skip_special_tokens)
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(request.text) - longest)
    request.text = text
    best: tuple[int, str] | None = None
    for stop in params.stop:
        at = text.find(stop, search_from)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return None
    at, stop = best
    request.text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
    return stop

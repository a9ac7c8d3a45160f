"""What a finished batch's output and error files say, read through the API, and the exactly-once
figures over them: shared by the fault tests (tests/system/test_faults.py) and the chaos run's
auditor (bench/chaos_audit.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from tests.openai_shapes import error_of


@dataclass
class Results:
    """The lines of a batch's output and error files."""

    custom_ids: list[str] = field(default_factory=list)  # in file order, repeats kept
    num_succeeded: int = 0  # lines with a 200 response
    error_codes: dict[str, int] = field(default_factory=dict)
    # Summed over the 200 responses' usage (a Responses API body's input_tokens and
    # output_tokens; an embeddings body's prompt_tokens and no output).
    prompt_tokens: int = 0
    completion_tokens: int = 0


def read_results(client: httpx.Client, batch: dict) -> Results:
    """Every line of ``batch``'s output and error files (a batch object from the API)."""
    results = Results()
    for key in ("output_file_id", "error_file_id"):
        if not batch[key]:
            continue
        response = client.get(f"/v1/files/{batch[key]}/content")
        response.raise_for_status()
        for raw in response.text.splitlines():
            line = json.loads(raw)
            results.custom_ids.append(line["custom_id"])
            if line["error"] or line["response"]["status_code"] != 200:
                code = error_of(line)["code"]
                results.error_codes[code] = results.error_codes.get(code, 0) + 1
                continue
            results.num_succeeded += 1
            usage = line["response"]["body"].get("usage") or {}
            results.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
            results.completion_tokens += usage.get("completion_tokens",
                                                   usage.get("output_tokens", 0))
    return results


def exactly_once(expected: list[str], seen: list[str]) -> dict[str, int]:
    """Input custom_ids never answered (lost), answered more than once (duplicates) and answers
    to no input line (unknown)."""
    return {"lost": len(set(expected) - set(seen)), "duplicates": len(seen) - len(set(seen)),
            "unknown": len(set(seen) - set(expected))}

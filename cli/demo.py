"""The main job on the embedded service, end to end through the REST API:

start ``boxcar serve``'s service in this process, upload a JSONL batch file, create the batch,
poll it with a progress bar, download the output and error files, print where they are.

    python -m cli.demo examples/requests.jsonl -o results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import httpx
from tqdm import tqdm

from cli.embedded import EmbeddedServer
from service.settings import Settings

TERMINAL = ("completed", "failed", "expired", "cancelled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit_and_wait(
    base_url: str, api_key: str, input_path: str, *, poll: float = 0.5, progress: bool = True
) -> dict:
    """Upload ``input_path``, run it as a batch, wait; returns the final batch object."""
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        with open(input_path, "rb") as f:
            response = client.post("/v1/files", data={"purpose": "batch"},
                                   files={"file": (os.path.basename(input_path), f)})
        response.raise_for_status()
        file = response.json()
        if file["error_count"]:
            print(f"{file['error_count']} of {file['line_count']} lines have problems; "
                  "they go to the error file", file=sys.stderr)
        endpoint = _endpoint_of(input_path)
        batch = client.post("/v1/batches", json={
            "input_file_id": file["id"], "endpoint": endpoint, "completion_window": "24h"})
        batch.raise_for_status()
        batch = batch.json()
        bar = tqdm(total=file["line_count"], unit="req", desc=batch["id"], disable=not progress)
        while batch["status"] not in TERMINAL:
            time.sleep(poll)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
            counts = batch["request_counts"]
            bar.total = counts["total"] or bar.total
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix_str(batch["status"])
        bar.n = bar.total
        bar.refresh()
        bar.close()
        return batch


def download(base_url: str, api_key: str, file_id: str | None, path: str) -> str | None:
    if file_id is None:
        return None
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.stream("GET", f"{base_url}/v1/files/{file_id}/content", headers=headers,
                      timeout=60) as response, open(path, "wb") as f:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            f.write(chunk)
    return path


def _endpoint_of(path: str) -> str:
    with open(path, "rb") as f:
        for raw in f:
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                continue
            if url:
                return url
    return "/v1/chat/completions"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", default="examples/requests.jsonl")
    parser.add_argument("-o", "--output", default="results.jsonl")
    parser.add_argument("--errors", default=None,
                        help="where the error lines go (default: <output>.errors.jsonl)")
    parser.add_argument("--model", default=None, help="default: BOXCAR_MODEL or SmolLM2")
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    args = parser.parse_args(argv)

    settings = Settings()
    if args.model:
        settings = settings.model_copy(update={"model": args.model})
    port = args.port or _free_port()
    print(f"starting boxcar (model {settings.model}) ...", flush=True)
    started = time.monotonic()
    server = EmbeddedServer(settings, port=port).start()
    try:
        print(f"API at {server.base_url}, ready in {time.monotonic() - started:.1f}s", flush=True)
        batch = submit_and_wait(server.base_url, server.api_key, args.input)
        errors_path = args.errors or os.path.splitext(args.output)[0] + ".errors.jsonl"
        output = download(server.base_url, server.api_key, batch["output_file_id"], args.output)
        errors = download(server.base_url, server.api_key, batch["error_file_id"], errors_path)
    finally:
        server.stop()
    counts, usage = batch["request_counts"], batch["usage"]
    print(f"batch {batch['id']} {batch['status']}: {counts['completed']} completed, "
          f"{counts['failed']} failed of {counts['total']}; {usage['input_tokens']} prompt "
          f"tokens ({batch['prefix_cache_hit_rate']:.0%} from the prefix cache), "
          f"{usage['output_tokens']} generated")
    if output:
        print(f"results: {os.path.abspath(output)}")
    if errors:
        print(f"errors:  {os.path.abspath(errors)}")
    return 0 if batch["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())

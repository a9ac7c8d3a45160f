"""The chaos run's workload: several tenants submitting, in a thread, what a deployment meets:

- batches of chat, completions, responses and embeddings lines, and chat batches on a LoRA
  adapter (some cancelled a few seconds in, some with a 4 s window so they expire, some asking
  their input or output files to expire after ``chaos_expiry.LIFETIME_S``);
- single jobs (``POST /v1/jobs``) of the same kinds, each with a ``webhook_url`` on the bench's
  receiver;
- uploads no batch uses, with an expiry (``chaos_expiry`` ages them during the run).

Requests are spread over the API processes: each goes to one drawn at random, and when that one
refuses the connection (it was killed and is restarting) to the next, so the workload keeps
going on the other. Only a refused connection is retried: a request cut off mid-way may have
been done, and is counted as failed instead (the auditor reads the database, so work whose
answer was lost is still checked).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.chaos_expiry import LIFETIME_S
from tests.conftest_services import chat_line, completion_line, jsonl

EMBEDDER = "chaos-embedder"  # the embedding model's id (its folder's name)
ADAPTER = "chaos-lora"  # the LoRA adapter's name
# What a batch or a job is made of: (kind, weight).
BATCH_KINDS = (("chat", 3), ("completions", 2), ("responses", 2), ("embeddings", 2), ("lora", 2))
JOB_KINDS = (("chat", 2), ("responses", 1), ("embeddings", 1), ("lora", 1))
ENDPOINT = {"chat": "/v1/chat/completions", "lora": "/v1/chat/completions",
            "completions": "/v1/completions", "responses": "/v1/responses",
            "embeddings": "/v1/embeddings"}
EXPIRES = {"anchor": "created_at", "seconds": LIFETIME_S}


def body_of(kind: str, text: str) -> dict:
    """A request body of ``kind`` (16 output tokens where it generates)."""
    if kind == "embeddings":
        return {"model": EMBEDDER, "input": text}
    if kind == "responses":
        return {"input": text, "max_output_tokens": 16}
    if kind == "completions":
        return completion_line("", text, max_tokens=16)["body"]
    body = chat_line("", text, max_tokens=16)["body"]
    return {**body, "model": ADAPTER} if kind == "lora" else body


def line_of(kind: str, custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": ENDPOINT[kind],
            "body": body_of(kind, text)}


def _draw(rng: random.Random, kinds: tuple[tuple[str, int], ...]) -> str:
    return rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]


@dataclass
class Workload:
    """Submits until stopped; what it asked for, and what it was told."""

    base_urls: list[str]
    keys: dict[str, str]
    rng: random.Random
    webhook_urls: dict[str, str]  # tenant -> where its jobs' webhooks go
    counts: Counter[str] = field(default_factory=Counter)
    cancel_requested: set[str] = field(default_factory=set)
    unused_files: list[str] = field(default_factory=list)  # uploads with an expiry, no batch
    _pick: random.Random = field(default_factory=lambda: random.Random(0))  # which API
    _stop: threading.Event = field(default_factory=threading.Event)
    _cancels: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Workload:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for thread in self._cancels:
            thread.join()

    def _run(self) -> None:
        number = 0
        while not self._stop.wait(self.rng.uniform(0.7, 2.0)):
            number += 1
            tenant = self.rng.choice(sorted(self.keys))
            what = self.rng.random()
            try:
                if what < 0.6:
                    self._batch(tenant, f"b{number}")
                elif what < 0.93:
                    self._job(tenant, f"j{number}")
                else:
                    self._unused_upload(tenant, f"u{number}")
            except httpx.HTTPError as exc:  # the API or a server behind it is away
                self.counts[f"submit failed ({type(exc).__name__})"] += 1

    def request(self, tenant: str, method: str, path: str, **kwargs) -> httpx.Response:
        """``method path`` on one API drawn at random, on the next when it refuses."""
        start = self._pick.randrange(len(self.base_urls))
        order = self.base_urls[start:] + self.base_urls[:start]
        for i, base_url in enumerate(order):
            try:
                with httpx.Client(base_url=base_url, timeout=10, headers={
                        "Authorization": f"Bearer {self.keys[tenant]}"}) as client:
                    return client.request(method, path, **kwargs)
            except httpx.ConnectError:
                if i == len(order) - 1:
                    raise
                self.counts["request moved to another API"] += 1
        raise AssertionError("unreachable")

    def _upload(self, tenant: str, name: str, lines: list[dict],
                expires: bool) -> str | None:
        data = {"purpose": "batch"}
        if expires:
            data |= {"expires_after[anchor]": "created_at",
                     "expires_after[seconds]": str(LIFETIME_S)}
        response = self.request(tenant, "POST", "/v1/files", data=data,
                                files={"file": (f"{name}.jsonl", jsonl(lines))})
        if response.status_code != 200:
            self.counts[f"upload refused ({response.status_code})"] += 1
            return None
        return response.json()["id"]

    def _batch(self, tenant: str, tag: str) -> None:
        kind = _draw(self.rng, BATCH_KINDS)
        generates = kind != "embeddings"
        window = "4s" if generates and self.rng.random() < 0.1 else "24h"
        # A 4 s batch is made too big to finish in time, so it expires.
        num_lines = self.rng.randint(150, 300) if window == "4s" else self.rng.randint(10, 120)
        cancel_after = self.rng.uniform(0.5, 6.0) if self.rng.random() < 0.15 else None
        input_expires, output_expires = self.rng.random() < 0.25, self.rng.random() < 0.25
        lines = [line_of(kind, f"{tag}-{i:04d}", f"line {i} of {tag} for {tenant}")
                 for i in range(num_lines)]
        file_id = self._upload(tenant, tag, lines, input_expires)
        if file_id is None:
            return
        create = {"input_file_id": file_id, "endpoint": ENDPOINT[kind],
                  "completion_window": window}
        if output_expires:
            create["output_expires_after"] = EXPIRES
        response = self.request(tenant, "POST", "/v1/batches", json=create)
        if response.status_code == 429:
            self.counts["batch refused by quota (429)"] += 1
            return
        if response.status_code != 200:
            self.counts[f"batch refused ({response.status_code})"] += 1
            return
        self.counts[f"batches created ({kind})"] += 1
        if cancel_after is not None:
            thread = threading.Thread(target=self._cancel, daemon=True,
                                      args=(tenant, response.json()["id"], cancel_after))
            self._cancels.append(thread)
            thread.start()

    def _job(self, tenant: str, tag: str) -> None:
        kind = _draw(self.rng, JOB_KINDS)
        response = self.request(tenant, "POST", "/v1/jobs", json={
            "endpoint": ENDPOINT[kind], "body": body_of(kind, f"job {tag} for {tenant}"),
            "webhook_url": self.webhook_urls[tenant]})
        if response.status_code != 200:
            self.counts[f"job refused ({response.status_code})"] += 1
            return
        self.counts[f"jobs created ({kind})"] += 1

    def _unused_upload(self, tenant: str, tag: str) -> None:
        file_id = self._upload(tenant, tag, [line_of("chat", f"{tag}-0", "never run")], True)
        if file_id is not None:
            self.unused_files.append(file_id)
            self.counts["uploads with an expiry, unused"] += 1

    def _cancel(self, tenant: str, batch_id: str, after_s: float) -> None:
        time.sleep(after_s)
        # Recorded first: a cancel whose answer is lost to a fault may still have been made.
        self.cancel_requested.add(batch_id)
        for _ in range(10):
            try:
                response = self.request(tenant, "POST", f"/v1/batches/{batch_id}/cancel")
                if response.status_code in (200, 409):  # 409: it had finished
                    self.counts[f"cancel answered {response.status_code}"] += 1
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.counts["cancel never answered"] += 1

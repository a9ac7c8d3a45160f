"""The sampler runs where the logits are and never waits for them where it need not: on the
``meta`` device, which holds no data, any read back to the host (``.item()``, ``.tolist()``,
``.cpu()``, a tensor's truth value, a boolean mask) raises; and a step's tokens stay in one tensor
on the device, in request order, that crosses to the host once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import SamplingParams
from engine.core.request import Request
from engine.outputs import RequestMetrics
from engine.runner.greedy_dispatch import sample_tokens
from engine.runner.sampler import Sampler

META = torch.device("meta")


def request(i: int, seed: int | None = None, output: tuple[int, ...] = (),
            min_tokens: int = 0, **params: Any) -> Request:
    req = Request(f"r{i}", [1, 2, 3], SamplingParams(min_tokens=min_tokens, **params), 10, (7,),
                  RequestMetrics(0.0), seed=seed)
    for t in output:
        req.append_token(t)
    return req


NO_WAIT = {
    "greedy": [{"temperature": 0}, {"temperature": 0}],
    "temperature": [{"temperature": 0.7}, {"temperature": 1.3, "seed": 5}],
    "one min_p": [{"temperature": 1.0, "min_p": 0.1}, {"temperature": 0.5, "min_p": 0.1}],
    "min_ps": [{"temperature": 1.0, "min_p": 0.1}, {"temperature": 1.0, "min_p": 0.3}],
    "penalties": [{"temperature": 0, "repetition_penalty": 1.3, "output": (3, 3, 8)},
                  {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.2,
                   "output": (4,)}],
    "logit_bias": [{"temperature": 0, "logit_bias": {5: 10.0, 9: -100.0}},
                   {"temperature": 1.0, "logit_bias": {2: 1.5}}],
    "min_tokens": [{"temperature": 0, "min_tokens": 3, "stop_token_ids": [4]},
                   {"temperature": 0.9, "min_tokens": 2}],
    "logprobs": [{"temperature": 0, "logprobs": 3}, {"temperature": 1.0, "logprobs": 0}],
}


@pytest.mark.parametrize("rows", list(NO_WAIT.values()), ids=list(NO_WAIT))
def test_the_sampler_never_waits_for_the_device(rows):
    rows = rows + NO_WAIT["greedy"] + NO_WAIT["temperature"]  # mixed with plain rows
    reqs = [request(i, **params) for i, params in enumerate(rows)]
    vocab = 1000
    logits = torch.empty(len(reqs), vocab + 24, device=META)  # a padded vocabulary
    sampled = Sampler(vocab, seed=0).sample(logits, reqs)
    assert sampled.token_ids.device == META
    assert sampled.token_ids.shape == (len(reqs),) and sampled.token_ids.dtype == torch.int64
    if sampled.logprobs is not None:
        assert sampled.logprobs.device == META


def test_the_truncated_draw_waits_once_a_width():
    """Top-k / top-p decide on the host which rows need wider candidates: that read is the one
    the meta device refuses."""
    logits = torch.empty(2, 1000, device=META)
    with pytest.raises((NotImplementedError, RuntimeError)):
        Sampler(1000, seed=0).sample(logits, [request(0, temperature=1.0, top_k=5),
                                             request(1, temperature=1.0, top_p=0.9)])


class Head:
    """A stand-in model: logits are the hidden rows times a fixed output weight."""

    def __init__(self, vocab: int, hidden_size: int) -> None:
        self.weight = torch.randn(vocab + 8, hidden_size,
                                  generator=torch.Generator().manual_seed(3))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.weight.T


def test_a_steps_tokens_are_one_tensor_in_request_order():
    vocab, hidden_size = 300, 16
    head = Head(vocab, hidden_size)
    hidden = torch.randn(6, hidden_size, generator=torch.Generator().manual_seed(4))
    reqs = [
        request(0, temperature=0),  # plain greedy
        request(1, seed=1, temperature=1.0, logprobs=2),
        request(2, temperature=0),
        request(3, temperature=0, logprobs=1),
        request(4, seed=2, temperature=0.8, top_k=10),
        request(5, temperature=0, min_tokens=2, stop_token_ids=[4]),
    ]
    tokens, token_ids, logprobs = sample_tokens(head, None, Sampler(vocab, 0),  # type: ignore[arg-type]
                                                hidden, reqs)
    assert tokens.dtype == torch.int64 and tokens.tolist() == token_ids
    argmax = (hidden @ head.weight[:vocab].T).argmax(-1).tolist()
    assert [token_ids[i] for i in (0, 2, 3)] == [argmax[i] for i in (0, 2, 3)]
    assert set(logprobs) == {"r1", "r3"}
    assert logprobs["r1"].token_id == token_ids[1] and len(logprobs["r1"].top) == 2
    assert logprobs["r3"].top[0][0] == token_ids[3]
    # The full rows' tokens are the sampler's on those rows alone (the seeded draws repeat).
    full = [reqs[i] for i in (1, 3, 4, 5)]
    for r in full:
        r.num_drawn = 0
    alone, _ = Sampler(vocab, 0)(hidden[[1, 3, 4, 5]] @ head.weight.T, full)
    assert alone == [token_ids[i] for i in (1, 3, 4, 5)]
    # Every row plain greedy: the argmax's tensor itself.
    tokens, token_ids, logprobs = sample_tokens(head, None, Sampler(vocab, 0),  # type: ignore[arg-type]
                                                hidden[[0, 2]], [reqs[0], reqs[2]])
    assert tokens.tolist() == token_ids == [argmax[0], argmax[2]] and logprobs == {}


CUDA_ROWS = [p for rows in NO_WAIT.values() for p in rows] + [
    {"temperature": 1.0, "top_k": 5, "seed": 11}, {"temperature": 0.7, "top_p": 0.9, "seed": 12},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.8, "logprobs": 2, "seed": 13}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.py "
                    "runs this file there)")
def test_on_cuda_the_tokens_are_the_cpus_and_stay_on_the_gpu():
    """Every kind of row, seeded: the tokens the sampler draws from CUDA logits are those it
    draws from the same logits on the CPU (one uniform a row from the same generators), left on
    the GPU until the one crossing; the logprobs agree to fp32 rounding."""
    vocab = 1000
    logits = 4 * torch.randn(len(CUDA_ROWS), vocab, generator=torch.Generator().manual_seed(5))

    def run(device: str) -> Any:
        reqs = [request(i, **{"seed": 100 + i, **params}) for i, params in enumerate(CUDA_ROWS)]
        return Sampler(vocab, seed=0).sample(logits.to(device), reqs)

    on_gpu, on_cpu = run("cuda"), run("cpu")
    assert on_gpu.token_ids.device.type == "cuda"
    gpu_ids, gpu_logprobs = on_gpu.cross()
    cpu_ids, cpu_logprobs = on_cpu.cross()
    assert gpu_ids == cpu_ids
    for g, c in zip(gpu_logprobs, cpu_logprobs, strict=True):
        assert (g is None) == (c is None)
        if g is not None and c is not None:
            assert g.logprob == pytest.approx(c.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in c.top]

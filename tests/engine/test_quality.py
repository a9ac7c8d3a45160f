"""The bf16 quality gate (engine/runner/quality.py) and teacher-forced scoring (score_tokens)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.quality import teacher_forced_agreement


def greedy_sequences(llm: LLM, num: int, seed: int) -> list[tuple[list[int], list[int]]]:
    vocab = llm.engine.model_runner.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist()
               for n in torch.randint(4, 60, (num,), generator=g).tolist()]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [(p, list(o.token_ids)) for p, o in zip(prompts, outs, strict=True)]


def test_scores_are_the_engines_own_greedy_choices(tiny_model_dir):
    """Teacher-forced fp32 scores pick exactly the tokens the fp32 engine generated."""
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    for prompt, output in greedy_sequences(llm, 4, seed=0):
        logprobs = llm.engine.model_runner.score_tokens([*prompt, *output])
        assert logprobs.shape == (len(prompt) + len(output) - 1, llm.engine.model_runner.vocab_size)
        assert logprobs[len(prompt) - 1:].argmax(dim=-1).tolist() == output
        torch.testing.assert_close(logprobs.exp().sum(dim=-1), torch.ones(len(logprobs)))
    runner = llm.engine.model_runner
    report = teacher_forced_agreement(runner, runner, greedy_sequences(llm, 3, seed=1))
    assert report.agreement == 1.0 and report.mean_abs_delta_logprob == 0.0


def test_bf16_kernel_path_keeps_stock_bf16_quality(tiny_model_dir):
    """On random weights the bf16 engine (bf16 KV read by the C++ kernel, the screened greedy
    head) agrees with fp32 exactly as often as stock torch bf16 attention does.

    Random-weight models put their top logits within bf16's rounding of each other far more
    often than trained ones: every bf16 path measured 91-96% here (hidden 64-256, init
    0.1-1.0), so the >= 98% gate is asserted on the default model below."""
    fp32 = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    sequences = greedy_sequences(fp32, 12, 2)
    reports = {}
    for backend in ("cpu", "torch"):
        bf16 = LLM(str(tiny_model_dir), dtype="bfloat16", device="cpu",
                   attention_backend=backend)
        assert bf16.engine.model_runner.kv_cache.dtype == torch.bfloat16
        reports[backend] = teacher_forced_agreement(fp32.engine.model_runner,
                                                    bf16.engine.model_runner, sequences)
    kernel, stock = reports["cpu"], reports["torch"]
    assert kernel.num_positions == 12 * 24
    assert kernel.agreement >= 0.9, kernel
    assert abs(kernel.agreement - stock.agreement) <= 1 / 48, reports
    assert kernel.mean_abs_delta_logprob <= 1.1 * stock.mean_abs_delta_logprob, reports
    assert kernel.max_abs_delta_logprob > 1e-4  # bf16 is not fp32: a real difference


@pytest.mark.slow
def test_bf16_gate_holds_on_the_default_model():
    """>= 98% top-1 agreement with fp32 on chat prompts (``python -m bench.bf16_quality``)."""
    from engine.checkpoint.model_cache import pull

    path = str(pull())
    fp32 = LLM(path, dtype="float32", device="cpu")
    bf16 = LLM(path, dtype="bfloat16", device="cpu")
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about batching requests.", "Explain a KV cache in one line."]
    prompt_ids = [fp32.engine.apply_chat_template([{"role": "user", "content": q}])
                  for q in questions]
    outs = fp32.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=48,
                                                    ignore_eos=True))
    sequences = [(p, list(o.token_ids)) for p, o in zip(prompt_ids, outs, strict=True)]
    report = teacher_forced_agreement(fp32.engine.model_runner, bf16.engine.model_runner, sequences)
    assert report.agreement >= 0.98, report
    assert report.mean_abs_delta_logprob < 0.1, report


def test_bad_sequences_are_rejected(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="output token"):
        teacher_forced_agreement(llm.engine.model_runner, llm.engine.model_runner, [([1, 2], [])])
    with pytest.raises(ValueError, match="at least 2"):
        llm.engine.model_runner.score_tokens([5])

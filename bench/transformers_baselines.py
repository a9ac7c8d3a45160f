"""transformers baselines for bench.offline: one request at a time, static padded batches sorted
by prompt length, and transformers' own continuous batching. Each runs greedy with no EOS, like
boxcar's ``ignore_eos``, so every system does the same work; all run in fp32."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.workload import Result, Workload


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> Any:
    from transformers import GenerationConfig

    # No EOS at all, like boxcar's ignore_eos (EOS may be generated, it just does not stop).
    # min_new_tokens would instead forbid EOS and change the greedy choice.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=pad_token_id)


def run_hf_single(model: Any, workload: Workload, pad_id: int, subset: int | None) -> Result:
    indices = list(range(len(workload.prompts)))[: subset or None]
    _hf_generate(model, [workload.prompts[0]], 2, pad_id)  # warm up
    outputs = {}
    start = time.perf_counter()
    for i in indices:
        outputs[i] = _hf_generate(model, [workload.prompts[i]], workload.max_tokens[i], pad_id)[0]
    seconds = time.perf_counter() - start
    note = ""
    if len(indices) < len(workload.prompts):
        note = f"measured on {len(indices)} of {len(workload.prompts)} requests; rate extrapolated"
    return Result("HF one at a time", len(indices), sum(len(workload.prompts[i]) for i in indices),
                  sum(workload.max_tokens[i] for i in indices), seconds, outputs, note)


def run_hf_static(model: Any, workload: Workload, pad_id: int, batch_size: int) -> Result:
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    _hf_generate(model, [workload.prompts[0]], 2, pad_id)
    outputs = {}
    start = time.perf_counter()
    for at in range(0, len(order), batch_size):
        batch = order[at: at + batch_size]
        longest = max(workload.max_tokens[i] for i in batch)
        generated = _hf_generate(model, [workload.prompts[i] for i in batch], longest, pad_id)
        for i, ids in zip(batch, generated, strict=True):
            outputs[i] = ids[: workload.max_tokens[i]]  # what ran past a request's end is waste
    seconds = time.perf_counter() - start
    return Result(f"HF static batches of {batch_size}, sorted", len(order),
                  workload.num_prompt_tokens, workload.num_output_tokens, seconds, outputs,
                  "left-padded, sorted by prompt length")


@torch.inference_mode()
def _hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int,
                 pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=_greedy_config(max_new_tokens, pad_id))
    return [row[width:].tolist() for row in out]


def run_hf_continuous(model: Any, workload: Workload, pad_id: int, *, max_batch_tokens: int,
                      max_requests: int) -> Result:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    blocks = sum(math.ceil((len(p) + m) / page) + 1
                 for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                      max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_requests)
    outputs: dict[int, list[int]] = {}
    errors = 0
    with model.continuous_batching_context_manager(
        generation_config=_greedy_config(max(workload.max_tokens), pad_id),
        continuous_batching_config=config, warmup=False,
    ) as manager:
        _collect(manager, {manager.add_request(workload.prompts[0], max_new_tokens=2,
                                               eos_token_id=-1): 0})  # warm up
        start = time.perf_counter()
        ids = {
            manager.add_request(p, max_new_tokens=m, eos_token_id=-1): i
            for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True))
        }
        outputs, errors = _collect(manager, ids)
        seconds = time.perf_counter() - start
    note = "the generate_batch manager, per-request max_new_tokens"
    if errors:
        note += f"; {errors} requests failed"
    return Result("HF continuous batching", len(workload.prompts), workload.num_prompt_tokens,
                  sum(len(o) for o in outputs.values()), seconds, outputs, note)


def _collect(manager: Any, ids: dict[str, int]) -> tuple[dict[int, list[int]], int]:
    outputs, errors = {}, 0
    while len(outputs) + errors < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                break
            continue
        if result.is_finished() and result.request_id in ids:
            if result.error is not None:
                errors += 1
            else:
                outputs[ids[result.request_id]] = list(result.generated_tokens)
    return outputs, errors



def load_hf_model(checkpoint: Any) -> tuple[Any, str]:
    """transformers' own loader (needs accelerate for GGUF), else the engine's weights."""
    from transformers import AutoModelForCausalLM

    path = checkpoint.path
    try:
        if checkpoint.is_gguf:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        how = "transformers from_pretrained"
    except (ImportError, ValueError) as exc:
        config = checkpoint.config
        if hasattr(config, "to_transformers"):  # the engine's own reading of config.json
            config = config.to_transformers()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(
            dict(checkpoint.iter_weights(torch.float32)), strict=False
        )
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"weights do not fit: {missing=} {unexpected=}") from exc
        model.tie_weights()
        how = f"engine weights in a transformers model ({str(exc).splitlines()[0][:60]})"
    # generate() fills unset fields of the config it is given from the model's own, EOS included:
    # clear it there so no baseline stops early (boxcar runs with ignore_eos).
    model.generation_config.eos_token_id = None
    return model.eval(), how



"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) matches transformers' own GGUF load."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.checkpoint.model_cache import pull

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about batching requests on a GPU."}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return pull()


def test_greedy_chat_matches_transformers_gguf(gguf_path):
    # float32: the exact mode (auto may pick bf16); a 64-token budget forces chunked prefill too
    llm = LLM(str(gguf_path), dtype="float32", max_num_batched_tokens=64)
    prompts = [llm.engine.apply_chat_template(c) for c in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.no_grad():
        for conv, prompt, out in zip(PROMPTS, prompts, outs, strict=True):
            ref_prompt = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
            assert list(ref_prompt) == prompt
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                 pad_token_id=0)
            assert out.token_ids == ref[0, len(prompt):].tolist()
    assert "Paris" in outs[0].text

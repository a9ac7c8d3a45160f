"""boxcar's inference engine: continuous batching over a paged KV cache for Llama-family models.

Public API: ``from engine import LLM, LLMEngine, EngineConfig, SamplingParams``.

ENGINE INTERFACE (being written right now by the lead in engine/; code against it exactly):

```python
from engine import LLM, LLMEngine, EngineConfig, SamplingParams, RequestOutput, EngineStats
# engine/sampling_params.py and engine/outputs.py ALREADY EXIST in the tree: read them.
engine = LLMEngine(EngineConfig(model="SmolLM2-135M-Instruct" or a folder/.gguf path, max_num_seqs=..., ...))
engine.tokenizer            # a transformers PreTrainedTokenizerBase; .eos_token_id, .chat_template
engine.max_model_len        # int: context length (prompt + generated must fit)
engine.model_name           # str, e.g. "SmolLM2-135M-Instruct"
engine.encode(prompt: str) -> list[int]
engine.apply_chat_template(messages: list[dict]) -> list[int]   # add_generation_prompt=True; raises ValueError on bad messages
engine.add_request(request_id: str, prompt: str | list[int], params: SamplingParams, *, arrival_time: float | None = None) -> None
    # ValueError if request_id is already in the engine, the prompt is empty, or prompt tokens >= max_model_len
    # (message names the numbers). max_tokens is capped so prompt + output <= max_model_len (finish_reason "length").
engine.abort_request(request_ids: str | Iterable[str]) -> list[RequestOutput]  # finished outputs with finish_reason "abort"
engine.step() -> list[RequestOutput]  # runs one scheduling step; returns the RequestOutputs of requests that FINISHED in it
engine.has_unfinished_requests() -> bool
engine.num_unfinished_requests -> int
engine.get_stats() -> EngineStats
# RequestOutput.outputs[i] (CompletionOutput): index, text, token_ids, finish_reason ("stop"|"length"|"abort"),
#   stop_reason, logprobs (list[TokenLogprob] | None); RequestOutput.metrics: RequestMetrics with queue_time, ttft,
#   tpot, e2e_latency, num_prompt_tokens, num_cached_tokens, num_generated_tokens.
llm = LLM(model=..., **engine_config_fields)
llm.generate(prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None, *, use_tqdm=False) -> list[RequestOutput]  # input order
llm.chat(conversations: list[list[dict]] | list[dict], params=...) -> list[RequestOutput]
llm.engine  # the LLMEngine
```
A tiny random-weight model folder for tests will be provided by the lead as a session-scoped pytest fixture `tiny_model_dir` (in tests/conftest.py: a Llama config with a small byte-level BPE tokenizer with a chat template, saved with save_pretrained) — until it exists, test your logic with a small fake engine object implementing the methods above (keep the fake in your test files), then switch/add tests with the real engine when `engine/llm_engine.py` exists (check the tree from time to time). The default real model is "SmolLM2-135M-Instruct" (engine.model_cache.pull() puts it in the cache; that module is being written by another helper).
"""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]


def __getattr__(name: str):  # imported lazily: torch is heavy
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(name)

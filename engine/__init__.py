"""boxcar's inference engine: continuous batching over a paged KV cache for decoder LLMs (Llama,
Gemma 2/3, Phi-3, gpt-oss and the MoE families Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) and
embedding models (BERT and decoder embedders); ``engine/models/`` registers each family.

    from engine import LLM, SamplingParams
    llm = LLM(model="SmolLM2-135M-Instruct")          # a folder, a .gguf file or a cached name
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))

``LLMEngine`` (add_request / abort_request / step / get_stats) is the loop a worker drives; an
embedding model's requests take ``PoolingParams`` (docs/embeddings.md).
"""

from engine.config import EngineConfig
from engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "PoolingParams",
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

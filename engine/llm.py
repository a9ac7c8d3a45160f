"""LLM: the offline, whole-list API on top of LLMEngine (``generate`` and ``chat``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    """``LLM(model=PATH_OR_NAME, **engine_args)``; engine_args are EngineConfig fields."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        unknown = set(engine_args) - _CONFIG_FIELDS
        if unknown:
            raise ValueError(f"unknown engine arguments {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_name: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``lora_name``: one
        registered adapter for every prompt, or one (or None: the base model) per prompt."""
        prompt_list: list[str | list[int]]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        loras: list[str | None]
        if lora_name is None or isinstance(lora_name, str):
            loras = [lora_name] * len(prompt_list)
        else:
            loras = list(lora_name)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} lora names for {len(prompt_list)} prompts")
        ids = []
        for prompt, p, lora in zip(prompt_list, params_list, loras, strict=True):
            request_id = f"gen-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, p, lora_name=lora)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.apply_chat_template(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                done[output.request_id] = output
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in request_ids]

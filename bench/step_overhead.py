"""Host work a step: the real scheduler, KV manager, input batch, sampler and output handling over
a model whose forward costs next to nothing, split by phase.

``python -m bench.step_overhead [--seqs 64,256,1024] [--steps 50] [--threads 2]``

The model is a 1-layer Llama of hidden size 64 with a byte-level BPE vocabulary of ``--vocab``
tokens (1,024 by default: the output projection and the sampler's [rows, vocab] passes stay
small, so what is left is the engine's own bookkeeping; ``--vocab 49152`` is the default model's,
where the host's passes over [rows, vocab] weigh in). Each case keeps ``seqs`` sequences
running and times ``--steps`` steps after a warm-up:

* ``decode``: every sequence decoding (prompts of 16 tokens, prefilled before the clock starts);
* ``mixed``: the same, while requests of ``--mixed-max-tokens`` tokens finish and new ones with
  prompts of 200 tokens take their seats, prefilled in chunks within the step's token budget.

Each in ``greedy`` and ``sampled`` (temperature 0.8, top-p 0.9, top-k 50, seeded) form, or
``penalized`` (``--sampling penalized``: sampled, with repetition, presence and frequency
penalties; ``--prompt-len`` sets how much context a decode sequence carries);
``--structured`` makes a quarter of the rows JSON-constrained (``json_object``), ``--lora`` half
of them run one of two rank-8 adapters. Phases, in microseconds a step:

* ``schedule``: ``Scheduler.schedule``; ``prepare``: the flat batch (``prepare_inputs``);
* ``forward``: the model and its output layer (device work, left out of ``host``);
* ``sample``: the rows' tokens from the logits (argmax, or the sampler);
* ``update``: ``Scheduler.update_from_output``; ``rest``: everything else of ``LLMEngine.step``
  (attention and LoRA set-up, stop checks, outputs; a grammar advances in ``sample``).

``host`` is the step's wall time less ``forward``; ``us/seq`` divides it by the running sequences.

``--async`` times each case twice instead, synchronous and with async scheduling
(``EngineConfig.async_scheduling``: the forward pass and the sampler of step N run on the
engine's step thread while the main thread schedules step N+1 and finishes step N-1), without the
phase clock (the two threads would share it):

* ``step``: wall time a step; ``device``: the step thread's part (forward and sampling, timed
  in ``ModelRunner.run_step``); ``wait``: the main thread blocked on the step in flight;
* ``host``: the main thread's own work a step: ``step`` less ``wait`` and less the device
  work it ran itself (all of it synchronous).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HIDDEN = 64
PROMPT_LEN = 16
MIXED_PROMPT_LEN = 200


def write_model(folder: Path, vocab: int) -> Path:
    """A 1-layer Llama with a byte-level BPE tokenizer of ``vocab`` tokens (no hub)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [f'{{"key_{i}": [{i}, "value {i * 7}"], "text": "the quick brown fox {i}"}}'
              for i in range(2000)]
    tok.train_from_iterator(corpus, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    # The model's vocabulary is ``vocab`` even where the tokenizer's is smaller (a small corpus
    # trains fewer merges): the ids past it are padding rows, as many checkpoints have.
    config = transformers.LlamaConfig(
        vocab_size=max(vocab, len(tokenizer)), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class PhaseClock:
    """Seconds spent in each phase, summed over the timed steps; a phase inside another (the
    output layer inside the sampling) counts for itself only."""

    seconds: dict[str, float] = field(default_factory=dict)
    running: bool = False
    _inner: list[float] = field(default_factory=list)  # time in nested phases, per open phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed
            if self.running:
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)


class _TimedModel:
    """The runner's model behind a clock: its forward and its output layer are ``forward``
    (device work)."""

    def __init__(self, model: Any, clock: PhaseClock) -> None:
        self._model = model
        self._clock = clock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.phase("forward"):
            return self._model(*args, **kwargs)

    def compute_logits(self, hidden: Any) -> Any:
        with self._clock.phase("forward"):
            return self._model.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def instrument(engine: Any) -> PhaseClock:
    clock = PhaseClock()
    runner = engine.model_runner
    # the runner's own module (not a path): the same bench times earlier trees for a baseline
    model_runner_module = sys.modules[type(runner).__module__]
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.scheduler, "update_from_output", "update")
    clock.wrap(runner, "prepare_inputs", "prepare")
    clock.wrap(model_runner_module, "sample_tokens", "sample")
    runner.model = _TimedModel(runner.model, clock)
    # The CPU's greedy screen is the output layer's product by another route; its cost follows
    # the model's logit spread (a random 1-layer model leaves hundreds of candidates a row, the
    # default model ~4), so the stub takes the plain output layer, timed as the forward's.
    runner.greedy_screen = None
    return clock


@dataclass(frozen=True)
class Case:
    seqs: int
    mode: str  # decode | mixed
    sampling: str  # greedy | sampled | penalized
    structured: bool
    lora: bool
    prompt_len: int = PROMPT_LEN  # a decode-mode sequence's prompt


def params_for(case: Case, index: int, max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams, StructuredOutputParams

    kwargs: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=True)
    if case.sampling == "greedy":
        kwargs.update(temperature=0.0)
    else:
        kwargs.update(temperature=0.8, top_p=0.9, top_k=50, seed=index)
    if case.sampling == "penalized":
        kwargs.update(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
    if case.structured and index % 4 == 0:
        kwargs.update(structured_output=StructuredOutputParams(json_object=True),
                      ignore_eos=False)
    return SamplingParams(**kwargs)


def run_case(model: Path, adapters: list[str], case: Case, steps: int, threads: int,
             mixed_max_tokens: int) -> dict[str, float]:
    engine, add = start_case(model, adapters, case, steps, threads, mixed_max_tokens, False)
    clock = instrument(engine)
    for _ in range(3):  # warm: steady sizes
        engine.step()
    clock.running = True
    wall = 0.0
    step_times = []
    for _ in range(steps):
        if case.mode == "mixed":
            missing = case.seqs - engine.num_unfinished_requests
            for _ in range(missing):
                add(MIXED_PROMPT_LEN, mixed_max_tokens)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        wall += elapsed
        step_times.append(elapsed)
    clock.running = False
    phases = {name: seconds / steps * 1e6 for name, seconds in clock.seconds.items()}
    accounted = sum(phases.values())
    result = {"step": wall / steps * 1e6, "median_step": statistics.median(step_times) * 1e6}
    for name in ("schedule", "prepare", "forward", "sample", "update"):
        result[name] = phases.get(name, 0.0)
    result["rest"] = result["step"] - accounted
    result["host"] = result["step"] - result["forward"]
    result["us_per_seq"] = result["host"] / case.seqs
    return result


def run_overlap_case(model: Path, adapters: list[str], case: Case, steps: int, threads: int,
                     mixed_max_tokens: int, async_scheduling: bool) -> dict[str, float]:
    """``--async``: step, device, wait and host time a step (the module's docstring)."""
    from engine.runner import step_pipeline

    engine, add = start_case(model, adapters, case, steps, threads, mixed_max_tokens,
                             async_scheduling)
    assert engine.async_scheduling == async_scheduling
    engine.model_runner.greedy_screen = None  # as ``instrument`` does
    # "inline": device work on the main thread (every synchronous step)
    seconds = {"device": 0.0, "wait": 0.0, "inline": 0.0}
    timing = [False]

    def timed(owner: Any, attribute: str, name: str) -> Callable[[], None]:
        original = getattr(owner, attribute)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if timing[0]:
                    elapsed = time.perf_counter() - start
                    seconds[name] += elapsed
                    if name == "device" and threading.current_thread() is threading.main_thread():
                        seconds["inline"] += elapsed

        setattr(owner, attribute, wrapper)
        return lambda: setattr(owner, attribute, original)

    restore = [timed(engine.model_runner, "run_step", "device"),
               timed(step_pipeline.InFlightStep, "result", "wait")]
    try:
        for _ in range(3):
            engine.step()
        timing[0] = True
        wall = 0.0
        for _ in range(steps):
            if case.mode == "mixed":
                for _ in range(case.seqs - engine.num_unfinished_requests):
                    add(MIXED_PROMPT_LEN, mixed_max_tokens)
            start = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - start
        timing[0] = False
    finally:
        for undo in restore:
            undo()
    result = {"step": wall / steps * 1e6, "device": seconds["device"] / steps * 1e6,
              "wait": seconds["wait"] / steps * 1e6}
    result["host"] = result["step"] - (seconds["wait"] + seconds["inline"]) / steps * 1e6
    return result


def start_case(model: Path, adapters: list[str], case: Case, steps: int, threads: int,
               mixed_max_tokens: int, async_scheduling: bool) -> tuple[Any, Callable[..., None]]:
    """An engine running ``case.seqs`` sequences, prompts prefilled, and its request adder."""
    from engine import EngineConfig, LLMEngine

    budget = case.seqs + (512 if case.mode == "mixed" else 0)
    long = steps + 64  # decode-mode sequences outlive the timed steps
    context = max(case.prompt_len + long, MIXED_PROMPT_LEN + mixed_max_tokens)
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", num_threads=threads,
        max_num_seqs=case.seqs, max_num_batched_tokens=max(budget, 2048),
        num_kv_blocks=case.seqs * max(context // 16 + 2, 24) + 64, max_model_len=max(context, 1024),
        lora_modules=tuple(adapters) if case.lora else (), max_lora_rank=8,
        async_scheduling=async_scheduling)
    engine = LLMEngine(config)
    vocab = engine.vocab_size
    names = [a.split("=", 1)[0] for a in adapters]
    counter = 0

    def add(prompt_len: int, max_tokens: int) -> None:
        nonlocal counter
        prompt = [(counter * 31 + 7 * j) % (vocab - 1) + 1 for j in range(prompt_len)]
        lora = names[counter % 2] if case.lora and counter % 2 == 0 else None
        engine.add_request(f"r{counter}", prompt, params_for(case, counter, max_tokens),
                           lora_name=lora)
        counter += 1

    for _ in range(case.seqs):
        add(case.prompt_len, long if case.mode == "decode" else mixed_max_tokens)
    while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    return engine, add


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="64,256,1024")
    parser.add_argument("--modes", default="decode,mixed")
    parser.add_argument("--sampling", default="greedy,sampled")
    parser.add_argument("--structured", action="store_true", help="also the structured cases")
    parser.add_argument("--lora", action="store_true", help="also the LoRA cases")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--mixed-max-tokens", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                        help="a decode-mode sequence's prompt tokens")
    parser.add_argument("--async", dest="overlap", action="store_true",
                        help="each case synchronous and with async scheduling (step, device, "
                             "wait, host)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)

    cases = [Case(int(n), mode, sampling, False, False, args.prompt_len)
             for n in args.seqs.split(",") for mode in args.modes.split(",")
             for sampling in args.sampling.split(",")]
    if args.structured:
        cases += [Case(int(n), "decode", "greedy", True, False) for n in args.seqs.split(",")]
    if args.lora:
        cases += [Case(int(n), "decode", "greedy", False, True) for n in args.seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "model", args.vocab)
        adapters: list[str] = []
        if args.lora:
            import transformers

            from bench.lora import write_adapter

            config = transformers.AutoConfig.from_pretrained(model)
            for i in range(2):
                folder = Path(tmp) / f"adapter{i}"
                write_adapter(folder, config, str(model), rank=8, seed=i)
                adapters.append(f"a{i}={folder}")
        if args.overlap:
            results = overlap_table(model, adapters, cases, args)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            return 0
        columns = ("step", "host", "us_per_seq", "schedule", "prepare", "forward", "sample",
                   "update", "rest")
        print(f"{'seqs':>5} {'mode':<7} {'sampling':<9} {'extra':<10} "
              + " ".join(f"{c:>10}" for c in columns))
        results = []
        for case in cases:
            figures = run_case(model, adapters, case, args.steps, args.threads,
                               args.mixed_max_tokens)
            extra = "structured" if case.structured else "lora" if case.lora else ""
            print(f"{case.seqs:>5} {case.mode:<7} {case.sampling:<9} {extra:<10} "
                  + " ".join(f"{figures[c]:>10.1f}" for c in columns), flush=True)
            results.append({"case": case.__dict__, **figures})
    print("(microseconds a step; host = step - forward; us_per_seq = host / seqs)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def overlap_table(model: Path, adapters: list[str], cases: list[Case],
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    columns = ("step", "host", "device", "wait")
    print(f"{'seqs':>5} {'mode':<7} {'sampling':<9} {'extra':<10} {'async':<5} "
          + " ".join(f"{c:>10}" for c in columns))
    results = []
    for case in cases:
        extra = "structured" if case.structured else "lora" if case.lora else ""
        for overlap in (False, True):
            figures = run_overlap_case(model, adapters, case, args.steps, args.threads,
                                       args.mixed_max_tokens, overlap)
            print(f"{case.seqs:>5} {case.mode:<7} {case.sampling:<9} {extra:<10} "
                  f"{'on' if overlap else 'off':<5} "
                  + " ".join(f"{figures[c]:>10.1f}" for c in columns), flush=True)
            results.append({"case": case.__dict__, "async": overlap, **figures})
    print("(microseconds a step; host = step - wait - device work on the main thread)")
    return results


if __name__ == "__main__":
    raise SystemExit(main())

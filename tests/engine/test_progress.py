"""LLMEngine.progress(): every unfinished sequence, in the order the scheduler serves them, with
the counts a forecast of the time left needs."""

from __future__ import annotations

from engine import LLM, SamplingParams


def test_progress_lists_running_then_waiting_sequences_with_their_counts(tiny_model_dir):
    # synchronous steps (the default on a GPU overlaps them, and a step's tokens come back with
    # the next step() call): the counts below are those after three steps' outputs
    engine = LLM(str(tiny_model_dir), max_num_seqs=2, async_scheduling=False).engine
    prompt = list(range(3, 15))  # 12 tokens
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.add_request("pair", prompt, SamplingParams(temperature=0, max_tokens=7, n=2))
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=9))
    assert [(p.request_id, p.running) for p in engine.progress()] == [
        ("a", False), ("pair", False), ("pair", False), ("b", False)]
    for _ in range(3):
        engine.step()
    progress = engine.progress()
    # Two seats: a and the pair's first sequence run; the pair's second and b wait.
    assert [(p.request_id, p.running) for p in progress] == [
        ("a", True), ("pair", True), ("pair", False), ("b", False)]
    a = progress[0]
    assert (a.num_output_tokens, a.max_tokens, a.ignore_eos) == (3, 5, True)
    assert a.num_tokens == 15 and a.num_computed_tokens == 14  # the last token is next
    assert not progress[1].ignore_eos and progress[1].max_tokens == 7
    waiting = progress[3]
    assert (waiting.num_output_tokens, waiting.num_computed_tokens) == (0, 0)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.progress() == []

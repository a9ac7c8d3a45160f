"""PenaltyCounts: rows kept across steps, advanced by the sampled tokens, equal a recount of each
request's prompt and output; the sampler advances them itself."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.core.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from engine.outputs import RequestMetrics
from engine.runner.penalties import INITIAL_ROWS, PenaltyCounts
from engine.runner.sampler import Sampler

VOCAB = 50
CPU = torch.device("cpu")


def request(i: int, prompt: list[int], **params: float) -> Request:
    params = params or {"frequency_penalty": 0.5}
    return Request(f"r{i}", prompt, SamplingParams(**params), 100, (), RequestMetrics(0.0))


def recount(req: Request, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(vocab)
    for t in req.output_token_ids:
        if 0 <= t < vocab:
            counts[t] += 1
    seen = counts > 0
    for t in req.prompt_token_ids:
        if t < vocab:
            seen[t] = True
    return counts, seen


def test_rows_advanced_by_the_sampled_tokens_equal_a_recount():
    g = torch.Generator().manual_seed(0)
    counts = PenaltyCounts()
    live = [request(i, torch.randint(0, VOCAB + 5, (n,), generator=g).tolist())
            for i, n in enumerate((3, 17, 1, 40))]
    for step in range(30):
        chosen = [r for j, r in enumerate(live) if (step + j) % 3 != 0]  # some sit a step out
        rows, got_counts, got_seen = counts.gather(chosen, VOCAB, CPU)
        for row, req in enumerate(chosen):
            want_counts, want_seen = recount(req)
            assert torch.equal(got_counts[row], want_counts)
            assert torch.equal(got_seen[row], want_seen)
        # the step's tokens (ids past the vocabulary among them: padding rows, never counted)
        tokens = torch.randint(0, VOCAB + 3, (len(chosen),), generator=g)
        counts.advance(rows, tokens)
        for req, t in zip(chosen, tokens.tolist(), strict=True):
            req.append_token(t)
        if step == 12:  # one finishes, another arrives: it takes a row the first gave back
            live[1].status = RequestStatus.FINISHED_STOPPED
            live[1] = request(9, [4, 4, VOCAB + 1])
    assert counts.num_rows <= INITIAL_ROWS


def test_a_first_count_leaves_out_the_placeholders_of_steps_in_flight():
    counts = PenaltyCounts()
    req = request(0, [1, 2])
    req.append_token(7)
    req.token_ids.append(PLACEHOLDER_TOKEN_ID)
    req.num_placeholders = 1
    _, got, seen = counts.gather([req], VOCAB, CPU)
    assert got[0].nonzero().flatten().tolist() == [7]
    assert seen[0].nonzero().flatten().tolist() == [1, 2, 7]


def test_finished_rows_are_reused_but_never_one_of_the_step_and_rows_grow_by_half():
    counts = PenaltyCounts()
    first = [request(i, [i]) for i in range(INITIAL_ROWS)]
    counts.gather(first, VOCAB, CPU)
    for r in first:
        r.status = RequestStatus.FINISHED_LENGTH
    # a request finished on the host while a step that holds it runs keeps its row in that step
    late = first[0]
    second = [request(100 + i, [i + 1]) for i in range(INITIAL_ROWS - 1)]
    rows, _, seen = counts.gather([late, *second], VOCAB, CPU)
    assert len(set(rows.tolist())) == INITIAL_ROWS
    assert counts.output_counts is not None and counts.output_counts.shape[0] == INITIAL_ROWS
    assert seen[1:].nonzero().tolist() == [[i, i + 1] for i in range(INITIAL_ROWS - 1)]
    third = [request(200 + i, [7]) for i in range(3)]
    counts.gather(second + third, VOCAB, CPU)
    assert counts.output_counts.shape[0] == INITIAL_ROWS + INITIAL_ROWS // 2  # grown by half
    _, _, seen = counts.gather(second, VOCAB, CPU)  # the grown rows kept what they held
    assert seen.nonzero().tolist() == [[i, i + 1] for i in range(INITIAL_ROWS - 1)]


def test_two_requests_with_one_id_have_their_own_rows_and_a_new_width_starts_over():
    counts = PenaltyCounts()
    a, b = request(0, [1]), request(0, [2])
    a.append_token(3)
    _, got, seen = counts.gather([a, b], VOCAB, CPU)
    assert got[0, 3] == 1 and got[1].sum() == 0
    assert seen[0].nonzero().flatten().tolist() == [1, 3]
    assert seen[1].nonzero().flatten().tolist() == [2]
    _, got, _ = counts.gather([a], VOCAB + 8, CPU)  # a padded vocabulary: counted afresh
    assert got.shape == (1, VOCAB + 8) and got[0, 3] == 1


def test_the_sampler_counts_each_drawn_token_for_the_penalized_rows_only():
    sampler = Sampler(vocab_size=VOCAB, seed=0)
    g = torch.Generator().manual_seed(1)
    reqs = [request(0, [1], frequency_penalty=0.3), request(1, [2], temperature=1.0),
            request(2, [3], repetition_penalty=1.2, temperature=0.9)]
    for _ in range(6):
        ids, _ = sampler(4 * torch.randn(len(reqs), VOCAB, generator=g), reqs)
        for req, t in zip(reqs, ids, strict=True):
            req.append_token(t)
    assert sampler.penalty_counts.num_rows == 2
    _, got, _ = sampler.penalty_counts.gather([reqs[0], reqs[2]], VOCAB, CPU)
    for row, req in enumerate((reqs[0], reqs[2])):
        assert torch.equal(got[row], recount(req)[0])


def test_a_step_without_penalized_rows_gives_back_the_finished_rows_then_the_tensors():
    sampler = Sampler(vocab_size=VOCAB, seed=0)
    penalized = [request(0, [1]), request(1, [2])]
    plain = request(2, [3], temperature=0.0)
    logits = torch.zeros(3, VOCAB)
    sampler(logits, [*penalized, plain])
    assert sampler.penalty_counts.num_rows == 2
    penalized[0].status = RequestStatus.FINISHED_STOPPED
    sampler(logits[:1], [plain])
    assert sampler.penalty_counts.num_rows == 1  # the running one keeps its counts
    assert sampler.penalty_counts.output_counts is not None
    penalized[1].status = RequestStatus.FINISHED_LENGTH
    sampler(logits[:1], [plain])
    assert sampler.penalty_counts.num_rows == 0 and sampler.penalty_counts.output_counts is None

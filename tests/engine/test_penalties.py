"""PenaltyCounts: rows kept across steps equal a recount of each request's prompt and output."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.core.request import Request, RequestStatus
from engine.outputs import RequestMetrics
from engine.runner.penalties import INITIAL_ROWS, PenaltyCounts

VOCAB = 50
CPU = torch.device("cpu")


def request(i: int, prompt: list[int]) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(frequency_penalty=0.5), 100, (),
                   RequestMetrics(0.0))


def recount(req: Request, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(vocab)
    for t in req.output_token_ids:
        if t < vocab:
            counts[t] += 1
    seen = counts > 0
    for t in req.prompt_token_ids:
        if t < vocab:
            seen[t] = True
    return counts, seen


def test_rows_kept_across_steps_equal_a_recount():
    g = torch.Generator().manual_seed(0)
    counts = PenaltyCounts()
    live = [request(i, torch.randint(0, VOCAB + 5, (n,), generator=g).tolist())
            for i, n in enumerate((3, 17, 1, 40))]
    for step in range(30):
        # a step samples a changing subset (a request may sit a step out, or sample two tokens
        # between its steps' penalties, as a stop-string's text check never does)
        chosen = [r for j, r in enumerate(live) if (step + j) % 3 != 0]
        got_counts, got_seen = counts.gather(chosen, VOCAB, CPU)
        for row, req in enumerate(chosen):
            want_counts, want_seen = recount(req)
            assert torch.equal(got_counts[row], want_counts)
            assert torch.equal(got_seen[row], want_seen)
        for j, req in enumerate(chosen):
            for _ in range(1 + (step + j) % 2):
                req.append_token(int(torch.randint(0, VOCAB + 3, (), generator=g)))
        if step == 12:  # one finishes, another arrives: it takes a row the first gave back
            live[1].status = RequestStatus.FINISHED_STOPPED
            live[1] = request(9, [4, 4, VOCAB + 1])
    assert counts.num_rows <= INITIAL_ROWS


def test_a_finished_requests_row_is_reused_and_rows_grow_past_the_first():
    counts = PenaltyCounts()
    first = [request(i, [i]) for i in range(INITIAL_ROWS)]
    counts.gather(first, VOCAB, CPU)
    for r in first:
        r.status = RequestStatus.FINISHED_LENGTH
    second = [request(100 + i, [i + 1]) for i in range(INITIAL_ROWS)]
    _, seen = counts.gather(second, VOCAB, CPU)
    assert counts.output_counts is not None and counts.output_counts.shape[0] == INITIAL_ROWS
    assert seen.nonzero().tolist() == [[i, i + 1] for i in range(INITIAL_ROWS)]  # no stale row
    third = [request(200 + i, [7]) for i in range(3)]
    counts.gather(second + third, VOCAB, CPU)
    assert counts.output_counts.shape[0] == 2 * INITIAL_ROWS
    _, seen = counts.gather(second, VOCAB, CPU)  # the grown rows kept what they held
    assert seen.nonzero().tolist() == [[i, i + 1] for i in range(INITIAL_ROWS)]


def test_two_requests_with_one_id_have_their_own_rows_and_a_new_width_starts_over():
    counts = PenaltyCounts()
    a, b = request(0, [1]), request(0, [2])
    a.append_token(3)
    got, seen = counts.gather([a, b], VOCAB, CPU)
    assert got[0, 3] == 1 and got[1].sum() == 0
    assert seen[0].nonzero().flatten().tolist() == [1, 3]
    assert seen[1].nonzero().flatten().tolist() == [2]
    got, _ = counts.gather([a], VOCAB + 8, CPU)  # a padded vocabulary: counted afresh
    assert got.shape == (1, VOCAB + 8) and got[0, 3] == 1

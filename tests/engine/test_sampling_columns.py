"""SamplingColumns: a request's row says what its SamplingParams say, flags included."""

from __future__ import annotations

import itertools

from engine import SamplingParams
from engine.core.request import Request
from engine.outputs import RequestMetrics
from engine.runner.sampling_columns import (
    LOGPROBS,
    MIN_P,
    MIN_TOKENS,
    SEEDED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SamplingColumns,
)
from engine.sampling_params import StructuredOutputParams


def test_every_flag_equals_the_params_own_on_a_grid():
    grid = itertools.product(
        [0.0, 0.8], [None, 7], [None, 0, 3], [1.0, 1.3], [0.0, 0.4], [None, {5: 1.0}],
        [None, StructuredOutputParams(json_object=True)], [None, 9])
    requests = []
    for temperature, top_k, logprobs, rep, freq, bias, structured, seed in grid:
        params = SamplingParams(temperature=temperature, top_k=top_k, logprobs=logprobs,
                                repetition_penalty=rep, frequency_penalty=freq,
                                logit_bias=bias, structured_output=structured, seed=seed,
                                top_p=0.9, min_p=0.05, min_tokens=0 if structured else 2)
        requests.append(Request("r", [1], params, 10, (), RequestMetrics(0.0), seed=seed))
    columns = SamplingColumns.of(requests)
    assert len(columns) == len(requests) == 2 * 2 * 3 * 2 * 2 * 2 * 2 * 2
    for i, r in enumerate(requests):
        p = r.sampling_params
        assert columns.greedy[i] == p.greedy
        assert columns.penalized[i] == p.penalized
        assert columns.plain[i] == p.plain_logits
        assert columns.argmax_only[i] == p.argmax_only == r.argmax_only
        row = columns.values[i]
        assert row[TEMPERATURE] == p.temperature and row[TOP_P] == 0.9 and row[MIN_P] == 0.05
        assert row[TOP_K] == (p.top_k or 0)
        assert row[LOGPROBS] == (-1 if p.logprobs is None else p.logprobs)
        assert row[MIN_TOKENS] == p.min_tokens and row[SEEDED] == (r.seed is not None)
    some = columns.take([3, 0])
    assert (some.values == columns.values[[3, 0]]).all()
    assert SamplingColumns.of([]).values.shape == (0, columns.values.shape[1])

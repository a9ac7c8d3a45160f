"""A worker's forecast of its held lines (metrics.forecast): the step cost fit, the learned
output lengths, and the forecast itself against a simulated engine whose truth is known."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from api.eta import throughput, work_left
from metrics.forecast import (
    BatchForecast,
    Cost,
    LineProgress,
    OutputLengths,
    StepCost,
    forecast,
)

# Realistic proportions for the CPU engine: a decode row costs a little more than a prompt
# token (the same matrices, plus its attention over the cache and its logits).
COST = Cost(fixed=0.05, per_decode=0.0024, per_prefill=0.002)


def step_seconds(cost: Cost, decodes: int, prefill: int) -> float:
    return cost.fixed + cost.per_decode * decodes + cost.per_prefill * prefill


def test_step_cost_recovers_the_parts_of_a_step():
    fit = StepCost()
    assert fit.fit() is None
    rng = random.Random(0)
    for _ in range(300):
        decodes, prefill = rng.randint(1, 128), rng.choice([0, 0, 0, rng.randint(1, 2048)])
        fit.observe(step_seconds(COST, decodes, prefill), num_decode=decodes, num_prefill=prefill)
    cost = fit.fit()
    # The prior (a decode costs what a prompt token does) is off by 20% here; the steps
    # outweigh it.
    assert cost.fixed == pytest.approx(COST.fixed, rel=0.1)
    assert cost.per_decode == pytest.approx(COST.per_decode, rel=0.05)
    assert cost.per_prefill == pytest.approx(COST.per_prefill, rel=0.01)
    for decodes in (1, 16, 64, 128):
        assert step_seconds(cost, decodes, 0) == pytest.approx(
            step_seconds(COST, decodes, 0), rel=0.05)


def test_steps_of_one_size_do_not_make_up_a_slope():
    """A worker that ran a job (one decode a step) and the prefill of a batch has not seen
    how a step grows with its decodes. The prior (a decode costs what a prompt token does)
    fills in: a least-norm split would have made each decode cost as much as the fixed part
    and put a 60-sequence step at 5x its time."""
    truth = Cost(fixed=0.03, per_decode=0.0025, per_prefill=0.0025)
    fit = StepCost()
    for _ in range(32):
        fit.observe(step_seconds(truth, 1, 0), num_decode=1, num_prefill=0)
    for admitted in (20, 20, 20):
        fit.observe(step_seconds(truth, admitted, 2048), num_decode=admitted, num_prefill=2048)
    cost = fit.fit()
    assert step_seconds(cost, 60, 0) == pytest.approx(step_seconds(truth, 60, 0), rel=0.1)


def test_step_cost_follows_a_machine_that_slowed_down():
    fit = StepCost(recent_s=10.0)
    for decodes in range(1, 129):
        fit.observe(step_seconds(COST, decodes, 0), num_decode=decodes, num_prefill=0,
                    at=float(decodes))
    for decodes in range(1, 17):  # another process took half the CPU for the last 10 s
        fit.observe(2 * step_seconds(COST, decodes, 0), num_decode=decodes, num_prefill=0,
                    at=200.0 + decodes * 0.6)
    cost = fit.fit()
    predicted = sum(step_seconds(cost, d, 0) for d in range(1, 17))
    assert predicted == pytest.approx(2 * sum(step_seconds(COST, d, 0) for d in range(1, 17)))


def test_step_cost_is_never_negative():
    fit = StepCost()
    # Noise around a flat cost: an unconstrained fit gives the decodes a negative slope.
    for decodes, seconds in ((100, 0.30), (101, 0.29), (102, 0.30), (103, 0.28)):
        fit.observe(seconds, num_decode=decodes, num_prefill=0)
    cost = fit.fit()
    # The negative slope is held at zero, so the flat cost is all fixed: the steps' mean.
    assert (cost.per_decode, cost.per_prefill) == (0.0, 0.0)
    assert cost.fixed == pytest.approx(0.2925)


def line(output: int, max_tokens: int, *, ignore_eos: bool = False) -> LineProgress:
    return LineProgress(batch_id="b", running=True, prefill_tokens=0, output_tokens=output,
                        max_tokens=max_tokens, ignore_eos=ignore_eos)


def test_output_lengths_condition_on_what_a_line_already_generated():
    lengths = OutputLengths()
    # Nothing learned yet: max_tokens is the bound.
    assert lengths.expected_left(line(10, 100)) == 90
    for n in (10, 20, 30, 200):
        lengths.observe(n)
    # A line at 15 tokens will end like the finished lines longer than 15: 20, 30 and 200
    # capped at its max_tokens 100 -> mean 50.
    assert lengths.expected_left(line(15, 100)) == pytest.approx(50 - 15)
    # Past every finished line: it may still run to max_tokens.
    assert lengths.expected_left(line(250, 300)) == 50
    # A line that ignores EOS runs to max_tokens whatever the others did.
    assert lengths.expected_left(line(15, 100, ignore_eos=True)) == 85
    small = OutputLengths(capacity=2)
    for n in (5, 6, 7):
        small.observe(n)
    assert len(small) == 2 and small.expected_left(line(0, 100)) == pytest.approx(6.5)


def test_the_length_table_answers_what_the_mean_of_the_longer_lengths_is():
    """``LengthTable`` (running sums, two bisections a line) against the definition: the mean
    of the finished lengths longer than the line's output, each capped at its max_tokens."""
    rng = random.Random(7)
    lengths = OutputLengths(capacity=300)
    for _ in range(400):  # past capacity: the oldest drop out
        lengths.observe(rng.choice([1, 2, 50, rng.randint(1, 600)]))
    table, seen = lengths.table(), sorted(lengths._sorted)
    for _ in range(2_000):
        max_tokens = rng.randint(1, 700)
        progress = line(rng.randint(0, max_tokens), max_tokens)
        longer = [n for n in seen if n > progress.output_tokens]
        expected = (max(sum(min(n, max_tokens) for n in longer) / len(longer)
                        - progress.output_tokens, 1.0) if longer
                    else max(max_tokens - progress.output_tokens, 1))
        assert table.expected_left(progress) == pytest.approx(expected, rel=1e-12)


def test_a_tail_is_bound_by_its_longest_line_not_by_its_tokens():
    # Two lines left in a 128-seat engine: 3 and 40 tokens to go. The batch needs 40 steps,
    # each costing the fixed part: a per-token rate (43 tokens) cannot see that.
    lines = [line(0, 3, ignore_eos=True), line(0, 40, ignore_eos=True)]
    batches, total = forecast(lines, seats=128, cost=COST, lengths=OutputLengths())
    expected = 40 * COST.fixed + 43 * COST.per_decode
    assert batches["b"].seconds_left == pytest.approx(expected) and total == pytest.approx(expected)
    assert batches["b"].num_lines == 2


def test_seats_are_handed_out_in_engine_order_and_batches_end_separately():
    def held(batch: str, n: int, tokens: int) -> list[LineProgress]:
        return [LineProgress(batch_id=batch, running=False, prefill_tokens=10, output_tokens=0,
                             max_tokens=tokens, ignore_eos=True) for _ in range(n)]

    # Two seats: a's two lines run first (10 steps), then b's two (10 more); a job's line
    # (no batch) takes a seat first and delays a's second line by 5 steps.
    job = LineProgress(batch_id=None, running=True, prefill_tokens=0, output_tokens=5,
                       max_tokens=10, ignore_eos=True)
    batches, total = forecast([job, *held("a", 2, 10), *held("b", 2, 10)], seats=2,
                              cost=Cost(1.0, 0.0, 0.0), lengths=OutputLengths())
    assert set(batches) == {"a", "b"}
    assert batches["a"].seconds_left == 15.0  # a: steps 0-10 and 5-15
    assert batches["b"].seconds_left == 25.0 and total == 25.0


@dataclass
class _Seq:
    batch: str
    max_tokens: int
    generated: int = 0
    running: bool = False


class SimulatedEngine:
    """An engine on a virtual clock: ``seats`` sequences decode one token a step, new ones are
    admitted in order (their prompt computed in the step that admits them), and a step costs
    ``cost``."""

    def __init__(self, lines: list[_Seq], *, seats: int, prompt: int, cost: Cost) -> None:
        self.waiting = list(lines)
        self.running: list[_Seq] = []
        self.seats, self.prompt, self.cost = seats, prompt, cost
        self.clock = 0.0
        self.finished: list[_Seq] = []
        self.timeline: list[tuple[float, int, int]] = []  # (end time, decodes, prompt tokens)

    def step(self) -> tuple[int, int]:
        admitted = 0
        while self.waiting and len(self.running) < self.seats:
            seq = self.waiting.pop(0)
            seq.running = True
            self.running.append(seq)
            admitted += 1
        decodes, prefill = len(self.running), admitted * self.prompt
        for seq in self.running:
            seq.generated += 1
        self.finished += [s for s in self.running if s.generated >= s.max_tokens]
        self.running = [s for s in self.running if s.generated < s.max_tokens]
        self.clock += step_seconds(self.cost, decodes, prefill)
        self.timeline.append((self.clock, decodes, prefill))
        return decodes, prefill

    def progress(self) -> list[LineProgress]:
        return [LineProgress(batch_id=s.batch, running=s.running,
                             prefill_tokens=0 if s.running else self.prompt,
                             output_tokens=s.generated, max_tokens=s.max_tokens,
                             ignore_eos=True)
                for s in [*self.running, *self.waiting]]


def _old_estimate(engine: SimulatedEngine, num_lines: int) -> float:
    """What api.eta estimated before the workers forecast: the open lines times the
    batch's learned tokens a line, over the tokens per second of the last 30 s."""
    done = engine.finished
    left = work_left(remaining=num_lines - len(done), completed=len(done),
                     input_tokens=engine.prompt * len(done),
                     output_tokens=sum(s.generated for s in done), cached_tokens=0,
                     est_prompt=engine.prompt, est_output=64)
    points, second = [], 0
    tokens = {}
    for end, decodes, prefill in engine.timeline:
        tokens.setdefault(int(end), [0, 0, 0])
        tokens[int(end)][0] += 1
        tokens[int(end)][1] += decodes
        tokens[int(end)][2] += prefill
    for second, (steps, decodes, prefill) in tokens.items():
        points.append({"t": float(second), "steps": steps, "generation_tokens_per_s": decodes,
                       "prompt_tokens_per_s": prefill})
    rate = throughput([{"timeline": points}], now=engine.clock)
    return left / rate


def test_the_forecast_of_a_running_batch_tracks_a_simulated_engine():
    """The bench's workload (150 lines of 16-64 tokens in a 128-seat engine), read when a
    quarter, half and three quarters of the lines are done: the forecast lands within 5% of
    the time actually left; the former estimate (whole lines over a token rate) missed by more
    than 25% because most open lines were in the engine, nearly done."""
    cost = StepCost()
    warm_up = SimulatedEngine([_Seq("job", 32)], seats=128, prompt=100, cost=COST)
    while warm_up.running or warm_up.waiting:  # the bench's warm-up job: one decode a step
        decodes, prefill = warm_up.step()
        cost.observe(step_seconds(COST, decodes, prefill), num_decode=decodes,
                     num_prefill=prefill)
    rng = random.Random(1)
    num_lines = 150
    lines = [_Seq("b", rng.randint(16, 64)) for _ in range(num_lines)]
    engine = SimulatedEngine(lines, seats=128, prompt=100, cost=COST)
    readings = {}
    marks = [0.25, 0.5, 0.75]
    while engine.running or engine.waiting:
        decodes, prefill = engine.step()
        cost.observe(step_seconds(COST, decodes, prefill), num_decode=decodes,
                     num_prefill=prefill)
        if marks and len(engine.finished) >= marks[0] * num_lines:
            batches, _ = forecast(engine.progress(), seats=128, cost=cost.fit(),
                                  lengths=OutputLengths())
            readings[marks.pop(0)] = (engine.clock, batches["b"].seconds_left,
                                      _old_estimate(engine, num_lines))
    old_errors = []
    for at, forecast_left, old_left in readings.values():
        actual_left = engine.clock - at
        assert forecast_left == pytest.approx(actual_left, rel=0.05)
        old_errors.append(abs(old_left - actual_left) / actual_left)
    assert len(readings) == 3 and max(old_errors) > 0.25


def test_the_sequences_of_an_n_2_line_take_two_seats_but_count_one_line():
    first = line(0, 10, ignore_eos=True)
    second = LineProgress(batch_id="b", running=False, prefill_tokens=0, output_tokens=0,
                          max_tokens=10, ignore_eos=True, counts_line=False)
    batches, _ = forecast([first, second], seats=1, cost=Cost(1.0, 0.0, 0.0),
                          lengths=OutputLengths())
    assert batches["b"] == BatchForecast(num_lines=1, seconds_left=20.0)


@pytest.mark.parametrize("warm_up_s", [0.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_short_batch_on_a_fresh_worker_is_forecast_within_30_percent_at_25(seed, warm_up_s):
    """A ~15 s batch (24 lines that stop at 24-48 of their 48 tokens, 8 seats) on a worker that
    has run nothing before (no step history: the fit starts from the batch's own steps),
    whose first step pays a one-off cost (kernels built, memory first touched): read when a
    quarter of its lines are done, the forecast is within 30% of the time actually left."""
    rng = random.Random(seed)
    seats, prompt, max_tokens = 8, 120, 48
    lengths = [rng.randint(max_tokens // 2, max_tokens) for _ in range(24)]
    cost, learned = StepCost(), OutputLengths()
    queue, running = list(lengths), []  # running: [generated, length, prompt tokens left]
    clock, reading, first = 0.0, None, True
    while queue or running:
        while queue and len(running) < seats:
            running.append([0, queue.pop(0), prompt])
        decodes = sum(1 for r in running if not r[2])
        prefill = sum(r[2] for r in running)
        seconds = step_seconds(COST, decodes, prefill) + (warm_up_s if first else 0.0)
        first = False
        clock += seconds
        cost.observe(seconds, num_decode=decodes, num_prefill=prefill, at=clock)
        for r in running:
            r[0], r[2] = (r[0], 0) if r[2] else (r[0] + 1, 0)
        for r in [r for r in running if r[0] >= r[1]]:
            running.remove(r)
            learned.observe(r[1])
        if reading is None and len(learned) >= len(lengths) / 4:
            held = [LineProgress("b", True, 0, r[0], max_tokens, False) for r in running]
            held += [LineProgress("b", False, prompt, 0, max_tokens, False) for _ in queue]
            batches, _ = forecast(held, seats=seats, cost=cost.fit(), lengths=learned)
            reading = (clock, batches["b"].seconds_left)
    assert reading is not None
    at, forecast_left = reading
    assert forecast_left == pytest.approx(clock - at, rel=0.30)

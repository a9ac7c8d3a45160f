"""The rules of ``boxcar doctor`` and their thresholds: the eight classic serving failures in
the issue's order, then batches about to miss their deadline.

Each rule reads a ``View`` of a metrics snapshot and returns a ``Finding`` or None, or raises
``NotEnoughData``. The thresholds are deliberately coarse: each one marks a point past which the
pattern costs real throughput or latency whatever the hardware, not a tuned optimum.
"""

from __future__ import annotations

from collections.abc import Callable

from cli.doctor_view import Finding, NotEnoughData, View, ms, pct
from metrics.snapshot import top

# -- 1: work not batched --------------------------------------------------------------------------
# Under 4 sequences a step barely amortizes its one read of the weights.
SMALL_BATCH_REQUESTS = 4
# ...or under a quarter of max_num_seqs: most of the engine's seats sit empty.
SMALL_BATCH_FRACTION = 0.25
# Judge only when 4x the mean batch finished: there was work that could have run together.
BATCHABLE_FACTOR = 4
# Running at 3/4 of max_num_seqs or more: the seat limit itself is binding.
SATURATED_FRACTION = 0.75
# A handful of requests cannot be batched much whatever the settings.
MIN_REQUESTS_FOR_BATCHING = 8
# -- 2: long prefills stall decodes ---------------------------------------------------------------
# Inter-token P99 at 5x its median: a few steps stall every decode that shares them.
ITL_SPIKE_RATIO = 5.0
# Prefill steps' P99 at 5x the median decode step: the stalling steps are the prefills.
PREFILL_STALL_RATIO = 5.0
# -- 3: KV cache exhausted ------------------------------------------------------------------------
# KV usage at 90%+ is full once the watermark and partly filled blocks are counted.
KV_FULL_RATIO = 0.9
# 5%+ of steps left requests waiting beside free seats and unused token budget.
BLOCKED_STEP_SHARE = 0.05
# Over 1 preemption per 100 finished requests is thrashing, not a blip.
PREEMPTION_RATE = 0.01
# A watermark above 5% of blocks holds back more than a few requests' worth of room.
HIGH_WATERMARK = 0.05
# -- 4: host-bound --------------------------------------------------------------------------------
# 30%+ of the busy loop outside the model: the host, not the device, sets the pace.
HOST_SHARE_MAX = 0.3
# -- 5: prefixes recomputed -----------------------------------------------------------------------
# A fifth of prompt tokens repeat an earlier prompt's prefix: worth caching...
REPEATED_PREFIX_SHARE = 0.2
# ...and under half of those came from the cache: most of that work was done again.
PREFIX_REUSE_MIN = 0.5
# -- 6: slow first token --------------------------------------------------------------------------
# A first token after 1 s (P95) is slow for anyone waiting on it.
TTFT_SLOW_S = 1.0
# The part of TTFT (queue or prefill) that holds half of it is the cause.
TTFT_CAUSE_SHARE = 0.5
# -- 7: throughput falls as load rises ------------------------------------------------------------
# Busy one-second timeline points needed to compare light and heavy load.
MIN_TIMELINE_POINTS = 6
# The heavier half of the points carried 1.5x the requests of the lighter half...
LOAD_RISE = 1.5
# ...yet produced under 80% of its tokens/s.
THROUGHPUT_DROP = 0.8
# -- 8: uneven decode rhythm ----------------------------------------------------------------------
# A P99 gap between steps of 5x the median decode step breaks the rhythm...
GAP_SPIKE_RATIO = 5.0
# ...if it is also 10 ms or more; shorter pauses reach no client.
GAP_MIN_S = 0.01


def unbatched(v: View) -> Finding | None:
    """1. Low tokens/s with small batches: the work was not batched."""
    v.need_steps()
    batch = v.mean("step_requests")
    max_seqs = int(v.setting("max_num_seqs"))
    finished = v.counter("requests_finished")
    small = batch < SMALL_BATCH_REQUESTS or batch < SMALL_BATCH_FRACTION * max_seqs
    if not small or finished < max(BATCHABLE_FACTOR * batch, MIN_REQUESTS_FOR_BATCHING):
        return None
    busy = v.counter("busy_s")
    rate = f"{v.counter('generation_tokens') / busy:.1f} generated tok/s while busy" if busy else ""
    evidence = (f"{batch:.1f} requests per step on average (max_num_seqs={max_seqs}) over "
                f"{v.steps:.0f} steps for {finished:.0f} finished requests; {rate}")
    waiting = [p["waiting"] for p in v.timeline if p.get("steps")]
    if batch >= SATURATED_FRACTION * max_seqs:
        remedy = (f"max_num_seqs={max_seqs} caps the batch: raise it (--max-num-seqs) so more "
                  "sequences share each step, as far as the KV cache holds them.")
    elif v.counter("admission_blocked_steps") >= BLOCKED_STEP_SHARE * v.steps or (
            waiting and sum(waiting) / len(waiting) >= 1):
        remedy = ("requests waited while seats were free: the KV cache or the token budget "
                  "holds admission back; give the KV cache more memory and check "
                  "max_num_batched_tokens.")
    else:
        remedy = ("requests reach the engine one at a time: submit them together (one batch "
                  "file, or many jobs at once), keep more in flight (boxcar run "
                  "--max-in-flight), or let an idle worker gather jobs longer "
                  "(BOXCAR_JOB_COLLECT_WINDOW).")
    return Finding("unbatched", "warning", "Low throughput from small batches", evidence, remedy)


def prefill_stalls(v: View) -> Finding | None:
    """2. Good average, P99 spikes: long prefills block the decodes in their step."""
    v.need_steps()
    itl_p50, itl_p99 = v.quantile("itl_s", 0.5), v.quantile("itl_s", 0.99)
    if v.count("prefill_step_s") == 0 or v.count("decode_step_s") == 0:
        raise NotEnoughData("needs both prefill and decode steps")
    prefill_p99, decode_p50 = v.quantile("prefill_step_s", 0.99), v.quantile("decode_step_s", 0.5)
    if itl_p99 < ITL_SPIKE_RATIO * itl_p50 or prefill_p99 < PREFILL_STALL_RATIO * decode_p50:
        return None
    chunked = v.config.get("enable_chunked_prefill")
    budget = v.config.get("max_num_batched_tokens")
    largest = top(v.histogram("step_tokens"))
    evidence = (f"inter-token latency P50 {ms(itl_p50)} but P99 {ms(itl_p99)} "
                f"({itl_p99 / itl_p50:.0f}x); prefill steps P99 {ms(prefill_p99)} against "
                f"{ms(decode_p50)} for a median decode step; the largest steps scheduled up to "
                f"{largest:.0f} tokens (chunked prefill {'on' if chunked else 'off'}, "
                f"max_num_batched_tokens={budget})")
    if chunked is False:
        remedy = ("turn chunked prefill on (drop --no-chunked-prefill): a long prompt is then "
                  "split across steps and running decodes keep their pace.")
    else:
        smaller = max(256, int(budget or 2048) // 4)
        remedy = (f"chunks are too coarse: lower max_num_batched_tokens (now {budget}, try "
                  f"{smaller}) so each step's prefill share stays short.")
    return Finding("prefill-stalls", "warning", "P99 latency spikes from long prefills",
                   evidence, remedy)


def kv_exhausted(v: View) -> Finding | None:
    """3. Requests queued or preempted while memory looks free: the KV cache is exhausted."""
    v.need_steps()
    finished = max(v.counter("requests_finished"), 1.0)
    preemptions = v.counter("preemptions")
    blocked = v.counter("admission_blocked_steps") / v.steps
    peak = v.gauge("kv_usage_peak")
    thrashing = preemptions >= 1 and preemptions / finished >= PREEMPTION_RATE
    starved = blocked >= BLOCKED_STEP_SHARE and peak >= KV_FULL_RATIO
    if not (thrashing or starved):
        return None
    blocks = int(v.gauge("kv_blocks"))
    block_size = int(v.config.get("block_size") or 16)
    watermark = float(v.config.get("watermark") or 0.0)
    evidence = (f"KV cache peaked at {pct(peak)} of {blocks} blocks ({blocks * block_size} "
                f"tokens); {preemptions:.0f} preemptions for {finished:.0f} finished requests; "
                f"{pct(blocked)} of steps left requests waiting beside free seats and budget")
    rejected = v.counter("requests_rejected")
    if rejected:
        evidence += f"; {rejected:.0f} requests refused at admission"
    remedy = ("the KV cache, not the device's memory, is the limit: give it more "
              "(--kv-cache-memory, or num_kv_blocks) or lower max_num_seqs "
              f"(now {v.config.get('max_num_seqs')}) so admitted requests fit")
    if watermark > HIGH_WATERMARK:
        remedy += f"; the watermark keeps {pct(watermark)} of blocks free, lower it"
    return Finding("kv-exhausted", "critical", "KV cache exhausted: requests queue or get "
                   "preempted", evidence, remedy + ".")


def host_bound(v: View) -> Finding | None:
    """4. Busy hardware yet poor latency: the scheduler and host gaps set the pace."""
    v.need_steps()
    busy = v.counter("busy_s")
    if busy <= 0:
        raise NotEnoughData("no busy time recorded")
    model = v.counter("prefill_model_s") + v.counter("decode_model_s")
    share = 1.0 - model / busy
    if share < HOST_SHARE_MAX:
        return None
    in_steps = max(_sum(v, "prefill_step_s") + _sum(v, "decode_step_s") - model, 0.0)
    gaps = _sum(v, "step_gap_s")
    evidence = (f"the model ran {model:.2f} s of the {busy:.2f} s the engine loop was busy: "
                f"{pct(share)} went to the host ({in_steps:.2f} s scheduling, sampling and "
                f"bookkeeping inside steps, {gaps:.2f} s between steps)")
    if v.count("tpot_s"):
        evidence += f"; TPOT P50 {ms(v.quantile('tpot_s', 0.5))}"
    if gaps > in_steps:
        remedy = ("the time goes between steps: keep the engine thread stepping (tokenize and "
                  "write results elsewhere, fewer competing processes on the CPU).")
    else:
        remedy = ("each step's fixed host cost dominates: run bigger batches per step, use "
                  "CUDA graphs (no enforce_eager) on a GPU, and give the engine CPU threads "
                  "to itself (--threads).")
    return Finding("host-bound", "warning", "The host, not the device, sets the pace",
                   evidence, remedy)


def _sum(v: View, key: str) -> float:
    hist = v.histogram(key)
    return float(hist["sum"]) if hist else 0.0


def prefix_recompute(v: View) -> Finding | None:
    """5. Repeated prefixes computed again: the prefix cache is off or loses them."""
    prompt = _sum(v, "request_prompt_tokens")
    if prompt <= 0:
        raise NotEnoughData("no finished requests")
    repeated, cached = v.counter("prompt_tokens_repeated"), v.counter("prompt_tokens_cached")
    if repeated < REPEATED_PREFIX_SHARE * prompt or cached >= PREFIX_REUSE_MIN * repeated:
        return None
    enabled = v.config.get("enable_prefix_caching")
    evidence = (f"{pct(repeated / prompt)} of prompt tokens ({repeated:.0f} of {prompt:.0f}) "
                f"repeated an earlier prompt's prefix, but only {cached:.0f} "
                f"({pct(cached / repeated)}) came from the prefix cache (prefix caching "
                f"{'on' if enabled else 'off'})")
    if enabled is False:
        remedy = ("turn prefix caching on (drop --no-prefix-caching): shared prefixes are "
                  "then computed once and reused block by block.")
    else:
        # Requests in flight together already share a prefix (the engine holds a request
        # whose next block another is computing), so what is left was evicted before reuse.
        evidence += ("; requests running together share their prefix, so these prefixes were "
                     "evicted from the cache before a later request could reuse them")
        remedy = ("the cache loses blocks before they are reused: give the KV cache more room, "
                  "and run requests with a shared prefix close together (the service orders "
                  "batch lines by prefix; for boxcar run, sort the input file).")
    return Finding("prefix-recompute", "warning", "Repeated prefixes computed again",
                   evidence, remedy)


def slow_first_token(v: View) -> Finding | None:
    """6. TTFT over 1 s because of the batching window or an unchunked long prefill."""
    v.need_requests()
    ttft = v.quantile("ttft_s", 0.95)
    if ttft < TTFT_SLOW_S:
        return None
    queue, prefill = v.quantile("queue_time_s", 0.95), v.quantile("prefill_latency_s", 0.95)
    head = f"TTFT P95 {ms(ttft)}: queue P95 {ms(queue)}, prefill P95 {ms(prefill)}"
    if prefill >= TTFT_CAUSE_SHARE * ttft:
        prompt_p95 = quantile_or(v, "request_prompt_tokens", 0.95)
        chunked = v.config.get("enable_chunked_prefill")
        evidence = (f"{head}; prompts P95 {prompt_p95:.0f} tokens, chunked prefill "
                    f"{'on' if chunked else 'off'}, max_num_batched_tokens="
                    f"{v.config.get('max_num_batched_tokens')}")
        remedy = ("the prefill itself is slow: chunk it (chunked prefill on, a smaller "
                  "max_num_batched_tokens) so it interleaves with other work, or shorten the "
                  "prompts (a cached shared prefix counts for nothing here).")
        return Finding("slow-first-token", "warning", "First token after 1 s: long prefill",
                       evidence, remedy)
    max_seqs = float(v.setting("max_num_seqs"))
    points = v.busy_points()
    running = (sum(p["running"] for p in points) / len(points) if points
               else v.mean("step_requests"))
    if queue < TTFT_CAUSE_SHARE * ttft or running >= SATURATED_FRACTION * max_seqs:
        return None  # queued behind a full engine: saturation, not a window (see rule 7)
    evidence = (f"{head}; on average {running:.1f} of {max_seqs:.0f} seats were taken while "
                "requests waited")
    remedy = ("requests sit in the engine's queue while seats are free: admission is held "
              "back by the batching window (BOXCAR_JOB_COLLECT_WINDOW, BOXCAR_POLL_INTERVAL), "
              "a full KV cache (see kv-exhausted) or an unchunked prompt waiting for an empty "
              "step.")
    return Finding("slow-first-token", "warning", "First token after 1 s: batching window",
                   evidence, remedy)


def quantile_or(v: View, key: str, p: float) -> float:
    try:
        return v.quantile(key, p)
    except NotEnoughData:
        return 0.0


def overload(v: View) -> Finding | None:
    """7. Throughput falling as load rises: waiting grows with running."""
    points = v.busy_points()
    if len(points) < MIN_TIMELINE_POINTS:
        raise NotEnoughData(f"{len(points)} busy timeline points (need {MIN_TIMELINE_POINTS})")
    by_load = sorted(points, key=lambda p: p["running"] + p["waiting"])
    half = len(by_load) // 2
    light, heavy = by_load[:half], by_load[-half:]

    def avg(points: list[dict], key: str) -> float:
        return sum(p.get(key, 0.0) for p in points) / len(points)

    def load(points: list[dict]) -> float:
        return avg(points, "running") + avg(points, "waiting")

    light_tps, heavy_tps = (avg(light, "generation_tokens_per_s"),
                            avg(heavy, "generation_tokens_per_s"))
    if (load(heavy) < LOAD_RISE * max(load(light), 1e-9) or light_tps <= 0
            or heavy_tps >= THROUGHPUT_DROP * light_tps
            or avg(heavy, "waiting") <= avg(light, "waiting")):
        return None
    evidence = (f"at {load(light):.0f} requests in the engine it produced {light_tps:.1f} tok/s; "
                f"at {load(heavy):.0f} ({avg(heavy, 'waiting'):.0f} waiting) only "
                f"{heavy_tps:.1f} tok/s")
    remedy = ("the engine is past its knee: more load buys less work (preemption thrash, a "
              "full KV cache, or CPU contention). Cap max_num_seqs near the light-load level, "
              "give the KV cache more room, or add workers.")
    return Finding("overload", "critical", "Throughput falls as load rises", evidence, remedy)


def uneven_decode(v: View) -> Finding | None:
    """8. Uneven decode rhythm: preemptions and long gaps between decode steps."""
    v.need_steps()
    finished = max(v.counter("requests_finished"), 1.0)
    preemptions = v.counter("preemptions")
    decode_p50 = v.quantile("decode_step_s", 0.5)
    gap_p99 = quantile_or(v, "step_gap_s", 0.99)
    preempting = preemptions >= 1 and preemptions / finished >= PREEMPTION_RATE
    gappy = gap_p99 >= GAP_MIN_S and gap_p99 >= GAP_SPIKE_RATIO * decode_p50
    if not (preempting or gappy):
        return None
    evidence = (f"{preemptions:.0f} preemptions for {finished:.0f} finished requests (each "
                f"pauses a request while it is recomputed); gaps between steps P99 "
                f"{ms(gap_p99)} against a median decode step of {ms(decode_p50)}")
    if v.count("tpot_s"):
        evidence += (f"; TPOT P50 {ms(v.quantile('tpot_s', 0.5))}, "
                     f"P99 {ms(v.quantile('tpot_s', 0.99))}")
    parts = []
    if preempting:
        parts.append("stop the preemptions: more KV cache or a lower max_num_seqs")
    if gappy:
        parts.append("keep the engine thread stepping: move tokenizing, result writing and "
                     "logging off it, and keep other processes off its cores")
    return Finding("uneven-decode", "warning", "Uneven decode rhythm",
                   evidence, "; ".join(parts) + ".")


def deadline_at_risk(v: View) -> Finding | None:
    """9. Live batches whose estimated completion passes their deadline (``api.eta``)."""
    service = v.snapshot.get("service")
    if not service:
        raise NotEnoughData("no service gauges: point doctor at the API's /metrics")
    late = float(service.get("batches_deadline_at_risk", 0.0))
    if late <= 0:
        return None
    return Finding(
        "deadline-at-risk", "critical", "Batches will miss their deadline",
        f"{late:.0f} live batch(es) have an estimated completion past the end of their "
        "completion window (boxcar_batches_deadline_at_risk; `boxcar status` marks them LATE)",
        "add workers for the model (each adds its throughput to the estimate), or make the late "
        "batches smaller: cancel and resubmit fewer lines, or submit them with a longer "
        "completion_window; batches with earlier deadlines run first.")


RULES: list[tuple[str, Callable[[View], Finding | None]]] = [
    ("unbatched", unbatched),
    ("prefill-stalls", prefill_stalls),
    ("kv-exhausted", kv_exhausted),
    ("host-bound", host_bound),
    ("prefix-recompute", prefix_recompute),
    ("slow-first-token", slow_first_token),
    ("overload", overload),
    ("uneven-decode", uneven_decode),
    ("deadline-at-risk", deadline_at_risk),
]

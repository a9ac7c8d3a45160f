// boxcar's dashboard: polls /ui/api/summary once a second and redraws. No build step, no
// libraries. The API key comes from ?key=... (then kept in localStorage) or the form.
"use strict";

const POLL_MS = 1000;
const KEY = "boxcar_api_key";
const $ = (id) => document.getElementById(id);
let updates = 0;
let timer = null;

function takeKeyFromUrl() {
  const params = new URLSearchParams(location.search);
  const key = params.get("key");
  if (!key) return;
  localStorage.setItem(KEY, key);
  params.delete("key");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + (rest ? "?" + rest : ""));
}

function askForKey(message) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

async function poll() {
  timer = null;
  const key = localStorage.getItem(KEY);
  if (!key) return askForKey();
  try {
    const response = await fetch("/ui/api/summary", { headers: { Authorization: "Bearer " + key } });
    if (response.status === 401) {
      localStorage.removeItem(KEY);
      return askForKey("That key was refused.");
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("updated").classList.remove("error");
  } catch (err) {
    $("updated").textContent = "cannot reach the API (" + err.message + ")";
    $("updated").classList.add("error");
  }
  timer = setTimeout(poll, POLL_MS);
}

const fmt = {
  int: (n) => Math.round(n).toLocaleString(),
  pct: (x) => (100 * x).toFixed(1) + "%",
  num: (x, d = 1) => Number(x).toFixed(d),
  secs(s) {
    if (s === null || s === undefined) return "–";
    if (s < 1) return (1000 * s).toFixed(s < 0.01 ? 2 : 0) + " ms";
    return s.toFixed(2) + " s";
  },
  time: (unix) => new Date(unix * 1000).toLocaleTimeString(),
};

function render(data) {
  updates += 1;
  document.body.dataset.updates = String(updates);
  $("key-form").hidden = true;
  $("main").hidden = false;
  $("tenant").textContent = "tenant " + data.tenant.name;
  const engine = data.engine;
  $("workers").textContent = data.workers.length + " worker" + (data.workers.length === 1 ? "" : "s");
  $("t-running").textContent = fmt.int(engine.running);
  $("t-waiting").textContent = fmt.int(engine.waiting);
  $("t-kv").textContent = fmt.pct(engine.kv_usage);
  $("t-kv-bar").style.width = fmt.pct(engine.kv_usage);
  $("t-tps").textContent = fmt.num(engine.generation_tokens_per_s);
  $("t-batch").textContent = fmt.num(engine.batch_size_mean);
  $("t-queue").textContent = fmt.int(data.queue.depth_lines);
  $("t-preempt").textContent = fmt.int(engine.preemptions);
  $("t-prefix").textContent = fmt.pct(engine.prefix_cache_hit_rate);
  renderBatches(data.batches);
  renderJobs(data.jobs);
  renderLatency(engine.latency);
  histogram($("d-ttft"), engine.distributions.ttft_s);
  histogram($("d-tpot"), engine.distributions.tpot_s);
  const tl = engine.timeline;
  lines($("c-load"), tl, [["running", "#3b6fd8"], ["waiting", "#e08a1e"]]);
  lines($("c-kv"), tl, [["kv_usage", "#7b3fd8"]], 1);
  lines($("c-batch"), tl, [["batch_size", "#2a9d5c"]]);
  lines($("c-tps"), tl, [["generation_tokens_per_s", "#3b6fd8"]]);
}

function el(tag, attrs = {}, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderBatches(batches) {
  const body = $("batches").tBodies[0];
  body.replaceChildren();
  $("no-batches").hidden = batches.length > 0;
  for (const b of batches) {
    const done = b.completed + b.failed;
    const row = el("tr", { "data-batch-id": b.id, "data-status": b.status,
                           "data-done": done, "data-total": b.total });
    row.append(el("td", {}, b.id));
    const status = el("td");
    status.append(el("span", { class: "status " + b.status }, b.status));
    row.append(status);
    const cell = el("td");
    const progress = el("div", { class: "progress" });
    const bar = el("div", { class: "bar" });
    const fill = el("div");
    fill.style.width = fmt.pct(b.progress);
    bar.append(fill);
    progress.append(bar, el("span", {}, done + " / " + b.total + " (" + fmt.pct(b.progress) + ")"));
    cell.append(progress);
    row.append(cell, el("td", {}, fmt.int(b.failed)), el("td", {}, fmt.int(b.output_tokens)),
               el("td", {}, fmt.time(b.created_at)),
               el("td", { class: "eta" },
                  b.estimated_completion_at == null ? "-" : fmt.time(b.estimated_completion_at)));
    // A batch whose estimate passes its deadline is flagged (remedy: `boxcar doctor`).
    const deadline = el("td", { class: b.deadline_at_risk ? "deadline late" : "deadline" },
                        b.expires_at == null ? "-" : fmt.time(b.expires_at));
    if (b.deadline_at_risk) {
      row.dataset.late = "true";
      deadline.append(el("span", { class: "status failed" }, " at risk"));
    }
    row.append(deadline);
    body.append(row);
  }
}

function renderJobs(jobs) {
  const chips = $("job-counts");
  chips.replaceChildren();
  for (const [status, n] of Object.entries(jobs.counts)) chips.append(el("span", {}, status + ": " + n));
  const list = $("jobs");
  list.replaceChildren();
  for (const j of jobs.recent) list.append(el("li", {}, j.id + " " + j.status + " " + fmt.time(j.created_at)));
}

function renderLatency(latency) {
  const names = { ttft_s: "TTFT", tpot_s: "TPOT", itl_s: "inter-token", queue_time_s: "queue",
                  e2e_latency_s: "end to end" };
  const body = $("latency").tBodies[0];
  body.replaceChildren();
  for (const [key, label] of Object.entries(names)) {
    const q = latency[key] || {};
    const row = el("tr");
    row.append(el("th", {}, label));
    for (const p of ["p50", "p95", "p99", "mean"]) row.append(el("td", {}, fmt.secs(q[p])));
    body.append(row);
  }
}

const SVG = "http://www.w3.org/2000/svg";
const W = 600; // the charts' viewBox: 600 x 150
const PLOT = W - 20;
function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Bars for the non-empty range of a histogram's buckets, labelled by upper bound.
function histogram(svg, dist) {
  svg.replaceChildren();
  const counts = dist.counts;
  let lo = counts.findIndex((c) => c > 0);
  if (lo < 0) return svg.append(svgEl("text", { x: 10, y: 20 }, "no finished requests yet"));
  let hi = counts.length - 1;
  while (counts[hi] === 0) hi -= 1;
  lo = Math.max(0, lo - 1);
  hi = Math.min(counts.length - 1, hi + 1);
  const shown = counts.slice(lo, hi + 1);
  const max = Math.max(...shown);
  const w = PLOT / shown.length;
  shown.forEach((c, i) => {
    const h = (115 * c) / max;
    svg.append(svgEl("rect", { x: 10 + i * w, y: 125 - h, width: Math.max(w - 2, 1), height: h,
                               fill: "#3b6fd8" }));
    const bound = lo + i < dist.bounds.length ? fmt.secs(dist.bounds[lo + i]) : "+∞";
    if (shown.length <= 12 || i % 2 === 0) {
      svg.append(svgEl("text", { x: 10 + i * w, y: 140 }, "≤" + bound));
    }
  });
}

// Line series over the timeline's points; ``top`` fixes the y-axis maximum.
function lines(svg, points, series, top) {
  svg.replaceChildren();
  if (points.length < 2) return svg.append(svgEl("text", { x: 10, y: 20 }, "collecting…"));
  const t0 = points[0].t;
  const span = Math.max(points[points.length - 1].t - t0, 1);
  const max = top || Math.max(1, ...points.flatMap((p) => series.map(([k]) => p[k] || 0)));
  series.forEach(([key, color], s) => {
    const d = points.map((p, i) => (i ? "L" : "M") + (10 + (PLOT * (p.t - t0)) / span).toFixed(1) +
                         "," + (130 - (112 * (p[key] || 0)) / max).toFixed(1)).join(" ");
    svg.append(svgEl("path", { d, fill: "none", stroke: color, "stroke-width": 2 }));
    svg.append(svgEl("text", { x: W - 10, y: 145 - 12 * s, style: "fill:" + color, "text-anchor": "end" },
                     key.replaceAll("_", " ")));
  });
  svg.append(svgEl("text", { x: 10, y: 14 }, "max " + fmt.num(max, max < 2 ? 2 : 0)));
  svg.append(svgEl("text", { x: 10, y: 145 }, Math.round(span) + " s"));
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  localStorage.setItem(KEY, key);
  $("key-input").value = "";
  if (timer) clearTimeout(timer);
  poll();
});
$("change-key").addEventListener("click", () => {
  if (timer) clearTimeout(timer);
  localStorage.removeItem(KEY);
  askForKey();
});

takeKeyFromUrl();
poll();

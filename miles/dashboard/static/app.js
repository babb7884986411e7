// The dashboard page: tabs over one run directory (metrics, memory timeline, rollout table, sample view), or over
// one run of a folder of runs (?run=NAME; the header's picker switches, the Metrics tab can overlay a second run).
// Panes are hidden, never detached, so a built token strip keeps its DOM and scroll position across tab
// switches. The URL hash is the route: #metrics, #memory/FROM-TO, #rollouts/STEP, #sample/STEP/ROW.

import { TokenStrip, parseSample, colorScale, STATS } from "./strip.js";
import { drawTokenChart, formatValue } from "./charts.js";
import { MetricsView } from "./metrics.js";
import { MemoryView } from "./memory_view.js";
import { RolloutTable } from "./table.js";

const $ = (id) => document.getElementById(id);
const TABS = ["metrics", "memory", "rollouts", "sample"];
const POLL_MS = 2000;
const SAMPLE_FIELDS = new Set(["index", "group", "reward", "weight_version", "finish_reason", "row", "num_tokens",
  "prompt_len", "response_len", "token_start", "token_text_start", "token_text_bytes", "text", "preview",
  "prompt_text", "response_text"]);
const RUN = new URLSearchParams(location.search).get("run");

// An API path for this page's run (or another run of the folder).
const api = (path, run = RUN) => (run ? `${path}${path.includes("?") ? "&" : "?"}run=${encodeURIComponent(run)}` : path);

async function getJSON(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

const escapeHTML = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// A JSONL file of a run, read in pages from where the last poll stopped.
class Feed {
  constructor(name, run = RUN) { this.name = name; this.run = run; this.rows = []; this.offset = 0; }

  async poll() {  // true when new rows arrived; the server returns at most a few MiB per call
    let grew = false;
    for (;;) {
      const offset = this.offset;
      const page = await getJSON(api(`/api/${this.name}?offset=${offset}`, this.run));
      if (page.rows.length) { this.rows.push(...page.rows); grew = true; }
      this.offset = page.next_offset;
      if (page.next_offset === offset || !page.rows.length) return grew;
    }
  }
}

class Dashboard {
  constructor() {
    this.metrics = new Feed("metrics");
    this.ledger = new Feed("ledger");
    this.overlay = null;  // {name, feed}: a second run drawn on the Metrics tab
    this.checkpoints = [];
    this.steps = [];
    this.tableStep = null;
    this.followLatest = true;
    this.sampleKey = null;  // "step/row" of the sample in the strip
    this.data = null;
    this.loadSeq = 0;
    this.dirty = { metrics: true, memory: true };
    this.tab = null;
    this.strip = new TokenStrip($("strip"));
    this.metricsView = new MetricsView($("metrics-groups"), $("tooltip"));
    this.memoryView = new MemoryView(document, $("tooltip"));
    this.table = new RolloutTable($("rollout-table"), { filter: $("table-filter"), prev: $("table-prev"), next: $("table-next"), info: $("table-info") });
  }

  async start() {
    const [info, runs] = await Promise.all([getJSON(api("/api/info")), getJSON("/api/runs")]);
    this.info = info;
    $("run-name").textContent = info.name;
    document.title = `miles · ${info.name}`;
    $("live").textContent = info.follow ? "● live" : "";
    this.showRuns(runs);
    for (const b of document.querySelectorAll("#tabs button")) b.onclick = () => this.openTab(b.dataset.tab);
    this.bindSampleControls();
    this.bindTable();
    this.bindMetricsControls();
    $("memory-setup").onchange = () => {
      const view = this.memoryView;  // setup shown: the window (same size) opens at the run's start
      const span = view.showsAll() ? Infinity : view.windowSize();
      if ($("memory-setup").checked) view.pin(-1, span - 2);
      else if (view.pinned?.[0] < 0) view.pin(0, span - 1);
      this.dirty.memory = true;
      this.renderVisible();
    };
    getJSON(api("/api/plan")).then((plan) => { this.plan = plan; this.dirty.memory = true; this.renderVisible(); }).catch(() => {});
    await Promise.all([this.metrics.poll(), this.ledger.poll(), this.pollSteps(), this.pollCheckpoints()]);
    window.addEventListener("hashchange", () => this.route());
    window.addEventListener("resize", () => { this.dirty.metrics = this.dirty.memory = true; this.renderVisible(); });
    this.route();
    if (info.follow) setInterval(() => this.poll(), POLL_MS);
    document.body.dataset.ready = "1";
  }

  async poll() {
    try {
      const [metrics, ledger] = await Promise.all([this.metrics.poll(), this.ledger.poll(), this.pollSteps(),
        this.overlay?.feed.poll(), getJSON("/api/runs").then((r) => this.showRuns(r))]);
      if (ledger) await this.pollCheckpoints();
      this.dirty.metrics ||= metrics;
      this.dirty.memory ||= ledger;
      this.renderVisible();
    } catch (e) {
      $("live").textContent = `● offline (${e.message})`;
    }
  }

  async pollCheckpoints() {
    this.checkpoints = (await getJSON(api("/api/checkpoints"))).checkpoints;
  }

  // The run picker and the overlay menu, shown when the dashboard serves a folder of runs.
  showRuns({ folder, runs, default: first }) {
    const names = runs.map((r) => r.name);
    const current = RUN ?? first;
    const key = names.join("\n");
    if (key === this.runNames) return;
    this.runNames = key;
    const option = (n) => `<option value="${escapeHTML(n)}">${escapeHTML(n)}</option>`;
    $("run-select").innerHTML = names.map(option).join("");
    $("run-select").value = current;
    $("run-select").hidden = !folder;
    $("run-name").hidden = folder;
    const others = names.filter((n) => n !== current);
    $("metrics-overlay").innerHTML = `<option value="">none</option>${others.map(option).join("")}`;
    $("metrics-overlay").value = this.overlay?.name ?? "";
    $("metrics-overlay-label").hidden = !folder || !others.length;
  }

  // ---- metrics (miles/dashboard/static/metrics.js) ----
  bindMetricsControls() {
    $("run-select").onchange = (e) => { location.href = `?run=${encodeURIComponent(e.target.value)}#${this.tab ?? "metrics"}`; };
    const redraw = () => { this.dirty.metrics = true; this.renderVisible(); };
    $("metrics-filter").oninput = redraw;
    $("metrics-smoothing").oninput = () => { $("metrics-smoothing-value").textContent = Number($("metrics-smoothing").value).toFixed(2); redraw(); };
    $("metrics-overlay").onchange = async (e) => {
      const name = e.target.value;
      this.overlay = name ? { name, feed: new Feed("metrics", name) } : null;
      if (this.overlay) await this.overlay.feed.poll();
      redraw();
    };
  }

  renderMetrics() {
    $("metrics-empty").hidden = this.metrics.rows.length > 0;
    const [shown, total] = this.metricsView.render(this.metrics.rows, {
      runName: this.info.name, smoothing: Number($("metrics-smoothing").value), filter: $("metrics-filter").value,
      overlay: this.overlay && { name: this.overlay.name, rows: this.overlay.feed.rows },
    });
    $("metrics-count").textContent = total ? (shown === total ? `${total} metrics` : `${shown} of ${total} metrics`) : "";
    $("metrics-legend").innerHTML = this.overlay ? `<span class="run-a">━ ${escapeHTML(this.info.name)}</span> <span class="run-b">╍ ${escapeHTML(this.overlay.name)}</span>` : "";
  }

  // ---- routing and tabs ----
  route() {
    const [tab, a, b] = (location.hash.slice(1) || "metrics").split("/");
    const name = TABS.includes(tab) ? tab : "metrics";
    if (name === "rollouts" && a !== undefined && /^\d+$/.test(a)) { this.tableStep = Number(a); this.followLatest = false; }
    const range = name === "memory" && /^(-?\d+)-(-?\d+)$/.exec(a ?? "");
    if (range) { this.memoryView.pin(Number(range[1]), Number(range[2])); this.dirty.memory = true; }
    this.showTab(name);
    if (name === "rollouts" && this.tableStep !== null) this.loadTable(this.tableStep);
    if (name === "sample" && /^\d+$/.test(a ?? "") && /^\d+$/.test(b ?? "")) this.openSample(Number(a), Number(b));
    else if (name === "sample" && !this.sampleKey) this.openDefaultSample();
  }

  openTab(name) {
    if (name === "sample" && this.sampleKey) location.hash = `#sample/${this.sampleKey}`;
    else if (name === "rollouts" && this.tableStep !== null) location.hash = `#rollouts/${this.tableStep}`;
    else if (name === "memory") location.hash = this.memoryView.hash();
    else location.hash = `#${name}`;
  }

  showTab(name) {
    if (this.tab === "sample" && name !== "sample") this.rememberStripScroll();
    this.tab = name;
    $("tooltip").hidden = true;
    for (const t of TABS) $(`pane-${t}`).hidden = t !== name;
    for (const b of document.querySelectorAll("#tabs button")) b.classList.toggle("active", b.dataset.tab === name);
    this.renderVisible();
  }

  // Hidden panes have no layout: the strip's scroll offset is put back once the pane is shown again,
  // unless the first scroll (to the first response token) is still waiting to run.
  rememberStripScroll() {
    if (!this.data || this.strip._pendingShown) return;
    const saved = this.strip.el.scrollTop;
    this.strip.onShown(() => { if (this.strip.el.scrollTop !== saved) this.strip.el.scrollTop = saved; this.drawTokenChart(); });
  }

  renderVisible() {
    if (this.tab === "metrics" && this.dirty.metrics) { this.renderMetrics(); this.dirty.metrics = false; }
    if (this.tab === "memory" && this.dirty.memory) {
      this.memoryView.render({ ledger: this.ledger.rows, plan: this.plan ?? {}, checkpoints: this.checkpoints });
      this.dirty.memory = false;
    }
    if (this.tab === "sample" && this.data) this.drawTokenChart();
  }

  // ---- rollout table (miles/dashboard/static/table.js) ----
  async pollSteps() {
    const { steps } = await getJSON(api("/api/steps"));
    $("rollouts-empty").hidden = steps.length > 0;
    $("rollout-view").hidden = steps.length === 0;
    if (steps.length === this.steps.length && steps.at(-1)?.step === this.steps.at(-1)?.step) return;
    this.steps = steps;
    const select = $("step-select");
    select.innerHTML = steps.map((s) => `<option value="${s.step}">${s.step}</option>`).join("");
    if (this.followLatest && steps.length) this.tableStep = steps.at(-1).step;
    if (this.tableStep !== null) select.value = String(this.tableStep);
    if (this.tab === "rollouts" && this.tableStep !== null) await this.loadTable(this.tableStep);
  }

  bindTable() {
    $("step-select").onchange = (e) => { this.followLatest = false; location.hash = `#rollouts/${e.target.value}`; };
    $("rollout-table").querySelector("tbody").onclick = (e) => {
      const tr = e.target.closest("tr[data-row]");
      if (tr) location.hash = `#sample/${this.tableStep}/${tr.dataset.row}`;
    };
  }

  async loadTable(step) {
    const { samples } = await getJSON(api(`/api/steps/${step}/samples`));
    this.tableStep = step;
    $("step-select").value = String(step);
    const s = this.steps.find((x) => x.step === step);
    $("step-summary").textContent = s ? `${s.num_samples} samples · ${s.num_tokens.toLocaleString()} tokens · mean reward ${formatValue(s.mean_reward)}` : "";
    this.table.show(samples);
  }

  // ---- sample view ----
  bindSampleControls() {
    const select = $("color-by");
    select.innerHTML = Object.entries(STATS).map(([k, v]) => `<option value="${k}">${v.label}</option>`).join("");
    select.onchange = () => this.recolor(select.value);
    $("prev-sample").onclick = () => this.stepSample(-1);
    $("next-sample").onclick = () => this.stepSample(+1);
    const strip = $("strip");
    const tip = $("tooltip");
    strip.addEventListener("mouseover", (e) => {
      const i = this.strip.tokenAt(e.target);
      if (i < 0) { tip.hidden = true; return; }
      tip.textContent = this.tokenStats(i);
      tip.hidden = false;
    });
    strip.addEventListener("mousemove", (e) => {
      tip.style.left = `${Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8)}px`;
      tip.style.top = `${Math.min(e.clientY + 16, window.innerHeight - tip.offsetHeight - 8)}px`;
    });
    strip.addEventListener("mouseleave", () => { tip.hidden = true; });
    let queued = false;
    strip.addEventListener("scroll", () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => { queued = false; this.drawTokenChart(); });
    });
    $("token-chart").onclick = (e) => { if (this.chart) this.strip.scrollToToken(this.chart.toToken(e.offsetX)); };
    document.addEventListener("keydown", (e) => {  // [ and ] step through the samples of a step
      if (this.tab !== "sample" || e.target.closest?.("select, input")) return;
      if (e.key === "[") this.stepSample(-1);
      if (e.key === "]") this.stepSample(+1);
    });
  }

  stepSample(delta) {
    if (!this.data) return;
    const row = this.data.sample.row + delta;
    if (row >= 0 && row < this.data.header.step_num_samples) location.hash = `#sample/${this.data.header.step}/${row}`;
  }

  // A multi-turn sample's turns as buttons (click: scroll the strip there), with the tool calls each model turn made.
  showTurns(data) {
    const el = $("turns");
    const spans = data.sample.spans ?? [];
    const turns = spans.filter((s) => s.kind === "model" || s.kind === "env");
    el.hidden = !turns.length;
    el.textContent = "";
    if (!turns.length) return;
    for (const t of turns) {
      const calls = spans.filter((s) => s.kind === "tool_call" && s.start >= t.start && s.end <= t.end).map((s) => s.label);
      const results = spans.filter((s) => s.kind === "tool_result" && s.start >= t.start && s.end <= t.end).length;
      const b = document.createElement("button");
      b.className = t.kind;
      b.dataset.start = String(t.start);
      b.textContent = `${t.kind === "model" ? "model" : "env"} ${t.turn}` +
        (calls.length ? ` · call ${calls.join(", ")}` : "") + (results ? ` · ${results} result${results > 1 ? "s" : ""}` : "") +
        ` · ${t.end - t.start} tok`;
      b.onclick = () => this.strip.scrollToToken(t.start);
      el.appendChild(b);
    }
    const key = document.createElement("span");
    key.className = "key muted";
    key.innerHTML = `<i style="color:#18181b"></i>turn start<i style="color:#16a34a"></i>tool call<i style="color:#ea580c"></i>tool result · faded: loss mask 0`;
    el.appendChild(key);
  }

  tokenStats(i) {
    const d = this.data;
    const f = (v) => (Number.isFinite(v) ? v.toFixed(4) : "–");
    const text = JSON.stringify(d.text.slice(d.textStart[i], d.textStart[i + 1]));
    const prompt = i < d.promptLen;  // a prompt token was not sampled: it has no rollout log-prob to compare with
    const p = d.parts;
    const part = p.bits[i] & 2 ? " · tool call" : p.bits[i] & 4 ? " · tool result" : "";
    const turn = p.any && !prompt ? `, ${p.kind[i] || "?"} turn ${p.turn[i]}${part}` : "";
    const where = (prompt ? "prompt" : `response #${i - d.promptLen}`) + turn;
    return [`token ${i} (${where})  id ${d.tokens[i]}  ${text}`,
      `loss mask      ${d.mask[i]}`,
      `rollout logp   ${prompt ? "– (prompt token: not sampled)" : f(d.stats.rollout_log_probs[i])}`,
      `train logp     ${f(d.stats.train_log_probs[i])}`,
      `train−rollout  ${prompt ? "–" : f(d.stats.diff[i])}`,
      `advantage      ${f(d.stats.advantages[i])}`,
      `entropy        ${f(d.stats.entropy[i])}`,
      `weight version ${Number.isFinite(d.stats.weight_versions[i]) ? d.stats.weight_versions[i] : "–"}`].join("\n");
  }

  // The Sample tab never opens empty: without a chosen sample it shows the latest step's first one, and says so.
  openDefaultSample() {
    const latest = this.steps.at(-1);
    $("sample-empty").hidden = Boolean(latest);
    if (!latest) { $("pane-sample").dataset.state = "empty"; return; }
    $("sample-hint").textContent = `showing the latest step's first sample; pick another in the Rollouts tab`;
    this.openSample(latest.step, 0);
  }

  // One request per sample: the binary payload feeds the conversation, the strip and the per-token chart.
  async openSample(step, row) {
    const key = `${step}/${row}`;
    if (key === this.sampleKey) return;
    if (location.hash.startsWith("#sample/")) $("sample-hint").textContent = "";
    this.sampleKey = key;
    const seq = ++this.loadSeq;
    const pane = $("pane-sample");
    pane.dataset.state = "loading";
    $("sample-status").textContent = "loading…";
    $("sample-title").textContent = `step ${step} · sample ${row}`;
    let data;
    try {
      const r = await fetch(api(`/api/steps/${step}/samples/${row}`));
      if (!r.ok) throw new Error((await r.json()).detail ?? `HTTP ${r.status}`);
      data = parseSample(await r.arrayBuffer());
    } catch (e) {
      if (seq === this.loadSeq) {
        pane.dataset.state = "error";
        $("sample-status").textContent = String(e.message);
        this.sampleKey = null;  // asking for it again retries
      }
      return;
    }
    if (seq !== this.loadSeq) return;  // a newer sample was asked for meanwhile
    this.showSample(data);
  }

  showSample(data) {
    const t0 = performance.now();
    this.data = data;
    const s = data.sample;
    $("sample-title").textContent = `step ${data.header.step} · sample ${s.row} · group ${s.group ?? "–"} · reward ${formatValue(s.reward)}`;
    $("prompt-text").textContent = s.prompt_text;
    $("response-text").textContent = s.response_text;
    this.strip.stat = $("color-by").value;
    this.strip.build(data);
    this.showTurns(data);
    this.updateLegend();
    const extras = Object.entries(s).filter(([k, v]) => !SAMPLE_FIELDS.has(k) && v !== null && typeof v !== "object")
      .map(([k, v]) => `${k}: ${String(v).slice(0, 60)}`);
    $("sample-status").textContent = [`${data.n.toLocaleString()} tokens (${data.promptLen} prompt)`, s.finish_reason,
      `weights v${s.weight_version ?? "–"}`, ...extras, `built in ${(performance.now() - t0).toFixed(0)} ms`].filter(Boolean).join(" · ");
    $("pane-sample").dataset.state = "ready";
    this.strip.onShown(() => {
      this.strip.scrollToToken(data.promptLen);
      this.drawTokenChart();
      $("pane-sample").dataset.scrolled = this.sampleKey;
    });
  }

  recolor(stat) {
    this.strip.recolor(stat);
    this.updateLegend();
    this.drawTokenChart();
  }

  updateLegend() {
    const stat = this.strip.stat;
    if (!this.data || stat === "none") { $("legend").innerHTML = ""; return; }
    const { scale, low } = colorScale(this.data, stat);
    const bar = STATS[stat].diverging ? "linear-gradient(90deg, rgba(37,99,235,.8), #fff, rgba(220,38,38,.8))"
      : "linear-gradient(90deg, #fff, rgba(124,58,237,.8))";
    const lo = STATS[stat].diverging ? formatValue(-scale) : low !== undefined ? `v${low}` : "0";
    const hi = low !== undefined ? `v${scale}` : formatValue(scale);
    $("legend").innerHTML = `${lo}<span class="bar" style="background:${bar}"></span>${hi}`;
  }

  visibleTokens() {
    const el = this.strip.el;
    const r = el.getBoundingClientRect();
    if (!r.height) return null;
    const at = (y) => {
      const hit = document.elementFromPoint(r.left + 80, y);
      if (!hit || !el.contains(hit)) return -1;
      return hit.classList.contains("blk") ? Number(hit.dataset.start) : this.strip.tokenAt(hit);
    };
    const first = at(r.top + 8);
    const last = at(r.bottom - 8);
    if (first < 0) return null;
    return [first, last < 0 ? this.data.n : last];
  }

  drawTokenChart() {
    if (!this.data || this.tab !== "sample") return;
    const stat = this.strip.stat === "none" ? "diff" : this.strip.stat;
    this.chart = drawTokenChart($("token-chart"), this.data, stat, this.visibleTokens());
  }
}

window.miles = new Dashboard();
window.miles.start();

// The dashboard page: tabs over one run directory (metrics, memory timeline, rollout table, sample view).
// Panes are hidden, never detached, so a built token strip keeps its DOM and scroll position across tab
// switches. The URL hash is the route: #metrics, #memory, #rollouts/STEP, #sample/STEP/ROW.

import { TokenStrip, parseSample, colorScale, STATS } from "./strip.js";
import { drawLineChart, drawTokenChart, formatValue, formatBytes, PALETTE } from "./charts.js";
import { drawPool, memoryColors, memorySeries } from "./memory.js";
import { describe } from "./describe.js";

const $ = (id) => document.getElementById(id);
const TABS = ["metrics", "memory", "rollouts", "sample"];
const FIRST_METRICS = ["reward", "loss", "kl", "entropy", "tokens_per_s"];
const POLL_MS = 2000;
const SAMPLE_FIELDS = new Set(["index", "group", "reward", "weight_version", "finish_reason", "row", "num_tokens",
  "prompt_len", "response_len", "token_start", "token_text_start", "token_text_bytes", "text", "preview",
  "prompt_text", "response_text"]);

async function getJSON(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

const escapeHTML = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

class Dashboard {
  constructor() {
    this.metrics = [];
    this.metricsOffset = 0;
    this.ledger = [];
    this.ledgerOffset = 0;
    this.steps = [];
    this.tableStep = null;
    this.followLatest = true;
    this.samples = [];
    this.sort = { key: "row", dir: "asc" };
    this.sampleKey = null;  // "step/row" of the sample in the strip
    this.data = null;
    this.loadSeq = 0;
    this.dirty = { metrics: true, memory: true };
    this.tab = null;
    this.strip = new TokenStrip($("strip"));
  }

  async start() {
    const info = await getJSON("/api/info");
    $("run-name").textContent = info.name;
    document.title = `miles · ${info.name}`;
    $("live").textContent = info.follow ? "● live" : "";
    for (const b of document.querySelectorAll("#tabs button")) b.onclick = () => this.openTab(b.dataset.tab);
    this.bindSampleControls();
    this.bindTable();
    $("memory-setup").onchange = () => { this.dirty.memory = true; this.renderVisible(); };
    getJSON("/api/plan").then((plan) => { this.plan = plan; this.dirty.memory = true; this.renderVisible(); }).catch(() => {});
    await Promise.all([this.pollJsonl("metrics"), this.pollJsonl("ledger"), this.pollSteps()]);
    window.addEventListener("hashchange", () => this.route());
    window.addEventListener("resize", () => { this.dirty.metrics = this.dirty.memory = true; this.renderVisible(); });
    this.route();
    if (info.follow) setInterval(() => this.poll(), POLL_MS);
    document.body.dataset.ready = "1";
  }

  async poll() {
    try {
      await Promise.all([this.pollJsonl("metrics"), this.pollJsonl("ledger"), this.pollSteps()]);
      this.renderVisible();
    } catch (e) {
      $("live").textContent = `● offline (${e.message})`;
    }
  }

  async pollJsonl(name) {
    for (;;) {  // the server returns at most a few MiB per call: keep reading until caught up
      const offset = this[`${name}Offset`];
      const page = await getJSON(`/api/${name}?offset=${offset}`);
      if (page.rows.length) { this[name].push(...page.rows); this.dirty[name === "ledger" ? "memory" : "metrics"] = true; }
      this[`${name}Offset`] = page.next_offset;
      if (page.next_offset === offset || !page.rows.length) return;
    }
  }

  async pollSteps() {
    const { steps } = await getJSON("/api/steps");
    $("rollouts-empty").hidden = steps.length > 0;
    $("rollout-table").hidden = steps.length === 0;
    if (steps.length === this.steps.length && steps.at(-1)?.step === this.steps.at(-1)?.step) return;
    this.steps = steps;
    const select = $("step-select");
    select.innerHTML = steps.map((s) => `<option value="${s.step}">${s.step}</option>`).join("");
    if (this.followLatest && steps.length) this.tableStep = steps.at(-1).step;
    if (this.tableStep !== null) select.value = String(this.tableStep);
    $("rollouts-empty").hidden = steps.length > 0;
    if (this.tab === "rollouts" && this.tableStep !== null) await this.loadTable(this.tableStep);
  }

  // ---- routing and tabs ----
  route() {
    const [tab, a, b] = (location.hash.slice(1) || "metrics").split("/");
    const name = TABS.includes(tab) ? tab : "metrics";
    if (name === "rollouts" && a !== undefined && /^\d+$/.test(a)) { this.tableStep = Number(a); this.followLatest = false; }
    this.showTab(name);
    if (name === "rollouts" && this.tableStep !== null) this.loadTable(this.tableStep);
    if (name === "sample" && /^\d+$/.test(a ?? "") && /^\d+$/.test(b ?? "")) this.openSample(Number(a), Number(b));
    else if (name === "sample" && !this.sampleKey) this.openDefaultSample();
  }

  openTab(name) {
    if (name === "sample" && this.sampleKey) location.hash = `#sample/${this.sampleKey}`;
    else if (name === "rollouts" && this.tableStep !== null) location.hash = `#rollouts/${this.tableStep}`;
    else location.hash = `#${name}`;
  }

  showTab(name) {
    if (this.tab === "sample" && name !== "sample") this.rememberStripScroll();
    this.tab = name;
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
    if (this.tab === "memory" && this.dirty.memory) { this.renderMemory(); this.dirty.memory = false; }
    if (this.tab === "sample" && this.data) this.drawTokenChart();
  }

  // ---- metrics ----
  renderMetrics() {
    $("metrics-empty").hidden = this.metrics.length > 0;
    const root = $("metrics-groups");
    root.textContent = "";
    let color = 0;
    for (const [group, series] of metricSeries(this.metrics)) {
      root.insertAdjacentHTML("beforeend", `<h2>${escapeHTML(group)}</h2><div class="grid"></div>`);
      const grid = root.lastElementChild;
      for (const { key, xs, ys } of series) {
        const card = document.createElement("div");
        card.className = "card";
        card.dataset.metric = key;
        const fmt = (v) => formatValue(v, key);
        card.innerHTML = `<div class="title"><b title="${escapeHTML(describe(key))}">${escapeHTML(key)}</b><span>${fmt(ys.at(-1))}</span></div><canvas></canvas>`;
        grid.appendChild(card);
        const canvas = card.querySelector("canvas");
        const chart = drawLineChart(canvas, xs, ys, { key, color: PALETTE[color++ % PALETTE.length] });
        const label = card.querySelector(".title span");
        canvas.onmousemove = (e) => {
          let best = 0;
          for (let i = 1; i < xs.length; i++) if (Math.abs(chart.X(xs[i]) - e.offsetX) < Math.abs(chart.X(xs[best]) - e.offsetX)) best = i;
          label.textContent = `step ${xs[best]}: ${fmt(ys[best])}`;
        };
        canvas.onmouseleave = () => { label.textContent = fmt(ys.at(-1)); };
      }
    }
  }

  // ---- memory (miles/dashboard/static/memory.js) ----
  renderMemory() {
    const setup = $("memory-setup").checked;
    const series = memorySeries(this.ledger, { setup });
    $("memory-empty").hidden = this.ledger.length > 0;
    const colors = memoryColors(this.ledger);
    $("memory-legend").innerHTML = Object.entries(colors).map(([k, c]) => `<span><i style="background:${c}"></i>${escapeHTML(k)}</span>`).join("");
    const plan = this.plan ?? {};
    $("memory-plan").textContent = plan.available ? `planner: ${plan.hardware} profile, peak device ${plan.mode}` : (plan.reason ? `no planner overlay: ${plan.reason}` : "");
    const root = $("memory-pools");
    root.textContent = "";
    for (const [pool, p] of Object.entries(series.pools)) {
      const card = document.createElement("div");
      card.className = "card";
      card.dataset.pool = pool;
      card.dataset.peak = String(p.peak);
      card.dataset.events = String(p.held.length);
      const planned = plan.available ? plan.peaks?.[pool] ?? null : null;
      const budget = plan.available ? plan.budget?.[pool] ?? null : null;
      if (planned !== null) card.dataset.planned = String(planned);
      if (budget !== null) card.dataset.budget = String(budget);
      const facts = [`peak over RL steps ${formatBytes(p.peak)} (= max of mem/${pool}_peak)`,
        p.setupPeak ? `setup peak ${formatBytes(p.setupPeak)}` : "", planned !== null ? `planner ${formatBytes(planned)}` : "",
        budget !== null ? `budget ${formatBytes(budget)}` : ""].filter(Boolean).join(" · ");
      card.innerHTML = `<div class="title"><b>${escapeHTML(pool)}</b><span class="facts">${escapeHTML(facts)}</span></div><canvas></canvas><div class="hover muted">&nbsp;</div>`;
      root.appendChild(card);
      const canvas = card.querySelector("canvas");
      const chart = drawPool(canvas, p, colors, { planned, budget });
      const hover = card.querySelector(".hover");
      canvas.onmousemove = (e) => {
        const i = Math.min(p.rows.length - 1, Math.max(0, Math.floor(((e.offsetX - 64) / (canvas.clientWidth - 76)) * chart.n)));
        if (i < 0 || !p.rows.length) return;
        const parts = p.keys.map((k, j) => (p.rows[i][j] ? `${k} ${formatBytes(p.rows[i][j])}` : "")).filter(Boolean);
        const step = p.stepOf[i] < 0 ? "setup" : `step ${p.stepOf[i]}`;
        hover.textContent = `${step} · event ${i} · ${p.phases[i]}: ${parts.join(", ") || "empty"}`;
      };
      canvas.onmouseleave = () => { hover.innerHTML = "&nbsp;"; };
    }
  }

  // ---- rollout table ----
  bindTable() {
    $("step-select").onchange = (e) => { this.followLatest = false; location.hash = `#rollouts/${e.target.value}`; };
    for (const th of document.querySelectorAll("#rollout-table th")) {
      th.onclick = () => {
        const key = th.dataset.key;
        this.sort = { key, dir: this.sort.key === key && this.sort.dir === "asc" ? "desc" : "asc" };
        this.renderTable();
      };
    }
    $("rollout-table").querySelector("tbody").onclick = (e) => {
      const tr = e.target.closest("tr[data-row]");
      if (tr) location.hash = `#sample/${this.tableStep}/${tr.dataset.row}`;
    };
  }

  async loadTable(step) {
    const { samples } = await getJSON(`/api/steps/${step}/samples`);
    this.tableStep = step;
    this.samples = samples;
    $("step-select").value = String(step);
    const s = this.steps.find((x) => x.step === step);
    $("step-summary").textContent = s ? `${s.num_samples} samples · ${s.num_tokens.toLocaleString()} tokens · mean reward ${formatValue(s.mean_reward)}` : "";
    this.renderTable();
  }

  renderTable() {
    const { key, dir } = this.sort;
    const sign = dir === "asc" ? 1 : -1;
    const rows = [...this.samples].sort((a, b) => {
      const x = a[key] ?? -Infinity;
      const y = b[key] ?? -Infinity;
      return (x < y ? -1 : x > y ? 1 : a.row - b.row) * sign;
    });
    for (const th of document.querySelectorAll("#rollout-table th")) th.dataset.dir = th.dataset.key === key ? dir : "";
    const maxReward = Math.max(1e-9, ...this.samples.map((s) => Math.abs(s.reward ?? 0)));
    $("rollout-table").querySelector("tbody").innerHTML = rows.map((s) => `<tr data-row="${s.row}">
      <td class="num">${s.row}</td>
      <td><span class="chip" style="background:${PALETTE[(s.group ?? 0) % PALETTE.length]}"></span>${escapeHTML(s.group)}</td>
      <td class="num">${formatValue(s.reward)}<span class="reward-bar" style="width:${Math.round(40 * Math.abs(s.reward ?? 0) / maxReward)}px"></span></td>
      <td class="num">${s.num_tokens}</td><td class="num">${s.response_len}</td>
      <td>${escapeHTML(s.finish_reason)}</td><td class="num">${escapeHTML(s.weight_version)}</td>
      <td class="wide">${escapeHTML(s.preview)}</td></tr>`).join("");
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

  tokenStats(i) {
    const d = this.data;
    const f = (v) => (Number.isFinite(v) ? v.toFixed(4) : "–");
    const text = JSON.stringify(d.text.slice(d.textStart[i], d.textStart[i + 1]));
    const where = i < d.promptLen ? "prompt" : `response #${i - d.promptLen}`;
    return [`token ${i} (${where})  id ${d.tokens[i]}  ${text}`,
      `loss mask      ${d.mask[i]}`,
      `rollout logp   ${f(d.stats.rollout_log_probs[i])}`,
      `train logp     ${f(d.stats.train_log_probs[i])}`,
      `train−rollout  ${f(d.stats.diff[i])}`,
      `advantage      ${f(d.stats.advantages[i])}`,
      `entropy        ${f(d.stats.entropy[i])}`].join("\n");
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
      const r = await fetch(`/api/steps/${step}/samples/${row}`);
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
    const { scale } = colorScale(this.data, stat);
    const bar = STATS[stat].diverging ? "linear-gradient(90deg, rgba(37,99,235,.8), #fff, rgba(220,38,38,.8))"
      : "linear-gradient(90deg, #fff, rgba(124,58,237,.8))";
    const lo = STATS[stat].diverging ? formatValue(-scale) : "0";
    $("legend").innerHTML = `${lo}<span class="bar" style="background:${bar}"></span>${formatValue(scale)}`;
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

// Metric rows -> [[group, [{key, xs, ys}]]]: RL rows by step, grouped by key prefix (time/, mem/, ...);
// rows of another phase (e.g. "sft" warm-up) form their own group, plotted against their own counter.
export function metricSeries(rows) {
  const series = new Map();
  rows.forEach((r, i) => {
    const phase = r.phase && r.phase !== "rl" ? r.phase : "";
    const x = phase ? (r[`${phase}_step`] ?? i) : (typeof r.step === "number" ? r.step : i);
    for (const [k, v] of Object.entries(r)) {
      if (typeof v !== "number" || k === "step" || k === `${phase}_step`) continue;
      const key = phase ? `${phase}/${k}` : k;
      if (!series.has(key)) series.set(key, { key, xs: [], ys: [] });
      series.get(key).xs.push(x);
      series.get(key).ys.push(v);
    }
  });
  const groupOf = (key) => (key.includes("/") ? key.split("/")[0] : "training");
  const rank = (key) => { const i = FIRST_METRICS.indexOf(key); return i < 0 ? FIRST_METRICS.length : i; };
  const keys = [...series.keys()].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
  const groups = new Map([["training", []]]);
  for (const key of keys) {
    if (!groups.has(groupOf(key))) groups.set(groupOf(key), []);
    groups.get(groupOf(key)).push(series.get(key));
  }
  return [...groups].filter(([, list]) => list.length);
}

window.miles = new Dashboard();
window.miles.start();

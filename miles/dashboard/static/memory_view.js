// The Memory tab: a window of RL steps (the last 10 by default, so a 100-step run is not squeezed into one chart),
// picked on the overview strip (drag a range, or click to move the window), with the from/to boxes, the arrows or
// the span menu, and kept in the URL (#memory/25-34). Each pool draws the window's events with a tooltip per event;
// each step peak above the planner's line is marked on the chart and listed under it with its cause.
//
//   const view = new MemoryView(document, tooltip);
//   view.render({ ledger, plan, checkpoints });   // after new ledger rows, a resize, a new window
//   view.pin(25, 34);                             // a window from the URL (steps, inclusive)

import { formatBytes } from "./charts.js";
import { groupPeaks, memoryColors, memorySeries, peaksAbovePlan } from "./memory.js";
import { drawOverview, drawPool } from "./memory_chart.js";

const escapeHTML = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
export const DEFAULT_SPAN = 10;

export class MemoryView {
  constructor(doc, tooltip) {
    this.$ = (id) => doc.getElementById(id);
    this.tooltip = tooltip;
    this.span = DEFAULT_SPAN;
    this.pinned = null;  // [fromStep, toStep] chosen by the reader; null follows the newest steps
    this.input = null;
    this.bind();
  }

  bind() {
    const $ = this.$;
    $("memory-span").onchange = (e) => {
      this.span = e.target.value === "all" ? Infinity : Number(e.target.value);
      const [a] = this.window ?? [0];
      this.setWindow(a, a + this.span - 1);
    };
    $("memory-prev").onclick = () => this.shift(-1);
    $("memory-next").onclick = () => this.shift(+1);
    const typed = () => this.pickSteps(Number($("memory-from").value), Number($("memory-to").value));
    $("memory-from").onchange = typed;
    $("memory-to").onchange = typed;
    const overview = $("memory-overview");
    overview.onmousedown = (e) => { this.dragFrom = this.overview?.at(e.offsetX); e.preventDefault(); };
    overview.onmousemove = (e) => this.overviewHover(e);
    overview.onmouseleave = () => { this.tooltip.hidden = true; };
    window.addEventListener("mouseup", (e) => {
      if (this.dragFrom === undefined || this.dragFrom === null || !this.overview) return;
      const r = overview.getBoundingClientRect();
      const k = this.overview.at(e.clientX - r.left);
      const from = this.dragFrom;
      this.dragFrom = null;
      if (k === from) this.setWindow(k - Math.floor((this.windowSize() - 1) / 2), k + Math.ceil((this.windowSize() - 1) / 2));
      else this.setWindow(Math.min(k, from), Math.max(k, from));
    });
  }

  // A window from the URL or the boxes, in step numbers (inclusive).
  pin(fromStep, toStep) {
    this.pinned = [Math.min(fromStep, toStep), Math.max(fromStep, toStep)];
  }

  pickSteps(fromStep, toStep) {
    if (!Number.isFinite(fromStep) || !Number.isFinite(toStep)) return;
    this.pin(fromStep, toStep);
    this.commit();
  }

  windowSize() { return this.window ? this.window[1] - this.window[0] + 1 : this.span; }

  showsAll() { return Boolean(this.window) && this.window[0] === 0 && this.window[1] === this.steps.length - 1; }

  shift(direction) {
    if (!this.window) return;
    const size = this.windowSize();
    this.setWindow(this.window[0] + direction * size, this.window[1] + direction * size);
  }

  // A window in positions of the step list, clamped to it, kept as step numbers.
  setWindow(a, b) {
    const n = this.steps?.length ?? 0;
    if (!n) return;
    const size = Math.min(n, b - a + 1);
    const from = Math.max(0, Math.min(a, n - size));
    this.pinned = [this.steps[from], this.steps[from + size - 1]];
    this.commit();
  }

  // The route of the window shown: #memory/FROM-TO when the reader picked it, #memory when it follows the newest.
  hash() {
    if (!this.pinned || !this.window) return "#memory";
    return `#memory/${this.steps[this.window[0]]}-${this.steps[this.window[1]]}`;
  }

  commit() {
    this.render(this.input);
    history.replaceState(null, "", this.hash());
  }

  resolveWindow(steps) {
    const n = steps.length;
    if (!this.pinned) return [Math.max(0, n - Math.min(this.span, n)), n - 1];
    let a = steps.findIndex((s) => s >= this.pinned[0]);
    if (a < 0) a = n - 1;
    let b = steps.length - 1;
    while (b > a && steps[b] > this.pinned[1]) b--;
    return [a, b];
  }

  render(input) {
    if (!input) return;
    this.input = input;
    const $ = this.$;
    const { ledger, plan = {}, checkpoints = [] } = input;
    const series = memorySeries(ledger, { setup: $("memory-setup").checked });
    this.series = series;
    $("memory-empty").hidden = ledger.length > 0;
    $("memory-picker").hidden = ledger.length === 0;
    this.steps = [...new Set(series.steps.map((s) => s.step))];
    this.window = this.steps.length ? this.resolveWindow(this.steps) : null;
    const colors = memoryColors(ledger);
    $("memory-legend").innerHTML = Object.entries(colors).map(([k, c]) => `<span><i style="background:${c}"></i>${escapeHTML(k)}</span>`).join("");
    $("memory-plan").textContent = plan.available ? `planner: ${plan.hardware} profile, peak device ${plan.mode}` : (plan.reason ? `no planner overlay: ${plan.reason}` : "");
    const pools = Object.entries(series.pools).map(([pool, p]) => {
      const planned = plan.available ? plan.peaks?.[pool] ?? null : null;
      return { pool, p, planned, budget: plan.available ? plan.budget?.[pool] ?? null : null, peaks: peaksAbovePlan(p, planned, checkpoints) };
    });
    this.pools = pools;
    this.renderPicker(pools);
    const root = $("memory-pools");
    root.textContent = "";
    this.charts = {};  // pool -> drawn chart (its X map, for the hover and the tests)
    for (const pool of pools) this.poolCard(root, pool, colors);
  }

  renderPicker(pools) {
    const $ = this.$;
    const pane = $("pane-memory");
    if (!this.window) { delete pane.dataset.window; return; }
    const [a, b] = this.window;
    const [from, to] = [this.steps[a], this.steps[b]];
    pane.dataset.window = `${from}-${to}`;
    $("memory-from").value = String(from);
    $("memory-to").value = String(to);
    const span = $("memory-span");  // the menu names the window's size, whichever control set it
    const size = this.showsAll() ? "all" : String(b - a + 1);
    span.querySelector("option[data-custom]")?.remove();
    if (![...span.options].some((o) => o.value === size)) span.insertAdjacentHTML("beforeend", `<option value="${size}" data-custom hidden>${size} steps</option>`);
    span.value = size;
    $("memory-prev").disabled = a === 0;
    $("memory-next").disabled = b === this.steps.length - 1;
    const rows = pools.map(({ pool, p, planned }) => ({ pool, planned, peaks: { ...p.stepPeaks, "-1": p.setupPeak } }));
    this.overview = drawOverview($("memory-overview"), this.steps, rows, [a, b]);
  }

  poolCard(root, { pool, p, planned, budget, peaks }, colors) {
    const card = document.createElement("div");
    card.className = "card";
    card.dataset.pool = pool;
    card.dataset.peak = String(p.peak);
    card.dataset.events = String(p.held.length);
    if (planned !== null) card.dataset.planned = String(planned);
    if (budget !== null) card.dataset.budget = String(budget);
    const facts = [`peak over RL steps ${formatBytes(p.peak)} (= max of mem/${pool}_peak)`,
      p.setupPeak ? `setup peak ${formatBytes(p.setupPeak)}` : "", planned !== null ? `planner ${formatBytes(planned)}` : "",
      budget !== null ? `budget ${formatBytes(budget)}` : ""].filter(Boolean).join(" · ");
    card.innerHTML = `<div class="title"><b>${escapeHTML(pool)}</b><span class="facts">${escapeHTML(facts)}</span></div>`
      + `<div class="plot"><canvas></canvas><div class="cursor" hidden></div></div><ul class="peaks"></ul>`;
    const [a, b] = this.eventRange(p);
    card.dataset.shown = String(b - a);
    root.appendChild(card);  // in the page before drawing: the canvas takes the card's width
    const canvas = card.querySelector("canvas");
    const chart = drawPool(canvas, p, colors, { a, b, planned, budget, peaks });
    this.charts[pool] = chart;
    canvas.onmousemove = (e) => this.poolHover(card, chart, p, planned, peaks, e);
    canvas.onmouseleave = () => { this.tooltip.hidden = true; card.querySelector(".cursor").hidden = true; };
    this.peakList(card.querySelector(".peaks"), peaks, planned);
  }

  // The events of p that fall in the window's steps: [a, b).
  eventRange(p) {
    if (!this.window) return [0, p.rows.length];
    const [lo, hi] = [this.steps[this.window[0]], this.steps[this.window[1]]];
    let a = p.stepOf.findIndex((s) => s >= lo);
    if (a < 0) return [p.rows.length, p.rows.length];
    let b = a;
    while (b < p.stepOf.length && p.stepOf[b] <= hi) b++;
    return [a, b];
  }

  peakList(ul, peaks, planned) {
    ul.innerHTML = groupPeaks(peaks).map((g) => {
      const steps = g.steps.slice(0, 12).map((s) => `<a href="#memory/${s}-${s}" data-step="${s}">${s}</a>`).join(", ")
        + (g.steps.length > 12 ? ` and ${g.steps.length - 12} more` : "");
      const cause = g.checkpoints.length ? `checkpoint${g.checkpoints.length > 1 ? "s" : ""} ${g.checkpoints.slice(0, 6).join(", ")}${g.checkpoints.length > 6 ? ", …" : ""} saved` : g.cause;
      return `<li><b>▲ step${g.steps.length > 1 ? "s" : ""} ${steps}</b> · ${formatBytes(g.peak)}, ${formatBytes(g.peak - planned)} over the planner · `
        + `<b>${escapeHTML(cause)}</b>: ${escapeHTML(g.detail)}</li>`;
    }).join("");
    ul.hidden = peaks.length === 0;
    ul.onclick = (e) => {  // a step link centres the window on that step
      const a = e.target.closest("a[data-step]");
      if (!a) return;
      e.preventDefault();
      const k = this.steps.indexOf(Number(a.dataset.step));
      const size = this.windowSize();
      this.setWindow(k - Math.floor((size - 1) / 2), k + Math.ceil((size - 1) / 2));
    };
  }

  poolHover(card, chart, p, planned, peaks, e) {
    const i = chart.at(e.offsetX);
    const cursor = card.querySelector(".cursor");
    if (i < chart.a || i >= chart.b) { this.tooltip.hidden = true; cursor.hidden = true; return; }
    cursor.hidden = false;
    cursor.style.left = `${(chart.X(i) + chart.X(i + 1)) / 2}px`;
    const ev = p.events[i];
    const step = p.stepOf[i];
    const nth = i - p.stepFirst[step] + 1;
    const ofStep = p.stepOf.filter((s) => s === step).length;
    const sign = ev.direction === "out" ? "−" : "+";
    const total = p.totals[i];
    const lines = [`${step < 0 ? "setup" : `step ${step}`} · event ${nth} of ${ofStep} · ${p.phases[i] || "no phase"}`,
      `${ev.owner} ${ev.tag} ${sign}${formatBytes(ev.bytes)}`,
      `held ${formatBytes(total)}${planned !== null ? `   planner ${formatBytes(planned)} (${total > planned ? "+" : ""}${formatBytes(total - planned)})` : ""}`];
    const width = Math.max(...p.keys.map((k) => k.length));
    p.keys.forEach((k, c) => { if (p.rows[i][c]) lines.push(`  ${k.padEnd(width)}  ${formatBytes(p.rows[i][c]).padStart(9)}`); });
    const peak = peaks.find((q) => q.step === step);
    if (peak) lines.push(`▲ step ${step} peaks at ${formatBytes(peak.peak)}: ${peak.cause}`);
    this.show(lines.join("\n"), e);
  }

  overviewHover(e) {
    if (!this.overview || !this.pools) return;
    const step = this.steps[this.overview.at(e.offsetX)];
    const parts = this.pools.map(({ pool, p, planned }) => {
      const v = step < 0 ? p.setupPeak : p.stepPeaks[step];
      return v === undefined ? "" : `${pool} ${formatBytes(v)}${planned !== null && v > planned ? " ▲" : ""}`;
    }).filter(Boolean);
    this.show(`${step < 0 ? "setup" : `step ${step}`} · peak ${parts.join(" · ")}\nclick: show steps around it · drag: pick a range`, e);
  }

  show(text, e) {
    const tip = this.tooltip;
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = `${Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8)}px`;
    tip.style.top = `${Math.min(e.clientY + 16, window.innerHeight - tip.offsetHeight - 8)}px`;
  }
}

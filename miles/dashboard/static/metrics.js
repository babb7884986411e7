// The Metrics tab: one small chart per metric, grouped by key prefix, with TensorBoard's basics: a filter over the
// metric names (a regular expression, or plain text where it is not one), EMA smoothing drawn over the faint raw
// line, a readout of every visible chart at the hovered step (a cursor line on each, a tooltip on the one under the
// pointer), and a second run of the same folder drawn dashed on the same axes.

import { drawLineChart, formatValue, PALETTE, smooth, yBounds } from "./charts.js";
import { describe } from "./describe.js";

const FIRST_METRICS = ["reward", "loss", "kl", "entropy", "tokens_per_s"];
const RUN_COLORS = [PALETTE[0], PALETTE[9]];  // this run, the overlaid run

const escapeHTML = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// Metric rows -> [[group, [{key, xs, ys}]]]: RL rows by step, grouped by key prefix (time/, mem/, ...);
// rows of another phase (e.g. "sft" warm-up) form their own group, plotted against their own counter.
export function metricSeries(rows) {
  const series = new Map();
  rows.forEach((r, i) => {
    const phase = r.phase && r.phase !== "rl" ? r.phase : "";
    const x = phase ? (r[`${phase}_step`] ?? r.step ?? i) : (typeof r.step === "number" ? r.step : i);
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

// The filter box: a case-insensitive regular expression; text that does not parse as one matches as plain text.
export function metricFilter(text) {
  const t = (text ?? "").trim();
  if (!t) return () => true;
  try {
    const re = new RegExp(t, "i");
    return (key) => re.test(key);
  } catch {
    const low = t.toLowerCase();
    return (key) => key.toLowerCase().includes(low);
  }
}

// The index of the x nearest to `x` in ascending xs (binary search; a resumed run may repeat a step).
export function nearestIndex(xs, x) {
  if (!xs.length) return -1;
  let lo = 0;
  let hi = xs.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo > 0 && Math.abs(xs[lo - 1] - x) <= Math.abs(xs[lo] - x) ? lo - 1 : lo;
}

export class MetricsView {
  // root: the groups' container; tooltip: the page's shared tooltip element
  constructor(root, tooltip) {
    this.root = root;
    this.tooltip = tooltip;
    this.cards = [];
  }

  // rows: this run's metric rows; overlay: {name, rows} of a second run or null. Returns [shown, total] charts.
  render(rows, { runName = "", overlay = null, smoothing = 0, filter = "" } = {}) {
    this.root.textContent = "";
    this.cards = [];
    const keep = metricFilter(filter);
    const other = overlay ? new Map(metricSeries(overlay.rows).flatMap(([, list]) => list.map((s) => [s.key, s]))) : new Map();
    let total = 0;
    for (const [group, series] of metricSeries(rows)) {
      total += series.length;
      const shown = series.filter((s) => keep(s.key));
      if (!shown.length) continue;
      this.root.insertAdjacentHTML("beforeend", `<h2>${escapeHTML(group)}</h2><div class="grid"></div>`);
      const grid = this.root.lastElementChild;
      for (const s of shown) this.cards.push(this.card(grid, s, other.get(s.key) ?? null, { runName, overlay, smoothing }));
    }
    return [this.cards.length, total];
  }

  card(grid, s, o, { runName, overlay, smoothing }) {
    const el = document.createElement("div");
    el.className = "card";
    el.dataset.metric = s.key;
    const fmt = (v) => formatValue(v, s.key);
    const constant = s.ys.every((v) => v === s.ys[0]);
    el.innerHTML = `<div class="title"><b title="${escapeHTML(describe(s.key))}">${escapeHTML(s.key)}</b>`
      + `<span>${fmt(s.ys.at(-1))}${constant && s.ys.length > 1 ? " · constant" : ""}</span></div>`
      + `<div class="plot"><canvas></canvas><div class="cursor" hidden></div></div>`;
    grid.appendChild(el);
    const sm = smooth(s.ys, smoothing);
    const osm = o ? smooth(o.ys, smoothing) : null;
    const lines = [];
    const add = (xs, ys, sms, color, dashed) => {
      if (smoothing > 0) lines.push({ xs, ys, color, dashed, faint: true });
      lines.push({ xs, ys: sms, color, dashed, dots: !(smoothing > 0) });  // dots mark raw values only
    };
    if (o) add(o.xs, o.ys, osm, RUN_COLORS[1], true);
    add(s.xs, s.ys, sm, RUN_COLORS[0], false);
    const canvas = el.querySelector("canvas");
    const chart = drawLineChart(canvas, lines, { key: s.key, bounds: yBounds(s.ys, o?.ys ?? []) });
    canvas.dataset.yLabels = JSON.stringify(chart.yLabels);
    const card = { el, s, sm, o, osm, chart, fmt, runName, overlayName: overlay?.name, last: el.querySelector(".title span").textContent };
    canvas.onmousemove = (e) => this.hover(card, e);
    canvas.onmouseleave = () => this.unhover();
    return card;
  }

  // Every visible chart shows the hovered step (cursor line, value in its title); the tooltip names the values.
  hover(card, e) {
    const i = nearestIndex(card.s.xs, card.chart.invX(e.offsetX));
    if (i < 0) return;
    const step = card.s.xs[i];
    for (const c of this.cards) {
      const j = nearestIndex(c.s.xs, step);
      const cursor = c.el.querySelector(".cursor");
      const on = j >= 0 && c.s.xs[j] === step;
      cursor.hidden = !on;
      if (on) cursor.style.left = `${c.chart.X(step)}px`;
      c.el.querySelector(".title span").textContent = on ? `step ${step}: ${c.fmt(c.s.ys[j])}` : c.last;
    }
    const lines = [`${card.s.key} · step ${step}`, this.readout(card.runName, card.s.ys[i], card.sm[i], card)];
    if (card.o) {
      const j = nearestIndex(card.o.xs, step);
      if (j >= 0 && card.o.xs[j] === step) lines.push(this.readout(card.overlayName, card.o.ys[j], card.osm[j], card));
      else lines.push(`${card.overlayName}: no value at step ${step}`);
    }
    const tip = this.tooltip;
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = `${Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8)}px`;
    tip.style.top = `${Math.min(e.clientY + 16, window.innerHeight - tip.offsetHeight - 8)}px`;
  }

  readout(name, raw, smoothed, card) {
    const sm = card.fmt(smoothed) !== card.fmt(raw) && Number.isFinite(smoothed) ? `   smoothed ${card.fmt(smoothed)}` : "";
    return `${name}: ${card.fmt(raw)}${sm}`;
  }

  unhover() {
    this.tooltip.hidden = true;
    for (const c of this.cards) {
      c.el.querySelector(".cursor").hidden = true;
      c.el.querySelector(".title span").textContent = c.last;
    }
  }
}

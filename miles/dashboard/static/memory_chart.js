// The Memory tab's drawings: a pool's stacked held bytes over a window of its events (step boundaries labelled,
// the planner's and the budget's lines dashed, each peak above the planner marked with its cause), and the overview
// strip of every step's peak per pool that picks the window.

import { fitCanvas, formatBytes, labelPad, tickLabels, ticksFor, drawXTicks } from "./charts.js";

const PEAK = "#b91c1c";

// A stacked step chart of p's events [a, b). peaks: peaksAbovePlan's entries, drawn where they fall in the window.
export function drawPool(canvas, p, colors, { a = 0, b = p.rows.length, planned = null, budget = null, peaks = [], height = 220 } = {}) {
  const { ctx, width } = fitCanvas(canvas, height);
  const n = Math.max(b - a, 1);
  let top = Math.max(1, planned ?? 0);
  for (let i = a; i < b; i++) top = Math.max(top, p.totals[i]);
  const budgetShown = budget !== null && budget <= 1.6 * top;
  const ymax = (budgetShown ? Math.max(top, budget) : top) * 1.18;  // headroom for the peak labels
  const ticks = ticksFor(0, ymax, 4, "mem/").filter((t) => t <= ymax);
  const labels = tickLabels(ticks, "mem/");
  const pad = { l: labelPad(ctx, labels, 40), r: 12, t: 8, b: 20 };
  const X = (i) => pad.l + ((i - a) / n) * (width - pad.l - pad.r);
  const Y = (v) => height - pad.b - (v / ymax) * (height - pad.t - pad.b);
  ctx.strokeStyle = "#f0f0f2";
  ctx.fillStyle = "#71717a";
  ctx.textAlign = "right";
  ticks.forEach((t, k) => {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(t)); ctx.lineTo(width - pad.r, Y(t)); ctx.stroke();
    ctx.fillText(labels[k], pad.l - 5, Y(t) + 4);
  });
  ctx.strokeStyle = "#d4d4d8";
  ctx.strokeRect(pad.l, pad.t, width - pad.l - pad.r, height - pad.t - pad.b);
  const below = new Float64Array(n);
  p.keys.forEach((key, k) => {
    ctx.fillStyle = colors[key];
    ctx.globalAlpha = 0.85;
    for (let i = a; i < b; i++) {
      const h = p.rows[i][k];
      if (h) ctx.fillRect(X(i), Y(below[i - a] + h), X(i + 1) - X(i) + 0.5, Y(below[i - a]) - Y(below[i - a] + h));
      below[i - a] += h;
    }
    ctx.globalAlpha = 1;
  });
  stepBoundaries(ctx, p, a, b, X, { top: pad.t, bottom: height - pad.b, right: width - pad.r });
  ctx.setLineDash([3, 3]);
  const line = (bytes, colour, label) => {
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.beginPath(); ctx.moveTo(pad.l, Y(bytes)); ctx.lineTo(width - pad.r, Y(bytes)); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(`${label} ${formatBytes(bytes)}`, width - pad.r - 4, Y(bytes) - 3);
  };
  if (planned !== null) line(planned, "#18181b", "planner");
  if (budgetShown) line(budget, PEAK, "budget");
  ctx.setLineDash([]);
  markPeaks(ctx, peaks.filter((q) => q.index >= a && q.index < b), X, Y, { left: pad.l, right: width - pad.r });
  return { X, Y, pad, a, b, n, width, at: (x) => a + Math.floor(((x - pad.l) / (width - pad.l - pad.r)) * n) };
}

// Dashed lines where a step starts; its name centred over its events where it fits, never past the plot's edge.
function stepBoundaries(ctx, p, a, b, X, { top, bottom, right }) {
  ctx.setLineDash([3, 3]);
  ctx.strokeStyle = "#a1a1aa";
  const spans = [];
  for (let i = a; i < b; i++) {
    if (i > a && p.stepOf[i] === p.stepOf[i - 1]) continue;
    spans.push({ step: p.stepOf[i], from: i });
    if (i > a) { ctx.beginPath(); ctx.moveTo(X(i), top); ctx.lineTo(X(i), bottom); ctx.stroke(); }
  }
  ctx.setLineDash([]);
  ctx.fillStyle = "#52525b";
  ctx.textAlign = "left";
  // with more steps than names fit, name every 2nd, 5th, 10th ... step (round numbers, as an axis would)
  const room = (right - X(a)) / Math.max(1, spans.length);
  const need = ctx.measureText(`step ${p.stepOf[b - 1] ?? 0}`).width + 10;
  const stride = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000].find((k) => k * room >= need) ?? 1000;
  let lastEnd = -Infinity;
  spans.forEach((s, k) => {
    if (s.step >= 0 && s.step % stride) return;
    const to = k + 1 < spans.length ? spans[k + 1].from : b;
    const text = s.step < 0 ? "setup" : `step ${s.step}`;
    const w = ctx.measureText(text).width;
    const x = Math.min(Math.max((X(s.from) + X(to)) / 2 - w / 2, X(s.from) + 2), right - w);
    if (x < lastEnd + 6) return;
    ctx.fillText(text, x, bottom + 14);
    lastEnd = x + w;
  });
}

// A red tick on each peak above the planner, with its cause written above it (kept inside the plot, no overlaps).
function markPeaks(ctx, peaks, X, Y, { left, right }) {
  ctx.font = "600 11px system-ui, sans-serif";
  let lastEnd = -Infinity;
  for (const q of peaks) {
    const x = (X(q.index) + X(q.index + 1)) / 2;
    const y = Y(q.peak);
    ctx.fillStyle = PEAK;
    ctx.beginPath(); ctx.moveTo(x - 5, y - 9); ctx.lineTo(x + 5, y - 9); ctx.lineTo(x, y - 2); ctx.fill();
    const text = `${q.cause} · ${formatBytes(q.peak)}`;
    const w = ctx.measureText(text).width;
    const tx = Math.min(Math.max(x - w / 2, left + 2), right - w - 2);
    if (tx < lastEnd + 8) continue;
    ctx.textAlign = "left";
    ctx.fillText(text, tx, y - 13);
    lastEnd = tx + w;
  }
  ctx.font = "11px system-ui, sans-serif";
}

// The step picker's overview: one bar per step (its peak) per pool, red above the planner, the window framed.
// steps: the step numbers in series order; rows: [{pool, peaks: {step: bytes}, planned}]. Returns the x <-> step maps.
export function drawOverview(canvas, steps, rows, [from, to], { rowHeight = 26 } = {}) {
  const height = rows.length * rowHeight + 22;
  const { ctx, width } = fitCanvas(canvas, height);
  const pad = { l: labelPad(ctx, rows.map((r) => r.pool), 40), r: 12, t: 4, b: 18 };
  const n = Math.max(steps.length, 1);
  const w = (width - pad.l - pad.r) / n;
  const X = (k) => pad.l + k * w;
  rows.forEach((r, row) => {
    const y0 = pad.t + row * rowHeight;
    const h = rowHeight - 6;
    const max = Math.max(1, r.planned ?? 0, ...steps.map((s) => r.peaks[s] ?? 0));
    ctx.fillStyle = "#52525b";
    ctx.textAlign = "right";
    ctx.fillText(r.pool, pad.l - 6, y0 + h / 2 + 4);
    steps.forEach((s, k) => {
      const v = r.peaks[s] ?? 0;
      ctx.fillStyle = r.planned !== null && v > r.planned ? PEAK : "#a1a1aa";
      const bh = Math.max(1, (v / max) * h);
      ctx.fillRect(X(k) + (w > 3 ? 0.5 : 0), y0 + h - bh, Math.max(1, w - (w > 3 ? 1 : 0)), bh);
    });
    if (r.planned !== null) {
      ctx.strokeStyle = "#18181b";
      ctx.setLineDash([2, 2]);
      const y = y0 + h - (r.planned / max) * h;
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(width - pad.r, y); ctx.stroke();
      ctx.setLineDash([]);
    }
  });
  ctx.fillStyle = "rgba(37, 99, 235, .12)";
  ctx.strokeStyle = "#2563eb";
  ctx.lineWidth = 1.5;
  ctx.fillRect(X(from), pad.t - 2, X(to + 1) - X(from), height - pad.t - pad.b + 2);
  ctx.strokeRect(X(from), pad.t - 2, X(to + 1) - X(from), height - pad.t - pad.b + 2);
  ctx.lineWidth = 1;
  ctx.fillStyle = "#71717a";
  const ticks = ticksFor(0, n - 1, Math.max(2, Math.floor((width - pad.l) / 60)));
  const label = (k) => (steps[k] < 0 ? "setup" : String(steps[k]));
  drawXTicks(ctx, ticks.filter((k) => Number.isInteger(k)), (k) => X(k) + w / 2, height - 4,
    { left: pad.l, right: width - 2, format: label });
  return { at: (x) => Math.max(0, Math.min(n - 1, Math.floor((x - pad.l) / w))), X };
}

// The Memory tab: bytes held per pool and (owner, tag) after every ledger event, one RL step after another.
// The x axis is the event index (not wall-clock seconds), so a step's handoff gets the same room as the long
// setup; setup (step < 0: engines built, trainer built, first sync) is collapsed by default and its bytes become
// the baseline. The peak in each title is the RL steps' peak computed as the driver computes mem/<pool>_peak (per
// step, in time order, from the bytes held when the step starts), so it is the figure the Metrics tab shows; the
// setup peak is named separately. The planner's prediction and the hardware's budget come from /api/plan.

import { fitCanvas, formatBytes } from "./charts.js";

// Owners get colour families: trainer tags blue-green, engine tags orange-red, anything else grey-violet.
const FAMILIES = {
  trainer: ["#1d4ed8", "#0891b2", "#15803d", "#4f46e5", "#0d9488", "#65a30d"],
  engine: ["#ea580c", "#dc2626", "#d97706", "#db2777", "#b45309"],
  other: ["#7c3aed", "#71717a", "#9333ea"],
};
const ownerKind = (owner) => { const k = String(owner ?? "").split("/")[0]; return k in FAMILIES ? k : "other"; };

export function memoryColors(rows) {
  const colors = {};
  const used = { trainer: 0, engine: 0, other: 0 };
  for (const e of rows) {
    const key = `${ownerKind(e.owner)} · ${e.tag}`;
    if (key in colors) continue;
    const kind = ownerKind(e.owner);
    colors[key] = FAMILIES[kind][used[kind]++ % FAMILIES[kind].length];
  }
  return colors;
}

// Per pool: the held bytes per (owner kind, tag) after each event; per-step peaks like the driver's.
export function memorySeries(rows, { setup = false } = {}) {
  const events = rows.filter((e) => typeof e.time === "number" && typeof e.bytes === "number")
    .sort((a, b) => a.time - b.time);
  const pools = {};
  const steps = [];
  const current = {};  // pool -> key -> bytes
  const total = (pool) => Object.values(current[pool] ?? {}).reduce((a, b) => a + b, 0);
  let lastStep;
  for (const e of events) {
    const step = e.step ?? -1;
    const key = `${ownerKind(e.owner)} · ${e.tag}`;
    const held = (current[e.pool] ||= {});
    const p = (pools[e.pool] ||= { keys: [], held: [], phases: [], times: [], stepOf: [], peak: 0, setupPeak: 0, stepPeaks: {} });
    if (step !== lastStep) {  // a new step starts from the bytes held now, in every pool
      for (const [name, q] of Object.entries(pools)) if (step >= 0) q.stepPeaks[step] = Math.max(q.stepPeaks[step] ?? 0, total(name));
      lastStep = step;
    }
    held[key] = Math.max(0, (held[key] ?? 0) + (e.direction === "out" ? -e.bytes : e.bytes));
    const now = total(e.pool);
    if (step < 0) p.setupPeak = Math.max(p.setupPeak, now);
    else p.stepPeaks[step] = Math.max(p.stepPeaks[step] ?? 0, now);
    if (step < 0 && !setup) { p.baseline = { ...held }; continue; }
    if (!p.keys.includes(key)) p.keys.push(key);
    p.held.push({ ...held });
    p.phases.push(e.phase ?? "");
    p.times.push(e.time);
    p.stepOf.push(step);
    if (!steps.length || steps.at(-1).step !== step) steps.push({ step, pool: e.pool });
  }
  for (const p of Object.values(pools)) {
    const peaks = Object.values(p.stepPeaks);
    p.peak = peaks.length ? Math.max(...peaks) : p.setupPeak;
    for (const k of Object.keys(p.baseline ?? {})) if (!p.keys.includes(k) && p.baseline[k]) p.keys.push(k);
    p.rows = p.held.map((h) => p.keys.map((k) => h[k] ?? 0));
    if (!p.rows.length && p.baseline) p.rows = [p.keys.map((k) => p.baseline[k] ?? 0)];
  }
  const order = ["device", "host", "disk"];
  const sorted = Object.fromEntries(Object.entries(pools).sort(([a], [b]) => order.indexOf(a) - order.indexOf(b)));
  return { pools: sorted, steps };
}

// A stacked step chart over the event index, step boundaries labelled, dashed lines for the planner and the budget.
export function drawPool(canvas, p, colors, { planned = null, budget = null, height = 200 } = {}) {
  const { ctx, width } = fitCanvas(canvas, height);
  const pad = { l: 64, r: 12, t: 14, b: 20 };
  const n = Math.max(p.rows.length, 1);
  const top = Math.max(1, p.peak, ...p.rows.map((r) => r.reduce((a, b) => a + b, 0)), planned ?? 0);
  const budgetShown = budget !== null && budget <= 1.6 * top;
  const ymax = (budgetShown ? Math.max(top, budget) : top) * 1.08;
  const X = (i) => pad.l + (i / n) * (width - pad.l - pad.r);
  const Y = (b) => height - pad.b - (b / ymax) * (height - pad.t - pad.b);
  ctx.strokeStyle = "#d4d4d8";
  ctx.strokeRect(pad.l, pad.t, width - pad.l - pad.r, height - pad.t - pad.b);
  ctx.fillStyle = "#71717a";
  ctx.textAlign = "right";
  ctx.fillText("0", pad.l - 4, height - pad.b);
  ctx.fillText(formatBytes(ymax / 1.08), pad.l - 4, Y(ymax / 1.08) + 4);
  const below = new Float64Array(n);
  p.keys.forEach((key, k) => {
    ctx.fillStyle = colors[key];
    ctx.globalAlpha = 0.85;
    for (let i = 0; i < p.rows.length; i++) {
      const h = p.rows[i][k];
      if (h) ctx.fillRect(X(i), Y(below[i] + h), X(i + 1) - X(i) + 0.5, Y(below[i]) - Y(below[i] + h));
      below[i] += h;
    }
    ctx.globalAlpha = 1;
  });
  ctx.setLineDash([3, 3]);
  ctx.textAlign = "left";
  let last = null;
  let lastX = -1e9;
  p.stepOf.forEach((s, i) => {
    if (s === last) return;
    last = s;
    const x = X(i);
    ctx.strokeStyle = "#a1a1aa";
    ctx.beginPath(); ctx.moveTo(x, pad.t); ctx.lineTo(x, height - pad.b); ctx.stroke();
    if (x - lastX > 40) { ctx.fillStyle = "#52525b"; ctx.fillText(s < 0 ? "setup" : `step ${s}`, x + 3, height - pad.b + 13); lastX = x; }
  });
  const line = (bytes, colour, label) => {
    ctx.strokeStyle = colour;
    ctx.fillStyle = colour;
    ctx.beginPath(); ctx.moveTo(pad.l, Y(bytes)); ctx.lineTo(width - pad.r, Y(bytes)); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(`${label} ${formatBytes(bytes)}`, width - pad.r - 4, Y(bytes) - 3);
  };
  if (planned !== null) line(planned, "#18181b", "planner");
  if (budgetShown) line(budget, "#b91c1c", "budget");
  ctx.setLineDash([]);
  return { X, n };
}

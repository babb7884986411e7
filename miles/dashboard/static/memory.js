// The Memory tab's numbers: bytes held per pool and (owner, tag) after every ledger event, one RL step after
// another, and the cause of every step peak that rises above the planner's line. The x axis is the event index (not
// wall-clock seconds), so a step's handoff gets the same room as the long setup; setup (step < 0: engines built,
// trainer built, first sync) is collapsed by default and its bytes become the baseline. Each step's peak is computed
// as the driver computes mem/<pool>_peak (per step, in time order, from the bytes held when the step starts), so it
// is the figure the Metrics tab shows; the setup peak is named separately.

import { formatBytes } from "./charts.js";

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

const newPool = () => ({ keys: [], held: [], phases: [], times: [], stepOf: [], events: [], peak: 0, setupPeak: 0,
  stepPeaks: {}, stepPeakAt: {}, stepFirst: {} });

// Per pool: the held bytes per (owner kind, tag) after each event; per-step peaks like the driver's, and where
// in the series each step reaches its peak (stepPeakAt; absent when the bytes held at the step's start are its peak).
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
    const p = (pools[e.pool] ||= newPool());
    if (step !== lastStep) {  // a new step starts from the bytes held now, in every pool
      for (const [name, q] of Object.entries(pools)) if (step >= 0) q.stepPeaks[step] = Math.max(q.stepPeaks[step] ?? 0, total(name));
      lastStep = step;
    }
    held[key] = Math.max(0, (held[key] ?? 0) + (e.direction === "out" ? -e.bytes : e.bytes));
    const now = total(e.pool);
    const rises = step >= 0 && now > (p.stepPeaks[step] ?? 0);
    if (step < 0) p.setupPeak = Math.max(p.setupPeak, now);
    else p.stepPeaks[step] = Math.max(p.stepPeaks[step] ?? 0, now);
    if (step < 0 && !setup) { p.baseline = { ...held }; continue; }
    if (rises) p.stepPeakAt[step] = p.held.length;
    if (!(step in p.stepFirst)) p.stepFirst[step] = p.held.length;
    if (!p.keys.includes(key)) p.keys.push(key);
    p.held.push({ ...held });
    p.phases.push(e.phase ?? "");
    p.times.push(e.time);
    p.stepOf.push(step);
    p.events.push(e);
    if (!steps.length || steps.at(-1).step !== step) steps.push({ step, pool: e.pool });
  }
  for (const p of Object.values(pools)) {
    const peaks = Object.values(p.stepPeaks);
    p.peak = peaks.length ? Math.max(...peaks) : p.setupPeak;
    for (const k of Object.keys(p.baseline ?? {})) if (!p.keys.includes(k) && p.baseline[k]) p.keys.push(k);
    p.rows = p.held.map((h) => p.keys.map((k) => h[k] ?? 0));
    p.totals = p.rows.map((r) => r.reduce((a, b) => a + b, 0));
    p.base = p.keys.map((k) => p.baseline?.[k] ?? 0);
    if (!p.rows.length && p.baseline) { p.rows = [p.base]; p.totals = [p.base.reduce((a, b) => a + b, 0)]; }
  }
  const order = ["device", "host", "disk"];
  const sorted = Object.fromEntries(Object.entries(pools).sort(([a], [b]) => order.indexOf(a) - order.indexOf(b)));
  return { pools: sorted, steps };
}

// "trainer params + optimizer (9.4 MiB)" for {key: bytes}, owners in order of appearance.
function describeKeys(bytesByKey) {
  const owners = new Map();
  for (const [key, b] of Object.entries(bytesByKey)) {
    const [owner, tag] = key.split(" · ");
    const o = owners.get(owner) ?? { tags: [], bytes: 0 };
    o.tags.push(tag);
    o.bytes += b;
    owners.set(owner, o);
  }
  return [...owners].map(([owner, o]) => `${owner} ${o.tags.join(" + ")} (${formatBytes(o.bytes)})`).join(", ");
}

// The RL steps whose peak in pool p rises above `planned`, each with its cause as the ledger tells it: the events
// that carried the pool over the line (owners, tags, bytes, phases), what was held already, and the checkpoint
// whose manifest was written while the pool stayed above the line, if one was (saving a checkpoint onloads the
// trainer's state: checkpoints come from /api/checkpoints, [{name, step, saved_at}], saved_at in Unix seconds).
export function peaksAbovePlan(p, planned, checkpoints = []) {
  if (planned === null || planned === undefined || !p.totals) return [];
  const out = [];
  const lastOf = {};
  p.stepOf.forEach((s, i) => { lastOf[s] = i; });
  for (const [key, peak] of Object.entries(p.stepPeaks)) {
    const step = Number(key);
    const i = p.stepPeakAt[step] ?? p.stepFirst[step];
    if (!(peak > planned) || i === undefined) continue;
    const first = p.stepFirst[step];
    let j = i;  // the first event of this step after which the pool stayed above the line up to the peak
    while (j > first && p.totals[j - 1] > planned) j--;
    let k = i + 1;  // the first event that brought it back to the line (or the next step's first)
    while (k <= lastOf[step] && p.totals[k] > planned) k++;
    const before = j > 0 ? p.rows[j - 1] : p.base;
    const arrived = {};
    const resident = {};
    p.keys.forEach((name, c) => {
      const now = p.rows[i][c];
      if (now > before[c]) arrived[name] = now - before[c];
      if (Math.min(now, before[c]) > 0) resident[name] = Math.min(now, before[c]);
    });
    const phases = [...new Set(p.phases.slice(j, i + 1).filter(Boolean))];
    const from = p.times[j];
    const until = k < p.times.length ? p.times[k] : Infinity;
    const ckpt = checkpoints.find((c) => c.saved_at >= from && c.saved_at <= until) ?? null;
    const what = describeKeys(arrived);
    const held = describeKeys(resident);
    const via = phases.length ? ` by ${phases.join(" + ")}` : "";
    out.push({
      step, peak, planned, over: peak - planned, index: i, checkpoint: ckpt?.name ?? null, phases,
      cause: ckpt ? `checkpoint ${ckpt.name} saved` : phases.join(" + ") || "held since the step before",
      detail: `${what ? `${what} moved in${via}` : "no bytes moved in"}${held ? ` while ${held} stayed` : ""}`,
    });
  }
  return out.sort((a, b) => a.step - b.step);
}

// Peaks with the same cause and bytes told once: [{steps: [25, 50, 75], ...the first peak}].
export function groupPeaks(peaks) {
  const groups = new Map();
  for (const q of peaks) {
    const key = `${q.checkpoint ? "checkpoint" : q.cause}|${q.detail}|${q.peak}`;
    if (!groups.has(key)) groups.set(key, { ...q, steps: [], checkpoints: [] });
    groups.get(key).steps.push(q.step);
    if (q.checkpoint) groups.get(key).checkpoints.push(q.checkpoint);
  }
  return [...groups.values()];
}

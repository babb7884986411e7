// Plain canvas charts (nothing from a CDN: the dashboard must work with no internet): a metric line
// chart, a stacked memory timeline per pool, and the per-token chart under the token strip.

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#9333ea", "#ea580c", "#0d9488", "#4f46e5"];

export const isBytes = (key) => /(^|\/)(mem|moved)\//.test(key) || key.endsWith("bytes");

export function formatValue(v, key = "") {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (isBytes(key)) return formatBytes(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

const BYTE_UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function formatBytes(b) {
  let i = 0;
  let v = b;
  while (Math.abs(v) >= 1024 && i < BYTE_UNITS.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(Math.abs(v) >= 100 || i === 0 ? 0 : 1)} ${BYTE_UNITS[i]}`;
}

// A canvas sized to its CSS box at the device pixel ratio; returns the 2d context in CSS pixels.
export function fitCanvas(canvas, height) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.parentElement.clientWidth || 300;
  canvas.style.height = `${height}px`;
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return lo === Infinity ? null : [lo, hi];
}

// The y range of a metric chart. A constant series gets [0, 2c] (or [2c, 0], or [0, 1] for 0): its line sits
// mid-chart with 0 and its value labelled, instead of a +-5 % band that makes float formatting the subject.
export function yBounds(...seriesList) {
  const ext = extent(seriesList.flat());
  if (!ext) return [0, 1];
  const [lo, hi] = ext;
  if (lo === hi) return lo === 0 ? [0, 1] : [Math.min(0, 2 * lo), Math.max(0, 2 * hi)];
  const pad = (hi - lo) * 0.06;
  return [lo - pad, hi + pad];
}

// About `count` round values (1, 2, 2.5 or 5 x 10^k apart) inside [lo, hi].
export function niceTicks(lo, hi, count = 4) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

// TensorBoard's smoothing: an exponential moving average, debiased so the first points are not pulled to 0.
// weight 0 returns the series; non-finite values stay gaps and do not reset the average.
export function smooth(ys, weight) {
  if (!(weight > 0)) return ys;
  const out = new Array(ys.length);
  let last = 0;
  let n = 0;
  for (let i = 0; i < ys.length; i++) {
    if (!Number.isFinite(ys[i])) { out[i] = NaN; continue; }
    last = last * weight + (1 - weight) * ys[i];
    n += 1;
    out[i] = last / (1 - weight ** n);
  }
  return out;
}

// The widest of some labels in the chart font, plus a gap: the left padding that never clips a y label.
export function labelPad(ctx, labels, min = 28) {
  return Math.ceil(Math.max(min, ...labels.map((t) => ctx.measureText(t).width)) + 8);
}

// x labels at round steps, each centred on its tick but kept inside the plot, none overlapping.
export function drawXTicks(ctx, ticks, X, y, { left, right, format = String } = {}) {
  ctx.textAlign = "left";
  let lastEnd = -Infinity;
  for (const t of ticks) {
    const text = format(t);
    const w = ctx.measureText(text).width;
    const x = Math.min(Math.max(X(t) - w / 2, left), right - w);
    if (x < lastEnd + 6) continue;
    ctx.fillText(text, x, y);
    lastEnd = x + w;
  }
}

// Round ticks; for bytes, round in the unit the largest value is shown in (0, 16 MiB, 32 MiB, not 16.8 MB steps).
export function ticksFor(lo, hi, count, key = "") {
  if (!isBytes(key)) return niceTicks(lo, hi, count);
  let unit = 1;
  while (Math.max(Math.abs(lo), Math.abs(hi)) / unit >= 1024 && unit < 1024 ** 4) unit *= 1024;
  const ticks = niceTicks(lo / unit, hi / unit, count).map((v) => v * unit);
  return unit === 1 ? ticks.filter(Number.isInteger) : ticks;  // no quarter bytes
}

// Labels for a row of ticks in one format, with the decimals their spacing needs (0.0005, 0.0010, 0.0015; 2e-12,
// 4e-12), so neighbouring labels never differ in style or round to the same text.
export function tickLabels(ticks, key = "") {
  if (ticks.length < 2) return ticks.map((v) => formatValue(v, key));
  const step = Math.abs(ticks[1] - ticks[0]);
  const big = Math.max(...ticks.map(Math.abs));
  if (isBytes(key)) {
    let k = 0;
    while (big / 1024 ** k >= 1024 && k < BYTE_UNITS.length - 1) k++;
    const d = decimalsFor(step / 1024 ** k);
    return ticks.map((v) => `${(v / 1024 ** k).toFixed(d)} ${BYTE_UNITS[k]}`);
  }
  if (big >= 1e5 || big < 1e-3) {
    const digits = Math.max(0, Math.min(6, Math.floor(Math.log10(big)) - Math.floor(Math.log10(step)) + 1));
    return ticks.map((v) => (v === 0 ? "0" : String(Number(v.toExponential(digits)))));
  }
  const decimals = decimalsFor(step);
  return ticks.map((v) => v.toFixed(decimals));
}

function decimalsFor(step) {  // the fewest decimals that write the spacing exactly
  let d = 0;
  while (d < 12 && Math.abs(step * 10 ** d - Math.round(step * 10 ** d)) > 1e-6 * step * 10 ** d) d++;
  return d;
}

// Metric lines over steps. series: [{xs, ys, color, dashed?, faint?, dots?}] (dots on each value of a short series);
// every series shares one y range (bounds, from yBounds) so an overlaid run reads on the same scale.
export function drawLineChart(canvas, series, { key = "", bounds = null, height = 150 } = {}) {
  const { ctx, width } = fitCanvas(canvas, height);
  const [y0, y1] = bounds ?? yBounds(...series.map((s) => s.ys));
  const xExt = extent(series.flatMap((s) => s.xs)) ?? [0, 1];
  const [x0, x1] = xExt[0] === xExt[1] ? [xExt[0] - 1, xExt[1] + 1] : xExt;
  const yTicks = ticksFor(y0, y1, 4, key);
  const yLabels = tickLabels(yTicks, key);
  const pad = { l: labelPad(ctx, yLabels), r: 10, t: 8, b: 20 };
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const Y = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  ctx.strokeStyle = "#f0f0f2";
  ctx.fillStyle = "#71717a";
  ctx.textAlign = "right";
  yTicks.forEach((v, i) => {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(v)); ctx.lineTo(width - pad.r, Y(v)); ctx.stroke();
    ctx.fillText(yLabels[i], pad.l - 5, Y(v) + 4);
  });
  ctx.strokeStyle = "#d4d4d8";
  ctx.beginPath(); ctx.moveTo(pad.l, pad.t); ctx.lineTo(pad.l, height - pad.b); ctx.lineTo(width - pad.r, height - pad.b); ctx.stroke();
  ctx.fillStyle = "#71717a";
  const xTicks = niceTicks(x0, x1, Math.max(2, Math.floor((width - pad.l) / 55))).filter((t) => Number.isInteger(t));
  drawXTicks(ctx, xTicks, X, height - 5, { left: 0, right: width - 2 });
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.globalAlpha = s.faint ? 0.35 : 1;
    ctx.lineWidth = s.faint ? 1 : 1.6;
    ctx.setLineDash(s.dashed ? [5, 3] : []);
    ctx.beginPath();
    let started = false;
    for (let i = 0; i < s.xs.length; i++) {
      if (!Number.isFinite(s.ys[i])) { started = false; continue; }
      if (started) ctx.lineTo(X(s.xs[i]), Y(s.ys[i])); else ctx.moveTo(X(s.xs[i]), Y(s.ys[i]));
      started = true;
    }
    ctx.stroke();
    if (s.xs.length <= 60 && s.dots) {
      ctx.fillStyle = s.color;
      for (let i = 0; i < s.xs.length; i++) if (Number.isFinite(s.ys[i])) ctx.fillRect(X(s.xs[i]) - 1.5, Y(s.ys[i]) - 1.5, 3, 3);
    }
  }
  ctx.globalAlpha = 1;
  ctx.setLineDash([]);
  return { X, Y, pad, width, height, x0, x1, yLabels, invX: (px) => x0 + ((px - pad.l) / (width - pad.l - pad.r)) * (x1 - x0) };
}

function axes(ctx, width, height, pad, yLabels, xLabels) {
  ctx.strokeStyle = "#d4d4d8";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(pad.l, pad.t);
  ctx.lineTo(pad.l, height - pad.b);
  ctx.lineTo(width - pad.r, height - pad.b);
  ctx.stroke();
  ctx.fillStyle = "#71717a";
  ctx.textAlign = "right";
  ctx.fillText(yLabels[1], pad.l - 4, pad.t + 9);
  ctx.fillText(yLabels[0], pad.l - 4, height - pad.b);
  ctx.textAlign = "left";
  ctx.fillText(xLabels[0], pad.l, height - 5);
  ctx.textAlign = "right";
  ctx.fillText(xLabels[1], width - pad.r, height - 5);
}

export function drawTokenChart(canvas, data, stat, view, { height = 90 } = {}) {
  const { ctx, width } = fitCanvas(canvas, height);
  const pad = { l: 56, r: 6, t: 6, b: 16 };
  const values = data.stats[stat];
  const n = data.n;
  const X = (i) => pad.l + (i / Math.max(1, n)) * (width - pad.l - pad.r);
  ctx.fillStyle = "#f4f4f5";
  ctx.fillRect(X(0), pad.t, X(data.promptLen) - X(0), height - pad.t - pad.b);
  let lo = 0;
  let hi = 0;
  if (values) for (let i = data.promptLen; i < n; i++) if (Number.isFinite(values[i])) { lo = Math.min(lo, values[i]); hi = Math.max(hi, values[i]); }
  if (hi === lo) hi = lo + 1;
  const Y = (v) => height - pad.b - ((v - lo) / (hi - lo)) * (height - pad.t - pad.b);
  axes(ctx, width, height, pad, [formatValue(lo), formatValue(hi)], ["0", String(n)]);
  if (values) {
    const cols = Math.max(1, Math.floor(width - pad.l - pad.r));
    ctx.fillStyle = "#7c3aed";
    for (let c = 0; c < cols; c++) {
      const a = Math.floor((c / cols) * n);
      const b = Math.max(a + 1, Math.floor(((c + 1) / cols) * n));
      let mn = Infinity;
      let mx = -Infinity;
      for (let i = a; i < b && i < n; i++) if (Number.isFinite(values[i])) { mn = Math.min(mn, values[i]); mx = Math.max(mx, values[i]); }
      if (mn === Infinity) continue;
      ctx.fillRect(pad.l + c, Y(mx), 1, Math.max(1, Y(mn) - Y(mx)));
    }
    ctx.strokeStyle = "#a1a1aa";
    ctx.beginPath();
    ctx.moveTo(pad.l, Y(0));
    ctx.lineTo(width - pad.r, Y(0));
    ctx.stroke();
  }
  if (view) {
    ctx.strokeStyle = "#18181b";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(X(view[0]), pad.t, Math.max(2, X(view[1]) - X(view[0])), height - pad.t - pad.b);
  }
  return { X, pad, n, toToken: (x) => Math.round(((x - pad.l) / (width - pad.l - pad.r)) * n) };
}

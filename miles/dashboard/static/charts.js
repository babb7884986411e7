// Plain canvas charts (nothing from a CDN: the dashboard must work with no internet): a metric line
// chart, a stacked memory timeline per pool, and the per-token chart under the token strip.

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d",
  "#9333ea", "#ea580c", "#0d9488", "#4f46e5"];

export function formatValue(v, key = "") {
  if (v === null || v === undefined || !Number.isFinite(v)) return "–";
  if (/(^|\/)(mem|moved)\//.test(key) || key.endsWith("bytes")) return formatBytes(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

export function formatBytes(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = b;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
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
  if (lo === Infinity) return [0, 1];
  if (lo === hi) return [lo - (Math.abs(lo) || 1) * 0.05, hi + (Math.abs(hi) || 1) * 0.05];
  return [lo, hi];
}

// One metric over steps: xs, ys arrays of equal length.
export function drawLineChart(canvas, xs, ys, { key = "", color = PALETTE[0], height = 150 } = {}) {
  const { ctx, width } = fitCanvas(canvas, height);
  const pad = { l: 52, r: 10, t: 8, b: 20 };
  const [x0, x1] = extent(xs);
  const [y0, y1] = extent(ys);
  const X = (x) => pad.l + ((x - x0) / (x1 - x0 || 1)) * (width - pad.l - pad.r);
  const Y = (y) => height - pad.b - ((y - y0) / (y1 - y0 || 1)) * (height - pad.t - pad.b);
  axes(ctx, width, height, pad, [y0, y1].map((v) => formatValue(v, key)), [formatValue(x0), formatValue(x1)]);
  ctx.strokeStyle = color;
  ctx.lineWidth = 1.6;
  ctx.beginPath();
  let started = false;
  for (let i = 0; i < xs.length; i++) {
    if (!Number.isFinite(ys[i])) { started = false; continue; }
    if (started) ctx.lineTo(X(xs[i]), Y(ys[i])); else ctx.moveTo(X(xs[i]), Y(ys[i]));
    started = true;
  }
  ctx.stroke();
  if (xs.length <= 60) {
    ctx.fillStyle = color;
    for (let i = 0; i < xs.length; i++) if (Number.isFinite(ys[i])) ctx.fillRect(X(xs[i]) - 1.5, Y(ys[i]) - 1.5, 3, 3);
  }
  return { X, Y, pad };
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

// The token strip: one scroll box holding a sample's whole token sequence, built once.
//
// A sample arrives in ONE binary response (parseSample) that feeds the strip, the per-token chart and the
// conversation. The strip is split into blocks of BLOCK tokens with `content-visibility: auto`: a block
// holds plain text until it comes near the viewport, then its tokens become spans (materialise). The
// browser lays out and paints only blocks near the viewport, so a 64k-token sample is ready in a few
// tens of ms, yet the box scrolls through the whole sequence. mode "naive" builds every span up front
// (the reference the fast path is compared with, in the tests and in `miles bench dashboard`).
// Recolouring repaints span backgrounds and never rebuilds, so the scroll position survives it.
//
//   const strip = new TokenStrip(el);
//   strip.build(parseSample(buffer));   // once per sample
//   strip.recolor("advantages");        // any number of times
//   strip.onShown(() => strip.scrollToToken(strip.data.promptLen));  // one-shot, waits for a layout box

export const BLOCK = 256;
export const STATS = {
  // floor: the smallest scale; below it values are not signal. A train − rollout difference under 1e-3 nats is a
  // probability ratio within 0.1 % of 1 (the PPO clip is 20 %); float32 rounding alone gives ~1e-7.
  diff: { label: "train − rollout log-prob", diverging: true, floor: 1e-3 },
  advantages: { label: "advantage", diverging: true },
  entropy: { label: "entropy", diverging: false },
  rollout_log_probs: { label: "rollout log-prob", diverging: false },
  // the weight version each token was sampled under (an async run's in-flight updates): coloured by its rank among
  // the sample's versions, the oldest lightest and the newest darkest; -1 (not known) is left white
  weight_versions: { label: "weight version", diverging: false, versions: true },
  none: { label: "none", diverging: false },
};

const MAGIC = "MLSD";
const ARRAYS = { int32: Int32Array, uint32: Uint32Array, uint8: Uint8Array, float32: Float32Array };

export function parseSample(buffer) {
  const head = new Uint8Array(buffer, 0, 8);
  if (String.fromCharCode(...head.subarray(0, 4)) !== MAGIC) throw new Error("not a miles sample payload");
  const headerLen = new DataView(buffer).getUint32(4, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 8, headerLen)));
  const base = 8 + headerLen;
  const cols = {};
  for (const c of header.columns) {
    if (c.dtype === "utf8") cols[c.name] = new TextDecoder().decode(new Uint8Array(buffer, base + c.offset, c.length));
    else cols[c.name] = new ARRAYS[c.dtype](buffer, base + c.offset, c.length);
  }
  const n = header.num_tokens;
  const textStart = new Uint32Array(n + 1);  // token i's text is text.slice(textStart[i], textStart[i + 1])
  for (let i = 0; i < n; i++) textStart[i + 1] = textStart[i] + cols.token_text_len[i];
  // train − rollout exists only where the engine sampled the token: a prompt token has no rollout log-prob (the
  // driver may store 0 there), so its difference is left undefined instead of reading as a -7 nat mismatch
  const promptLen = header.sample.prompt_len;
  const versions = new Float32Array(n).fill(NaN);
  if (cols.weight_versions) for (let i = promptLen; i < n; i++) if (cols.weight_versions[i] >= 0) versions[i] = cols.weight_versions[i];
  const diff = new Float32Array(n);
  for (let i = 0; i < n; i++) diff[i] = i < promptLen ? NaN : cols.train_log_probs[i] - cols.rollout_log_probs[i];
  return {
    header, sample: header.sample, n, promptLen, text: cols.token_text, textStart,
    tokens: cols.tokens, mask: cols.loss_mask, parts: tokenParts(header.sample.spans, n),
    stats: { diff, advantages: cols.advantages, entropy: cols.entropy, rollout_log_probs: cols.rollout_log_probs,
             train_log_probs: cols.train_log_probs, weight_versions: versions },
  };
}

// A multi-turn sample's spans as one byte per token, computed once per sample: bit 0 a turn starts here (a model
// or an environment turn), bit 1 inside a tool call the model wrote, bit 2 inside a tool result; the turn of each
// token for the tooltip. The strip turns the bits into classes that draw no background (the stat colours keep it).
export const PART = { turnStart: 1, toolCall: 2, toolResult: 4 };
export function tokenParts(spans, n) {
  const bits = new Uint8Array(n);
  const turn = new Int16Array(n).fill(-1);
  const kind = new Array(n).fill("");
  for (const s of spans ?? []) {
    const a = Math.max(0, s.start);
    const b = Math.min(n, s.end);
    if (s.kind === "model" || s.kind === "env") {
      if (a < b) bits[a] |= PART.turnStart;
      for (let i = a; i < b; i++) { turn[i] = s.turn; kind[i] = s.kind; }
    } else if (s.kind === "tool_call" || s.kind === "tool_result") {
      const bit = s.kind === "tool_call" ? PART.toolCall : PART.toolResult;
      for (let i = a; i < b; i++) bits[i] |= bit;
    }
  }
  return { bits, turn, kind, any: (spans ?? []).some((s) => s.kind !== "prompt") };
}

// A colour per token for one stat: diverging blue-white-red around 0, or sequential white-purple from 0;
// the scale is the 99th percentile of |value| over response tokens (never below the stat's floor), so one outlier
// does not wash out the rest and float noise stays white. Colours are quantised to LEVELS steps per sign, so a
// 64k-token sample needs no 64k string formats.
const LEVELS = 32;
const PALETTES = { pos: "220,38,38", neg: "37,99,235", seq: "124,58,237" };

// One class per (palette, level), so spans share style rules (the style engine caches matched rules;
// an inline style per span defeats that cache), installed once per document.
function installColorClasses() {
  if (document.getElementById("token-colors")) return;
  const rules = [];
  for (const [name, rgb] of Object.entries(PALETTES)) {
    for (let k = 0; k <= LEVELS; k++) rules.push(`.${name}${k}{background-color:rgba(${rgb},${(0.08 + (0.72 * k) / LEVELS).toFixed(3)})}`);
  }
  const style = document.createElement("style");
  style.id = "token-colors";
  style.textContent = rules.join("\n");
  document.head.appendChild(style);
}

export function colorScale(data, stat) {
  const values = data.stats[stat];
  if (!values) return { scale: 0, color: () => "" };
  installColorClasses();
  if (STATS[stat].versions) return versionScale(data, values);
  const abs = new Float32Array(data.n - data.promptLen);
  let m = 0;
  for (let i = data.promptLen; i < data.n; i++) if (Number.isFinite(values[i])) abs[m++] = Math.abs(values[i]);
  const floor = STATS[stat].floor ?? 1e-6;
  const scale = m ? Math.max(kth(abs.subarray(0, m), Math.min(m - 1, Math.floor(m * 0.99))), floor) : 1;
  const diverging = STATS[stat].diverging;
  const { promptLen } = data;
  // a class per token, computed when a span is made or repainted: never 64k strings at once
  const color = (i) => {
    const v = values[i];
    if (i < promptLen || !Number.isFinite(v)) return "";
    const k = Math.round(Math.min(1, Math.abs(v) / scale) * LEVELS);
    return (diverging ? (v >= 0 ? "pos" : "neg") : "seq") + k;
  };
  return { scale, color };
}

// Weight versions: the sample's versions v0 < v1 < ... < vm get levels LEVELS * (j + 1) / (m + 1), so a sample of
// one version is evenly dark and one that crossed an update shows each version's tokens as a band of its own shade.
function versionScale(data, values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (let i = data.promptLen; i < data.n; i++) if (Number.isFinite(values[i])) { lo = Math.min(lo, values[i]); hi = Math.max(hi, values[i]); }
  if (lo > hi) return { scale: 0, color: () => "" };
  const color = (i) => {
    const v = values[i];
    if (i < data.promptLen || !Number.isFinite(v)) return "";
    return "seq" + Math.round(((v - lo + 1) / (hi - lo + 1)) * LEVELS);
  };
  return { scale: hi, low: lo, color };
}

// The k-th smallest value (quickselect, in place): the percentile without sorting 64k values.
function kth(a, k) {
  let lo = 0;
  let hi = a.length - 1;
  while (lo < hi) {
    const pivot = a[(lo + hi) >> 1];
    let i = lo;
    let j = hi;
    while (i <= j) {
      while (a[i] < pivot) i++;
      while (a[j] > pivot) j--;
      if (i <= j) { const t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
    }
    if (k <= j) hi = j; else if (k >= i) lo = i; else return a[k];
  }
  return a[k];
}

export class TokenStrip {
  constructor(el, { mode = "blocks", blockSize = BLOCK } = {}) {
    this.el = el;
    this.mode = mode;
    this.blockSize = blockSize;
    this.data = null;
    this.color = () => "";
    this.stat = "diff";
    this._pendingShown = null;
    this._observer = null;
  }

  build(data) {
    this.data = data;
    this.el.textContent = "";
    this.el.scrollTop = 0;
    this._observer?.disconnect();
    this.color = colorScale(data, this.stat).color;
    if (this.mode === "naive") this._buildNaive();
    else this._buildBlocks();
    this.el.dataset.built = String(data.n);
  }

  _buildNaive() {
    const frag = document.createDocumentFragment();
    const block = document.createElement("div");
    block.className = "blk naive";
    block.dataset.start = "0";
    this._fillSpans(block, 0, this.data.n);
    frag.appendChild(block);
    this.blocks = [{ el: block, start: 0, end: this.data.n, live: true }];
    this.el.appendChild(frag);
  }

  _buildBlocks() {
    const { text, textStart } = this.data;
    const perLine = this._charsPerLine();
    const frag = document.createDocumentFragment();
    this.blocks = [];
    const heights = [];
    for (const [start, end] of blockRanges(this.data, this.blockSize)) {
      const el = document.createElement("div");
      el.className = "blk";
      el.dataset.start = String(start);
      el.dataset.block = String(this.blocks.length);
      const chunk = text.slice(textStart[start], textStart[end]);
      el.textContent = chunk;
      heights.push(estimateHeight(chunk, perLine));
      el.style.containIntrinsicSize = `auto ${heights.at(-1)}px`;
      this.blocks.push({ el, start, end, live: false });
      frag.appendChild(el);
    }
    this.starts = Int32Array.from(this.blocks, (b) => b.start);
    this.el.appendChild(frag);
    // the blocks that will fill the box once it scrolls to the first response token (and the line above
    // it) get their spans before the first paint; the observer does the rest as the user scrolls
    const first = this.blockOf(this.data.promptLen);
    this.materialise(first - 1);
    let covered = 0;
    for (let b = first; b < this.blocks.length && covered < (this.el.clientHeight || 600) + 40; b++) {
      this.materialise(b);
      covered += heights[b];
    }
    this._observer = new IntersectionObserver((entries) => {
      for (const e of entries) if (e.isIntersecting) this.materialise(Number(e.target.dataset.block));
    }, { root: this.el, rootMargin: "100% 0px" });  // one box height ahead in each direction
    for (const b of this.blocks) if (!b.live) this._observer.observe(b.el);
  }

  _charsPerLine() {
    const probe = document.createElement("span");
    probe.textContent = "0".repeat(64);
    this.el.appendChild(probe);
    const charWidth = probe.getBoundingClientRect().width / 64 || 7.8;
    probe.remove();
    const width = (this.el.clientWidth || window.innerWidth - 80) - 70;  // minus the gutter and padding
    return Math.max(8, Math.floor(width / charWidth));
  }

  materialise(b) {
    const block = this.blocks[b];
    if (!block || block.live) return;
    block.live = true;
    this._observer?.unobserve(block.el);
    block.el.textContent = "";
    this._fillSpans(block.el, block.start, block.end);
  }

  _fillSpans(parent, start, end) {
    const { text, textStart, promptLen, mask } = this.data;
    const frag = document.createDocumentFragment();
    for (let i = start; i < end; i++) {
      const s = document.createElement("span");
      s.textContent = text.slice(textStart[i], textStart[i + 1]);
      const cls = this._className(i, promptLen, mask);
      if (cls) s.className = cls;
      frag.appendChild(s);
    }
    parent.appendChild(frag);
  }

  _className(i, promptLen, mask) {
    if (i < promptLen) return "p";
    const c = this.color(i);
    const base = mask[i] ? c : c ? `m ${c}` : "m";
    const bits = this.data.parts?.bits[i] ?? 0;
    if (!bits) return base;
    const extra = (bits & PART.turnStart ? " ts" : "") + (bits & PART.toolCall ? " tc" : "") + (bits & PART.toolResult ? " tr" : "");
    return (base + extra).trim();
  }

  // Repaint backgrounds only: the spans, their layout and the scroll position stay as they are.
  recolor(stat) {
    this.stat = stat;
    if (!this.data) return;
    this.color = colorScale(this.data, stat).color;
    for (const block of this.blocks) {
      if (!block.live) continue;
      const spans = block.el.children;
      const { promptLen, mask } = this.data;
      for (let i = block.start; i < block.end; i++) spans[i - block.start].className = this._className(i, promptLen, mask);
    }
  }

  blockOf(i) {  // the last block starting at or before token i
    let lo = 0;
    let hi = this.starts.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (this.starts[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
  }

  span(i) {
    const b = this.mode === "naive" ? 0 : this.blockOf(i);
    this.materialise(b);
    const block = this.blocks[b];
    return block ? block.el.children[i - block.start] : null;
  }

  tokenAt(span) {
    const block = span?.parentElement;
    if (!block || block.parentElement !== this.el || !block.classList.contains("blk")) return -1;
    return Number(block.dataset.start) + Array.prototype.indexOf.call(block.children, span);
  }

  scrollToToken(i, margin = 24) {
    if (!this.data.n) return;
    const target = this.span(Math.max(0, Math.min(i, this.data.n - 1)));
    if (!target) return;
    const top = target.getBoundingClientRect().top - this.el.getBoundingClientRect().top + this.el.scrollTop;
    this.el.scrollTop = Math.max(0, top - margin);
  }

  // Runs fn once, as soon as the strip has a layout box: now if it is visible, else when its pane is
  // shown again (a hidden pane has no layout, and offsetTop is 0 there, e.g. after a tab switch).
  onShown(fn) {
    this._pendingShown?.disconnect();
    if (this.el.getClientRects().length && this.el.clientHeight > 0) { fn(); return; }
    const ro = new ResizeObserver((entries) => {
      if (!entries.some((e) => e.contentRect.height > 0)) return;
      ro.disconnect();
      this._pendingShown = null;
      fn();
    });
    this._pendingShown = ro;
    ro.observe(this.el);
  }
}

// Block boundaries: about `size` tokens each, ending after a token that ends a line when one lies in the
// last quarter, so a block break falls where the text breaks anyway; the prompt/response border is one too.
export function blockRanges(data, size) {
  const { n, text, textStart, promptLen } = data;
  const ranges = [];
  let start = 0;
  while (start < n) {
    let end = Math.min(n, start + size);
    if (start < promptLen && promptLen < end) end = promptLen;
    else if (end < n) {
      for (let i = end - 1; i >= start + (3 * size) / 4; i--) {
        if (textStart[i + 1] > textStart[i] && text.charCodeAt(textStart[i + 1] - 1) === 10) { end = i + 1; break; }
      }
    }
    ranges.push([start, end]);
    start = end;
  }
  return ranges;
}

function estimateHeight(chunk, perLine, lineHeight = 20) {
  let lines = 0;
  let start = 0;
  for (;;) {
    const nl = chunk.indexOf("\n", start);
    const len = (nl < 0 ? chunk.length : nl) - start;
    lines += Math.max(1, Math.ceil(len / perLine));
    if (nl < 0) break;
    start = nl + 1;
  }
  return lines * lineHeight;
}

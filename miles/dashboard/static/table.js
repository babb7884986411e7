// The Rollouts tab's table: one step's samples, sortable by any column, filtered by a small query (reward = 0,
// finish = length, length > 100, or plain text searched in the response preview; clauses joined by "," or "and"),
// and paged (PAGE rows at a time) so a 256-sample step is not one 7,800-px page.

import { formatValue, PALETTE } from "./charts.js";

export const PAGE = 50;
const COLUMNS = { "#": "row", row: "row", group: "group", reward: "reward", length: "num_tokens", tokens: "num_tokens",
  response: "response_len", finish: "finish_reason", version: "weight_version", preview: "preview" };
const OPS = {
  "=": (a, b) => a === b, "==": (a, b) => a === b, "!=": (a, b) => a !== b,
  "<": (a, b) => a < b, "<=": (a, b) => a <= b, ">": (a, b) => a > b, ">=": (a, b) => a >= b,
};
const escapeHTML = (s) => String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

// A query -> a predicate over a sample's metadata; throws an Error naming a column that is not among `known`
// (the samples' metadata keys) with the columns it could have meant.
export function sampleFilter(query, known = null) {
  const clauses = String(query ?? "").split(/,|\band\b/i).map((c) => c.trim()).filter(Boolean);
  const tests = clauses.map((clause) => {
    const m = clause.match(/^([#\w]+)\s*(<=|>=|!=|==|=|<|>)\s*(.+)$/);
    if (!m) {
      const text = clause.toLowerCase();
      return (s) => String(s.preview ?? "").toLowerCase().includes(text);
    }
    const [, name, op, raw] = m;
    const key = COLUMNS[name.toLowerCase()] ?? name;
    if (known && !known.includes(key)) {
      throw new Error(`no column ${name}; use one of ${Object.keys(COLUMNS).filter((c) => c !== "#").join(", ")} or a sample field`);
    }
    const value = raw.trim().replace(/^["']|["']$/g, "");
    const num = Number(value);
    const numeric = value !== "" && Number.isFinite(num);
    return (s) => {
      const v = s[key];
      if (v === undefined || v === null) return false;
      if (numeric && typeof v === "number") return OPS[op](v, num);
      return OPS[op](String(v).toLowerCase(), value.toLowerCase());
    };
  });
  return (s) => tests.every((t) => t(s));
}

export class RolloutTable {
  constructor(table, controls) {
    this.table = table;
    this.controls = controls;  // {filter, prev, next, info}
    this.samples = [];
    this.sort = { key: "row", dir: "asc" };
    this.page = 0;
    this.query = "";
    for (const th of table.querySelectorAll("th")) {
      th.onclick = () => {
        const key = th.dataset.key;
        this.sort = { key, dir: this.sort.key === key && this.sort.dir === "asc" ? "desc" : "asc" };
        this.page = 0;
        this.render();
      };
    }
    controls.filter.oninput = () => { this.query = controls.filter.value; this.page = 0; this.render(); };
    controls.prev.onclick = () => { this.page -= 1; this.render(); };
    controls.next.onclick = () => { this.page += 1; this.render(); };
  }

  show(samples) {
    this.samples = samples;
    this.page = 0;
    this.render();
  }

  rows() {
    let keep;
    try {
      keep = sampleFilter(this.query, Object.keys(this.samples[0] ?? {}));
      this.controls.filter.classList.remove("bad");
      this.controls.filter.title = "";
    } catch (e) {
      this.controls.filter.classList.add("bad");
      this.controls.filter.title = e.message;
      keep = () => true;
    }
    const { key, dir } = this.sort;
    const sign = dir === "asc" ? 1 : -1;
    return this.samples.filter(keep).sort((a, b) => {
      const x = a[key] ?? -Infinity;
      const y = b[key] ?? -Infinity;
      return (x < y ? -1 : x > y ? 1 : a.row - b.row) * sign;
    });
  }

  render() {
    const rows = this.rows();
    const pages = Math.max(1, Math.ceil(rows.length / PAGE));
    this.page = Math.max(0, Math.min(this.page, pages - 1));
    const shown = rows.slice(this.page * PAGE, (this.page + 1) * PAGE);
    for (const th of this.table.querySelectorAll("th")) th.dataset.dir = th.dataset.key === this.sort.key ? this.sort.dir : "";
    const { prev, next, info } = this.controls;
    prev.disabled = this.page === 0;
    next.disabled = this.page >= pages - 1;
    const matched = rows.length === this.samples.length ? "" : ` (${rows.length} of ${this.samples.length} match)`;
    info.textContent = rows.length ? `rows ${this.page * PAGE + 1}–${this.page * PAGE + shown.length} of ${rows.length}${matched}` : `no sample matches${matched}`;
    const maxReward = Math.max(1e-9, ...this.samples.map((s) => Math.abs(s.reward ?? 0)));
    this.table.querySelector("tbody").innerHTML = shown.map((s) => `<tr data-row="${s.row}">
      <td class="num">${s.row}</td>
      <td><span class="chip" style="background:${PALETTE[(s.group ?? 0) % PALETTE.length]}"></span>${escapeHTML(s.group)}</td>
      <td class="num">${formatValue(s.reward)}<span class="reward-bar" style="width:${Math.round(40 * Math.abs(s.reward ?? 0) / maxReward)}px"></span></td>
      <td class="num">${s.num_tokens}</td><td class="num">${s.response_len}</td>
      <td>${escapeHTML(s.finish_reason)}</td><td class="num">${escapeHTML(s.weight_version)}</td>
      <td class="wide">${escapeHTML(s.preview)}</td></tr>`).join("");
  }
}

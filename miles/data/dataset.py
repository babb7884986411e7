"""Prompt datasets: rows read from jsonl, parquet or a `datasets` save_to_disk directory, mapped to
(prompt or chat messages, answer, metadata), checked row by row, and served in a seeded shuffled order whose
position in the epoch is part of a checkpoint.

    rows, skipped = load_rows("math", "train.jsonl", cfg.data)   # BadRowError names file, row and field
    ds = PromptDataset(rows, seed=cfg.seed)
    batch = ds.take(8)                                            # the next 8 rows of this epoch's order
    state = ds.state_dict(); ds2 = PromptDataset(rows, seed=cfg.seed); ds2.load_state_dict(state)
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass, field
from decimal import Decimal

from miles.data.config import DataConfig, parse_specs
from miles.data.records import BadRowError, read_records
from miles.reward.catalog import check_rewards

log = logging.getLogger("miles")
__all__ = ["BadRowError", "read_records"]  # re-exported: the row errors and reader of miles.data.records


@dataclass(slots=True)
class PromptRow:
    dataset: str
    source: str  # file (or directory) the row came from
    row: int  # index of the row in that file (0-based; jsonl: blank lines are not rows)
    prompt: str  # the prompt text (for chat rows: the last user message, for display and the reward's prompt)
    answer: str
    messages: list[dict] | None = None
    metadata: dict = field(default_factory=dict)

    def chat(self, system_prompt: str = "") -> list[dict]:
        msgs = self.messages or [{"role": "user", "content": self.prompt}]
        if system_prompt and msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": system_prompt}, *msgs]
        return msgs

    @property
    def key(self) -> str:
        """What makes two rows the same problem (the eval / train overlap check, repeated eval rows): the text with
        each run of whitespace as one space and the case folded ("What is 2+2?" = "what is  2+2?")."""
        if self.messages:
            return json.dumps([[m["role"], _same_text(m["content"])] for m in self.messages])
        return _same_text(self.prompt)


def _same_text(text: str) -> str:
    return " ".join(text.split()).casefold()


def load_rows(name: str, path: str, cfg: DataConfig) -> tuple[list[PromptRow], list[str]]:
    """The dataset's usable rows, and one message per skipped bad row (only when cfg.skip_bad_rows)."""
    rows, skipped = [], []
    records = read_records(path)
    check_columns(name, path, records, cfg)
    for i, rec in enumerate(records):
        try:
            rows.append(to_row(name, path, i, rec, cfg))
        except BadRowError as e:
            if not cfg.skip_bad_rows:
                raise BadRowError(
                    f"{e}; fix the row or set data.skip_bad_rows=true to skip and count such rows"
                ) from None
            skipped.append(str(e))
    if skipped:
        log.warning("dataset %s: skipped %d bad rows, e.g. %s", name, len(skipped), skipped[0])
    if not rows:
        raise ValueError(f"dataset {name!r} ({path}) has no usable rows ({len(skipped)} skipped as bad)")
    return rows, skipped


def check_columns(name: str, path: str, records: list, cfg: DataConfig) -> None:
    """A column that no row has is a wrong data.*_key, not a file of bad rows: say which key to set."""
    objects = [r for r in records if isinstance(r, dict)]
    prompt = (
        ("messages_key", cfg.messages_key, "chat messages")
        if cfg.messages_key
        else ("prompt_key", cfg.prompt_key, "prompt")
    )
    for setting, key, what in (prompt, ("answer_key", cfg.answer_key, "reference answer")):
        if objects and not any(key in r for r in objects):
            columns = sorted({c for r in objects for c in r})
            shown = f"{columns[:20]}" + (f" and {len(columns) - 20} more" if len(columns) > 20 else "")
            raise ValueError(
                f"dataset {name!r} ({path}): no row has the column {key!r} (data.{setting}); its columns are {shown}: "
                f"set data.{setting} to the column that holds the {what}"
            )


def to_row(name: str, path: str, i: int, rec: dict | BadRowError, cfg: DataConfig) -> PromptRow:
    if isinstance(rec, BadRowError):  # a line read_records could not decode or parse
        raise rec
    where = f"{path} row {i}"
    if not isinstance(rec, dict):
        raise BadRowError(f"{where}: expected an object with columns, got {type(rec).__name__}")
    messages = None
    if cfg.messages_key:
        messages = rec.get(cfg.messages_key)
        if not isinstance(messages, list) or not messages:
            raise BadRowError(f"{where} field {cfg.messages_key!r}: missing or not a non-empty list of messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise BadRowError(f"{where} field {cfg.messages_key!r}: each message needs 'role' and 'content' text")
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
        if not prompt.strip():
            raise BadRowError(f"{where} field {cfg.messages_key!r}: the prompt message is empty")
    else:
        if cfg.prompt_key not in rec:
            raise BadRowError(f"{where} field {cfg.prompt_key!r}: missing (columns: {sorted(rec)})")
        prompt = rec[cfg.prompt_key]
        if not isinstance(prompt, str) or not prompt.strip():
            raise BadRowError(f"{where} field {cfg.prompt_key!r}: empty or not text ({prompt!r:.60})")
    if cfg.answer_key not in rec or rec[cfg.answer_key] is None:
        raise BadRowError(f"{where} field {cfg.answer_key!r}: missing (columns: {sorted(rec)})")
    answer = _answer_text(rec[cfg.answer_key], f"{where} field {cfg.answer_key!r}")
    if not answer:
        raise BadRowError(f"{where} field {cfg.answer_key!r}: empty answer")
    meta = rec.get(cfg.metadata_key) if cfg.metadata_key else None
    if meta is not None and not isinstance(meta, dict):
        raise BadRowError(f"{where} field {cfg.metadata_key!r}: expected an object, got {type(meta).__name__}")
    return PromptRow(name, path, i, prompt, answer, messages, dict(meta or {}))


def _answer_text(answer, where: str) -> str:
    """The reference answer as text: a string, or a finite number in its usual form (2.0 -> "2")."""
    if isinstance(answer, str):
        return answer.strip()
    if isinstance(answer, (int, float, Decimal)) and not isinstance(answer, bool) and math.isfinite(answer):
        return str(int(answer) if isinstance(answer, float) and answer.is_integer() else answer)
    raise BadRowError(
        f"{where}: the answer must be text or a finite number, not {type(answer).__name__} {answer!r:.60}; write it "
        'as a string (e.g. "[1, 2]") if that is the answer'
    )


def load_split(spec: str, cfg: DataConfig, field: str) -> dict[str, tuple[list[PromptRow], list[str]]]:
    return {name: load_rows(name, path, cfg) for name, path in parse_specs(spec, field)}


def check_no_overlap(train: list[PromptRow], evals: dict[str, list[PromptRow]]) -> None:
    """Eval rows must never be trained on: any eval prompt that is also a train prompt stops the run."""
    seen = {r.key: r for r in train}
    for name, rows in evals.items():
        for r in rows:
            if r.key in seen:
                t = seen[r.key]
                raise ValueError(
                    f"eval dataset {name!r} ({r.source} row {r.row}) has the prompt of train row {t.row} of "
                    f"{t.source}: {r.prompt[:80]!r}; held-out rows must not be trained on: remove it from one of them"
                )


class PromptDataset:
    """Rows in a seeded shuffled order, reshuffled each epoch; ``take(n)`` walks it, crossing epochs as needed.
    The position (epoch, index) is a small dict for checkpoints; ``load_state_dict`` refuses another dataset."""

    def __init__(self, rows: list[PromptRow], *, seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[PromptRow]:
        out = []
        while len(out) < n:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "num_rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["num_rows"] != len(self.rows) or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data position is for {state['num_rows']} rows with seed {state['seed']}, this run "
                f"has {len(self.rows)} rows with seed {self.seed}; resume with the same data.train and seed"
            )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._order_of(self.epoch)


def check_data(cfg) -> None:
    """Before a run starts: every dataset of data.train and data.eval reads and maps row by row, no eval row is
    a train row, and every reward the run or a row names exists (miles.reward.catalog). (Prompt lengths need the
    tokenizer: the sample source checks them when it renders a row.)"""
    train = [r for rows, _ in load_split(cfg.data.train, cfg.data, "train").values() for r in rows]
    evals = {name: rows for name, (rows, _) in load_split(cfg.data.eval, cfg.data, "eval").items()}
    check_no_overlap(train, evals)
    check_rewards(cfg, train + [r for rows in evals.values() for r in rows])
    if cfg.eval.max_problems:
        evals = {name: rows[: cfg.eval.max_problems] for name, rows in evals.items()}
    warn_repeated_eval_rows(evals)


def warn_repeated_eval_rows(evals: dict[str, list[PromptRow]]) -> int:
    """How many eval rows repeat the prompt of an earlier one, with one warning if any. Not refused: a public
    benchmark file may hold repeats the user cannot change, and the figures stay well defined (each copy is one
    more problem); but the repeated problem weighs twice in mean@k and pass@k, which the user should know."""
    first_of: dict[str, PromptRow] = {}
    repeats = []
    for rows in evals.values():
        for r in rows:
            first = first_of.setdefault(r.key, r)
            if first is not r:
                repeats.append((r, first))
    if repeats:
        r, first = repeats[0]
        log.warning(
            "data.eval: %d row(s) repeat the prompt of an earlier eval row (e.g. %s row %d = %s row %d: %r); each "
            "copy counts again in mean@k and pass@k: remove the repeats for a figure over distinct problems",
            len(repeats),
            r.source,
            r.row,
            first.source,
            first.row,
            r.prompt[:80],
        )
    return len(repeats)

"""Configs of the data side: the prompt datasets a run trains on (``data``) and its held-out eval (``eval``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from miles.data.verify import REWARDS


@dataclass(kw_only=True, slots=True)
class DataConfig:
    # comma-separated datasets: a .jsonl or .parquet file, or a `datasets` save_to_disk directory ('dir::split'
    # picks a split of a DatasetDict); 'name=path' names one (default: the file stem; eval.jsonl in data/ is
    # data_eval, so no metric reads eval/eval/...). "" = use `task`
    train: str = ""
    eval: str = ""  # held-out datasets, same forms; scored every eval.every steps, never trained on
    prompt_key: str = "prompt"  # column holding the prompt text
    messages_key: str = ""  # column of chat messages [{"role", "content"}, ...], used instead of prompt_key when set
    answer_key: str = "answer"  # column holding the reference answer (a string or a number)
    metadata_key: str = "metadata"  # optional dict column; its 'verifier' picks the reward when data.reward = 'auto'
    chat_template: bool = True  # render prompts with the tokenizer's chat template (False: raw text after BOS)
    system_prompt: str = ""  # a system message put before each prompt when the chat template is applied
    reward: str = "auto"  # auto (row metadata 'verifier', else math), math, math_format, countdown, or module:function
    # every reward call (data.reward, task.reward, eval scoring) beyond the linear-time fast path runs in a reward
    # worker process (miles.reward) under this wall-clock limit; a call past it is killed with its worker
    reward_timeout_s: float = 5.0
    # the reward of a call that raised, timed out or returned a non-finite number: counted per step in
    # reward/errors and reward/timeouts (eval: eval/reward_*), the first of each step written to
    # run_dir/reward_errors/step_000N.json (eval_step_000N.json).
    # "raise" stops the run at the first one instead (in an RL step, the steps before it are saved: fix the
    # reward and rerun to resume)
    reward_on_error: str = "0"
    reward_workers: int = 0  # reward worker processes; 0 = min(4, CPU cores)
    reward_memory_gb: float = 4.0  # data-segment cap of each reward worker (MemoryError past it); 0 = no cap
    skip_bad_rows: bool = False  # False: a bad row stops the run naming file/row/field; True: skipped and counted
    max_prompt_tokens: int = 0  # longer prompts are bad rows; 0 = engine max_seq_len - rollout.max_new_tokens

    def __post_init__(self):
        for field, spec in (("train", self.train), ("eval", self.eval)):
            for name, path in parse_specs(spec, field):
                if not Path(path.split("::")[0]).exists():
                    raise ValueError(
                        f"data.{field}: dataset {name!r} at {path!r} does not exist; give a .jsonl or .parquet file "
                        "or a datasets save_to_disk directory (python -m miles.data.generate OUT_DIR writes some)"
                    )
        if not (self.prompt_key or self.messages_key):
            raise ValueError("data.prompt_key and data.messages_key are both empty; name the column with the prompt")
        if not self.answer_key:
            raise ValueError("data.answer_key is empty; name the column with the reference answer")
        if self.reward != "auto" and self.reward not in REWARDS and ":" not in self.reward:
            raise ValueError(
                f"data.reward = {self.reward!r}; use auto, {', '.join(REWARDS)}, or 'module:function' "
                "(fn(prompt, response, target) -> float)"
            )
        if not self.reward_timeout_s > 0 or self.reward_workers < 0 or self.reward_memory_gb < 0:
            raise ValueError(
                f"data.reward_timeout_s = {self.reward_timeout_s}, data.reward_workers = {self.reward_workers}, "
                f"data.reward_memory_gb = {self.reward_memory_gb}: need a timeout > 0 and the others >= 0"
            )
        self.error_reward  # noqa: B018 (raises for a bad reward_on_error)
        if self.max_prompt_tokens < 0:
            raise ValueError(f"data.max_prompt_tokens = {self.max_prompt_tokens} must be >= 0 (0: from the engine)")

    @property
    def error_reward(self) -> float | None:
        """reward_on_error as a number; None for "raise"."""
        if self.reward_on_error.strip().lower() == "raise":
            return None
        try:
            value = float(self.reward_on_error)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"data.reward_on_error = {self.reward_on_error!r}; use a finite number (e.g. 0) or 'raise'"
            )
        return value


# eval.k's ceiling: 4x the largest k of published pass@k curves (1024, RL-vs-base studies of reasoning models); an
# eval of 500 problems at k = 4096 already generates 2M completions, and k = 1e9 is a typo, not a measurement
MAX_EVAL_K = 4096


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0  # RL steps between held-out evals of data.eval; 0 = only before the first step and at the end
    k: int = 4  # samples per problem for mean@k and pass@k
    temperature: float = 0.7  # sampling temperature of the k samples
    greedy: bool = True  # also one greedy completion per problem (pass@1 greedy)
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
    max_problems: int = 0  # per dataset; 0 = all of its rows
    at_start: bool = True  # evaluate the initial policy before the first RL step (the measured start)

    def __post_init__(self):
        if self.every < 0 or self.k < 1 or self.max_new_tokens < 0 or self.max_problems < 0:
            raise ValueError(
                f"eval.every = {self.every}, eval.k = {self.k}, eval.max_new_tokens = {self.max_new_tokens}, "
                f"eval.max_problems = {self.max_problems}: need every >= 0, k >= 1, the others >= 0"
            )
        if self.k > MAX_EVAL_K:
            raise ValueError(
                f"eval.k = {self.k} samples per problem is over the limit of {MAX_EVAL_K} (each eval generates "
                "k x problems completions); use e.g. eval.k=16"
            )
        if not self.temperature > 0:
            raise ValueError(f"eval.temperature = {self.temperature} must be > 0 (greedy decoding is eval.greedy)")


# dataset names that read wrong in the metric names eval/<name>/...
RESERVED_NAMES = {"eval": "eval/eval/... doubles the prefix", "all": "eval/all/... is every dataset together"}


def parse_specs(spec: str, field: str = "train") -> list[tuple[str, str]]:
    """'a.jsonl, math=b.parquet' -> [('a', 'a.jsonl'), ('math', 'b.parquet')]; names must be distinct. A file
    named like a reserved name takes its folder's name in front: 'data/eval.jsonl' -> 'data_eval'."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep:
            path = name
            file = Path(path.split("::")[0].rstrip("/"))
            name = file.name.removesuffix(".jsonl").removesuffix(".parquet")
            if name in RESERVED_NAMES:
                name = f"{file.absolute().parent.name or 'data'}_{name}"
        elif name.strip() in RESERVED_NAMES:
            raise ValueError(
                f"data.{field} = {spec!r} names a dataset {name.strip()!r} ({RESERVED_NAMES[name.strip()]}); "
                f"name it otherwise, e.g. heldout={path.strip()}"
            )
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"data.{field} = {spec!r} names a dataset twice ({names}); name them with 'name=path'")
    return out


def check_run(cfg) -> None:
    """The data and eval settings against the rest of the run config."""
    d, e = cfg.data, cfg.eval
    if d.train and cfg.task.name == "swe":
        raise ValueError("data.train and task.name = 'swe' both choose the samples; unset one of them")
    if d.train and getattr(cfg.rollout, "dynamic_sampling", False):
        raise ValueError(
            "rollout.dynamic_sampling refills from the task's prompt streams; with data.train it is not supported "
            "yet: set rollout.dynamic_sampling=false"
        )
    if e.every and not d.eval:
        raise ValueError(f"eval.every = {e.every} needs held-out datasets: set data.eval (or eval.every=0)")
    if d.messages_key and not d.chat_template:
        raise ValueError("data.messages_key needs data.chat_template=true: chat messages are rendered by the template")

"""The synchronous, colocated RL loop, the only one: on a Ray cluster (miles.cluster) or in this process
(miles.colocated) alike. Mode differences live in the HandoffPlan, decided before the loop."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from miles.checkpoints import step_dir_name
from miles.cluster import Cluster
from miles.config import RunConfig
from miles.data.dataset import check_data
from miles.handoff.planner import resolve_plan
from miles.memory.ledger import pool_peaks
from miles.rollout.tasks import RewardError
from miles.rollout_dump import RolloutDumpWriter
from miles.rollout_window import RolloutWindow
from miles.run_dir import RunDir
from miles.stall.watchdog import StallError
from miles.trackers import Trackers

if TYPE_CHECKING:
    from miles.colocated import Colocated  # imported where it runs: its rollout and trainer imports take seconds

log = logging.getLogger("miles")


def train(
    cfg: RunConfig,
    *,
    progress: bool = True,
    stop: threading.Event | None = None,
    on_step=None,
    cluster: Callable[[RunConfig], Cluster | Colocated] | None = None,
) -> list[dict]:
    """Run ``cfg.num_steps`` RL steps (resuming from the last checkpoint); returns the metrics rows.
    ``cluster(cfg)`` makes what the loop runs on: Ray actors (Cluster, the default), or this process (Colocated)."""
    check_data(cfg)  # datasets readable, row by row, and no eval row in train: before Ray starts or a file changes
    run = RunDir.open(cfg.run_dir, resume=cfg.resume, overwrite=cfg.overwrite, config=cfg.to_dict())  # locked
    with run, say_what_is_saved(run):
        plan = resolve_plan(cfg)
        log.info(plan.describe())
        with (cluster or Cluster)(cfg) as c, Trackers.open(cfg.log, run, config=cfg.to_dict()):
            book = Bookkeeper(cfg, run, c, on_step)
            # the stall watchdog (miles.stall.watchdog) or a node that left the cluster ends the run here, in one line
            with book.stops_on_stall(), book.stops_on_node_loss():
                start = book.find_checkpoint()
                # the trainer exists from the plan's trainer.build step on; a resumed run is warm already
                warm_up = lambda: book.saved_step is None and warmup(cfg, c, book)  # noqa: E731
                book.ledger(-1, c.execute(plan.init, version=start, phase="init", built=book.resume, warm_up=warm_up))
                if c.placement is not None:  # where each actor runs (miles.cluster_nodes); none in one process
                    run.append_placement(start, c.placement.rows())
                window = RolloutWindow(c, cfg, start)  # rollouts up to async.max_staleness steps ahead (0: none)
                with StopOnCtrlC(stop) as stop:  # the first Ctrl-C ends the loop at a step boundary, saved
                    for step in book.progress(range(start, cfg.num_steps), progress):
                        if stop.is_set():
                            book.checkpoint(step, reason="stopped")
                            book.evaluate(step, end=True)
                            break
                        book.evaluate(step)
                        t0 = time.perf_counter()
                        batches, rollout = book.generate(window, step)
                        moved = c.execute(plan.rollout_to_train, phase="rollout_to_train")
                        results = c.trainer.train(batches, want_log_probs=cfg.dump_rollouts, step=step)
                        window.before_sync()  # no rollout generates across a sync, unless async.partial_rollout
                        moved |= c.execute(plan.train_to_rollout, version=step + 1, phase="train_to_rollout")
                        book.record(step, rollout, results, moved, time.perf_counter() - t0)
                    else:
                        book.checkpoint(cfg.num_steps, reason="end")
                        book.evaluate(cfg.num_steps, end=True)
    return book.rows


def train_in_process(cfg: RunConfig, *, device: str = "cpu", disk_dir: str | None = None) -> Colocated:
    """``train`` in this process, without Ray (one trainer rank): what the handoff tests, benchmark and notebooks
    measure. Returns the Colocated it ran on, whose ``records`` and ``events`` hold every executed step."""
    from miles.colocated import Colocated

    made: list[Colocated] = []
    train(cfg, progress=False, cluster=lambda c: made.append(Colocated(c, device, disk_dir)) or made[0])
    return made[0]


def warmup(cfg: RunConfig, c: Cluster | Colocated, book: "Bookkeeper") -> None:
    """Supervised steps on reference answers before RL (RunConfig.trainer.warmup_sft_steps); not RL steps."""
    n = cfg.trainer.warmup_sft_steps
    if n:  # the progress bar counts RL steps: without this line the warm-up passes in silence
        log.info("supervised warm-up: %d steps (trainer.warmup_sft_steps) before RL step 0", n)
    for i in range(n):
        c.watchdog.phase("warm-up")  # each supervised step is progress
        batches = c.sft_batches(i)
        m = c.trainer.sft(batches, lr=cfg.trainer.warmup_sft_lr)[0]
        book.run_dir.append_metrics({"phase": "sft", "sft_step": i, **m})
    if n and cfg.model.lora.warmup == "base":  # the base it trained is frozen; RL trains the adapters on it
        c.trainer.end_warmup()
    if n:
        c.trainer.set_lr(cfg.trainer.lr)


class Bookkeeper:
    """Everything around the loop that is not the loop: resume, metrics, ledger, dumps, checkpoints, progress."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, cluster: Cluster | Colocated, on_step=None):
        self.cfg, self.run_dir, self.c, self.on_step = cfg, run_dir, cluster, on_step
        self.rows: list[dict] = []
        self.pool_bytes = {"device": 0, "host": 0, "disk": 0}
        self.bar = None
        self.saved_step: int | None = None  # the step of the newest checkpoint this run loaded or wrote
        self.found = None  # (next_step, path) of the checkpoint to resume from (find_checkpoint)
        self.dump_failures = 0
        self.t_start = time.perf_counter()

    def find_checkpoint(self) -> int:
        """The RL step this run starts at: after the newest verified checkpoint (resume=true), else 0."""
        self.found = self.run_dir.checkpoints.latest() if self.cfg.resume else None
        return self.found[0] if self.found else 0

    def resume(self) -> None:
        """Once the trainer is built: load the checkpoint found, then start every log at its step; config.json is
        written only now, so a resume that fails to load leaves the run's record as it was."""
        next_step = 0
        if self.found:
            next_step, path = self.found
            log.warning("resuming from %s (next RL step %d)", path, next_step)
            self.c.trainer.load_checkpoint(str(path))
            self.saved_step = next_step
            self.c.load_data_state(path)  # the dataset's epoch position (miles.data.source)
        self.run_dir.begin(next_step, self.cfg.to_json(), resumed=self.found is not None)
        self.rows = [r for r in self.run_dir.metrics() if "phase" not in r]  # RL rows (not sft or eval)

    def generate(self, window: RolloutWindow, step: int):
        try:
            return window.take(step)
        except Exception as e:
            cause = _root_cause(e)
            if isinstance(cause, RewardError):
                self.checkpoint(step, reason="reward function failed")
                raise RewardError(
                    f"RL step {step}: {cause}. Steps before {step} are saved in {self.run_dir.ckpt_root}; "
                    f"fix the reward and rerun the same command to resume."
                ) from None
            raise

    def record(self, step: int, rollout: dict, results: list, moved: dict, seconds: float) -> None:
        self.c.watchdog.step_done(seconds)
        self.c.watchdog.phase("record")
        train = _mean([m for m, _ in results])
        events, samples = self.c.drain_ledgers()
        peaks = self.ledger(step, moved, events, samples)
        row = {
            "step": step,
            **rollout,
            **train,
            **self.c.sync_metrics,
            **peaks,
            "time/step": seconds,
            "samples_per_s": self.cfg.rollout.num_prompts_per_step * self.cfg.rollout.n_samples_per_prompt / seconds,
            "tokens_per_s": rollout["total_tokens"] / seconds,
        }
        self.run_dir.append_metrics(row)
        self.rows.append(row)
        if self.cfg.dump_rollouts:
            self.dump(step, {k: v for _, lps in results for k, v in lps.items()})
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row['reward']:.3f}", loss=f"{row.get('loss', 0):.3f}")
        if self.on_step:
            self.on_step(row)
        every = self.cfg.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.cfg.num_steps:
            self.checkpoint(step + 1, reason="periodic")

    def evaluate(self, step: int, *, end: bool = False) -> None:
        """Held-out eval of data.eval (miles.data.eval) when due: before step 0, every eval.every steps, at the end."""
        e = self.cfg.eval
        due = end or (step == 0 and e.at_start) or (e.every and step and step % e.every == 0)
        if self.cfg.data.eval and due:
            metrics = self.c.evaluate(step)
            since = time.perf_counter() - self.t_start
            self.run_dir.append_metrics({"step": step, "phase": "eval", **metrics, "time/since_start": since})
            log.info("eval at step %d: %s", step, {k: round(v, 3) for k, v in metrics.items() if "/all/" in k})

    def ledger(self, step: int, moved: dict, events=None, samples=None) -> dict:
        if events is None:
            events, samples = self.c.drain_ledgers()
        self.run_dir.append_ledger(step, events, samples)
        out = {f"mem/{pool}_peak": v for pool, v in pool_peaks(events, self.pool_bytes).items()}
        out |= {f"moved/{k}": v for k, v in moved.items()}
        if samples:
            out["mem/rss_max"] = max(s.rss_bytes for s in samples)
        return out

    def dump(self, step: int, train_log_probs: dict) -> None:
        rows = self.c.sample_rows(train_log_probs, step)
        try:
            RolloutDumpWriter(run_dir=self.run_dir.path).write_step(step, rows)
        except OSError as e:  # the dashboard's copy, not the run: training goes on
            self.dump_failures += 1
            log.warning(
                "RL step %d: rollout dump not written (%s); training continues (%d dumps missing so far)",
                step,
                e,
                self.dump_failures,
            )

    def checkpoint(self, next_step: int, reason: str) -> None:
        if self.saved_step is not None and next_step <= self.saved_step:
            if next_step < self.saved_step:
                log.warning(
                    "num_steps = %d: the run is already at RL step %d; nothing to do", next_step, self.saved_step
                )
            return  # nothing trained since that checkpoint
        if next_step == 0 and reason != "end":
            return
        try:
            path = self.c.save_checkpoint(self.run_dir, next_step)
        except Exception as e:
            cause = _root_cause(e)
            if not isinstance(cause, OSError) and type(cause).__name__ != "SafetensorError":
                raise
            raise CheckpointError(
                f"checkpoint {self.run_dir.ckpt_root / step_dir_name(next_step)} could not be written "
                f"({type(cause).__name__}: {cause}); {saved_message(self.run_dir, lead='the run stops here')}"
            ) from None
        self.saved_step = next_step
        log.info("checkpoint %s (%s)", path, reason)

    @contextlib.contextmanager
    def stops_on_stall(self):
        """A stall (miles.stall.watchdog) ends the run with StallError: one line naming the phase, the directory of the
        stacks, and what a rerun resumes from. After a stall on the rollout side (generate, reward, eval) the
        trainer is sound, so the steps before it are saved first, as after a failed reward; after any other, the
        newest checkpoint on disk is what is kept."""
        try:
            yield
        except Exception:
            if self.c.watchdog.stall is None:
                raise
        stall = self.c.watchdog.stall
        if stall is None:
            return
        self.c.watchdog.stopped.wait(60)  # the stuck side's processes are gone (the driver woke as they died)
        if stall.trainer_sound and stall.step is not None:
            try:
                self.checkpoint(stall.step, reason="stalled")
            except Exception as e:  # the line below still says truthfully what is saved
                log.warning("after the stall, RL steps before %d could not be saved: %s", stall.step, e)
        raise StallError(f"{stall.line}; {saved_message(self.run_dir, lead='the run is stopped')}") from None

    @contextlib.contextmanager
    def stops_on_node_loss(self):
        """A node of the run that left the Ray cluster ends it with NodeLostError: the node, what ran there, and what
        a rerun resumes from (a checkpoint is written whole or not at all, so those on disk are intact)."""
        try:
            yield
        except Exception as e:
            lost = self.c.lost_node(e)
            if lost is None:
                raise
            on_the_rest = "it on the nodes left (nothing pinned to the lost node)"
            raise type(lost)(f"{lost}. {saved_message(self.run_dir, 'The run is stopped', on_the_rest)}") from None

    def progress(self, steps, enabled: bool):
        if not enabled:
            return steps
        from tqdm.auto import tqdm

        self.bar = tqdm(
            steps, desc=f"miles {self.cfg.recipe}", unit="step", initial=steps.start, total=self.cfg.num_steps
        )
        return self.bar


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, read-only, ...); earlier ones are intact."""


class StopOnCtrlC:
    """Inside the loop the first Ctrl-C (SIGINT) sets the stop event, so the step in flight completes and is saved;
    a second one raises KeyboardInterrupt at once. Only the main thread can take signals: elsewhere (a notebook's
    run thread) this is the caller's event alone."""

    def __init__(self, event: threading.Event | None):
        self.event = event or threading.Event()
        self.interrupted = False
        self._previous = None

    def is_set(self) -> bool:
        return self.event.is_set()

    def _on_sigint(self, signum, frame) -> None:
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        self.event.set()
        log.warning("Ctrl-C: stopping after the current RL step, which is saved (press Ctrl-C again to quit now)")

    def __enter__(self) -> "StopOnCtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self.interrupted and exc_type is None:
            raise KeyboardInterrupt  # stopped and saved; the caller still learns it was interrupted


@contextlib.contextmanager
def say_what_is_saved(run: RunDir):
    """KeyboardInterrupt leaves with a message that names the newest checkpoint, or says that none exists."""
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(saved_message(run)) from None


def saved_message(run_dir: RunDir, lead: str = "interrupted", rerun: str = "the same command") -> str:
    """What a rerun of the same command (or ``rerun``) resumes from, truthfully."""
    steps = run_dir.checkpoints.steps()
    if steps:
        return f"{lead}; RL steps before {steps[0][0]} are saved in {steps[0][1]}: rerun {rerun} to resume"
    return f"{lead}; no checkpoint is saved in {run_dir.path}, so a rerun of {rerun} starts from RL step 0"


def _mean(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def _root_cause(e: BaseException) -> BaseException:
    """Ray wraps actor exceptions; find the original one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return _root_cause(cause)
    return e

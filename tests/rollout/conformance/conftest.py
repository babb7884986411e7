"""The conformance suite's servers: ``miles serve`` apps on loopback sockets, checked against what sglang
0.5.10.post1 answers (its ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``tokenizer_manager.py``, ``schedule_batch.py``, ``sampling/sampling_params.py``, ``entrypoints/openai/
protocol.py``) to the request shapes real clients send (THUDM/slime, radixark/miles). Nothing here is taken from
miles' own tests; these files hold no test of miles' own behaviour.

``crafted(token)``: a server whose model emits ``token`` with probability ~1 whatever the prompt, so text, stop
and EOS cases are deterministic: attention and MLP outputs zeroed (the residual stream is the input embedding),
every embedding row ones except the target's, twos (tied lm_head: the target's logit leads by hidden_size).
"""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engine import EmbeddedEngine
from miles.rollout.server import EngineServer
from tests.conftest import tiny_run_cfg
from tests.rollout.conftest import ThreadedServer

A, EOS = 97, 258  # 'a' and the byte tokenizer's <eos>


@pytest.fixture(scope="module")
def conf_cfg(tmp_path_factory):
    return tiny_run_cfg(tmp_path_factory.mktemp("conformance"), "rollout.max_batch_size=8", "rollout.max_seq_len=64")


def crafted_weights(engine, token: int) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, w in engine.named_weights().items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            out.append((name, torch.zeros_like(w)))
        elif name == "model.embed_tokens.weight":
            e = torch.ones_like(w)
            e[token] = 2.0
            out.append((name, e))
    return out


@pytest.fixture(scope="module")
def servers(conf_cfg):
    """``servers(token=None)``: a server (random weights, or crafted to emit ``token`` when it is an int; any other
    key gives a server of its own), one per key per module."""
    opened: dict = {}

    def get(token=None) -> ThreadedServer:
        if token not in opened:
            engine = EmbeddedEngine.from_config(conf_cfg, "cpu")
            if isinstance(token, int):
                engine.update_weights_from_tensor(crafted_weights(engine, token))
            opened[token] = ThreadedServer(EngineServer(engine, batch_wait_ms=2)).__enter__()
        return opened[token]

    yield get
    for s in opened.values():
        s.__exit__()

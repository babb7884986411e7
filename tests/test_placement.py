"""Placement over several nodes, in pure logic: the trainer's bundles and pins, the refusals of a cluster that cannot
host a run (named node, need and fix, before anything is launched), LOCAL_RANK per node, the transports that need
one host, and cluster.address (its old name ray_address included). The real two-node run is tests/test_cluster_nodes.py.
"""

import socket
import time

import pytest

from miles.config import apply_overrides
from miles.nodes import ClusterUnreachable, probe_address
from miles.placement import (
    NodeCheckError,
    check_nodes,
    local_ranks,
    same_host_refusal,
    trainer_bundles,
    trainer_strategy,
)
from miles.recipes import quickstart


def _node(ip: str, cpu: float = 2, gpu: float = 0, **custom) -> dict:
    res = {"CPU": cpu, "memory": 1e9, f"node:{ip}": 1.0, **custom, **({"GPU": gpu} if gpu else {})}
    return {"NodeID": f"id-{ip}", "NodeManagerAddress": ip, "Alive": True, "Resources": res}


def _cfg(*overrides):
    return apply_overrides(quickstart(), ["trainer.world_size=2", *overrides])


def test_each_rank_gets_a_bundle_with_its_pin_and_spread_or_pack_picks_rays_strategy():
    cfg = _cfg("cluster.trainer_nodes=node_b,node:10.0.0.1", "cluster.trainer_placement=spread")
    assert trainer_bundles(cfg.cluster, 2, gpu=1) == [
        {"CPU": 1, "GPU": 1, "node_b": 0.001},
        {"CPU": 1, "GPU": 1, "node:10.0.0.1": 0.001},
    ]
    assert trainer_strategy(cfg.cluster) == "SPREAD" and trainer_strategy(_cfg().cluster) == "PACK"
    assert trainer_bundles(_cfg().cluster, 2, gpu=0) == [{"CPU": 1}, {"CPU": 1}]


def test_local_rank_counts_the_ranks_of_each_node_in_rank_order():
    assert local_ranks(["a", "b", "a", "a"]) == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert local_ranks(["a"]) == [(0, 1)]


def test_a_pin_no_node_has_is_refused_naming_the_nodes_there_are():
    cfg = _cfg("cluster.trainer_nodes=node_c,node_a")
    nodes = [_node("10.0.0.1", node_a=1), _node("10.0.0.2", node_b=1)]
    with pytest.raises(
        NodeCheckError, match=r"rank\(s\) \[0\] to 'node_c', a resource no live node .* 10.0.0.2 \(CPU 2"
    ):
        check_nodes(cfg, 0, nodes)
    dead = {**_node("10.0.0.3", node_c=1), "Alive": False}
    with pytest.raises(NodeCheckError, match="node_c"):
        check_nodes(cfg, 0, [*nodes, dead])  # a dead node's resources count for nothing
    check_nodes(cfg, 0, [*nodes, _node("10.0.0.3", node_c=1)])


def test_a_node_without_the_gpus_or_cpus_of_the_ranks_pinned_to_it_is_refused_with_the_fix():
    nodes = [_node("10.0.0.1", gpu=8, node_a=1), _node("10.0.0.2", cpu=1, gpu=0, node_b=1)]
    cuda = _cfg("device=cuda", "cluster.trainer_nodes=node_b,node_a")
    with pytest.raises(NodeCheckError, match=r"device = 'cuda': trainer rank\(s\) \[0\] need 1 GPU .* 'node_b' have 0"):
        check_nodes(cuda, 1, nodes)
    both_on_b = _cfg("cluster.trainer_nodes=node_b,node_b")
    with pytest.raises(NodeCheckError, match=r"\[0, 1\] need 2 CPU .* have 1.*--num-cpus"):
        check_nodes(both_on_b, 0, nodes)
    check_nodes(_cfg("device=cuda", "cluster.trainer_nodes=node_a,node_a"), 1, nodes)


def test_a_cluster_without_gpus_for_every_rank_is_refused_before_launch():
    cfg = _cfg("device=cuda", "trainer.world_size=4", "rollout.num_prompts_per_step=4")
    nodes = [_node("10.0.0.1", gpu=2), _node("10.0.0.2", gpu=1)]
    with pytest.raises(NodeCheckError, match=r"need 4 GPU .* live nodes have 3: 10.0.0.1 \(CPU 2, GPU 2\)"):
        check_nodes(cfg, 1, nodes)


def test_engine_pins_must_name_a_node_and_real_sglang_engines_must_fit_its_gpus():
    nodes = [_node("10.0.0.1", gpu=4, node_a=1)]
    http = _cfg("rollout.engine=http", "rollout.num_engines=2", "cluster.engine_nodes=node_a,node_x")
    with pytest.raises(NodeCheckError, match="cluster.engine_nodes names 'node_x'"):
        check_nodes(http, 0, nodes)
    sglang = _cfg(
        "rollout.engine=sglang",
        "rollout.num_engines=3",
        "rollout.sglang_args=--tp-size,2",
        "model.checkpoint=/ckpt",
        "cluster.engine_nodes=node_a,node_a,node_a",
        "sync.transport=broadcast",
    )
    with pytest.raises(NodeCheckError, match=r"3 SGLang engine\(s\) of 2 GPU\(s\) each on 'node_a'.* has 4 GPU"):
        check_nodes(sglang, 1, nodes)


def test_pins_are_checked_against_the_run_when_the_config_is_built():
    with pytest.raises(ValueError, match="1 entry for trainer.world_size = 2 ranks"):
        _cfg("cluster.trainer_nodes=node_a")
    with pytest.raises(ValueError, match="rollout.engine = 'embedded'.*cluster.rollout_node"):
        _cfg("cluster.engine_nodes=node_a")
    with pytest.raises(ValueError, match="2 entries for rollout.num_engines = 1"):
        _cfg("rollout.engine=http", "cluster.engine_nodes=node_a,node_b")
    with pytest.raises(ValueError, match="not a Ray resource name"):
        _cfg("cluster.rollout_node=node a")


def test_cluster_address_takes_auto_host_port_or_ray_client_and_ray_address_still_works(caplog):
    for good in ("", "auto", "10.0.0.1:6379", "ray://head:10001", "[::1]:6379"):
        assert _cfg(f"cluster.address={good}").cluster.address == good
    for bad in ("head", "head:", "head:99999", "ray://head"):
        with pytest.raises(ValueError, match="should be 'auto', 'host:port'"):
            _cfg(f"cluster.address={bad}")
    moved = _cfg("ray_address=ray://head:10001")
    assert moved.cluster.address == "ray://head:10001" and moved.ray_address == ""
    assert "ray_address is now cluster.address" in caplog.text
    with pytest.raises(ValueError, match="disagree; ray_address is the former name"):
        _cfg("ray_address=auto", "cluster.address=10.0.0.1:6379")


def test_same_host_transports_are_refused_toward_an_engine_on_another_node():
    here = [("engine 0", "n1", "10.0.0.1")]
    away = [("engine 0", "n1", "10.0.0.1"), ("engine 1", "n2", "10.0.0.2")]
    tensor = _cfg()
    assert same_host_refusal(tensor, "10.0.0.1", "n1", here) == ""
    why = same_host_refusal(tensor, "10.0.0.1", "n1", away)
    assert "sync.transport = 'tensor'" in why and "engine 1 on 10.0.0.2" in why and "sync.transport=broadcast" in why
    assert same_host_refusal(_cfg("sync.transport=broadcast"), "10.0.0.1", "n1", away) == ""


def test_an_address_where_nothing_listens_is_refused_within_the_wait_naming_it_and_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(
        ClusterUnreachable, match=rf"nothing answered at 127.0.0.1:{port} within 1.5 s.*ray start --head"
    ):
        probe_address(f"127.0.0.1:{port}", "127.0.0.1", port, 1.5)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ClusterUnreachable, match="does not resolve"):
        probe_address("no-such-host.invalid:6379", "no-such-host.invalid", 6379, 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        probe_address("x", "127.0.0.1", s.getsockname()[1], 5)  # a listener answers: no error


def test_an_engine_server_is_not_bound_beyond_loopback_without_an_api_key():
    from miles.rollout.launch import engine_server

    cfg = _cfg("rollout.engine=http")
    with pytest.raises(ValueError, match="would listen on 10.0.0.2, reachable from other machines, without an API key"):
        engine_server(cfg, 0, host="10.0.0.2", api_key="")
    proc = engine_server(cfg, 0, host="10.0.0.2", api_key="k")
    assert proc.env["MILES_API_KEY"] == "k" and proc.argv[proc.argv.index("--host") + 1] == "10.0.0.2"

"""Ports for the servers miles starts (miles.ports): below the OS's ephemeral range, checked free by binding."""

import socket

import pytest

import miles.ports as ports


def test_a_chosen_port_lies_below_the_ephemeral_range_and_can_be_bound():
    lo, _ = ports.ephemeral_range()
    for _ in range(20):
        p = ports.free_port()
        assert ports.LOWEST <= p < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped_and_a_run_of_ports_is_free_as_a_whole(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        offers = iter([taken, taken - 1])  # the run [taken - 1, taken] holds the taken port too
        real = ports.random.Random

        class Draws:
            def __init__(self, seed):
                self.fallback = real(seed)

            def randrange(self, a, b):
                return next(offers, None) or self.fallback.randrange(a, b)

        monkeypatch.setattr(ports.random, "Random", Draws)
        first = ports.free_ports(2)
        assert first not in (taken, taken - 1) and all(ports.is_free(first + i) for i in range(2))


def test_a_port_range_reads_one_port_a_range_or_nothing_and_names_its_setting_when_wrong():
    from miles.ports import port_range

    assert port_range("8100", "x", "8100") == [8100] and port_range(" 30000-30002 ", "x", "30000") == [
        30000,
        30001,
        30002,
    ]
    assert port_range("", "x", "8100") == []
    with pytest.raises(ValueError, match=r"rollout.sglang_ports = 'a-b' should be one port \('30000'\)"):
        port_range("a-b", "rollout.sglang_ports", "30000")
    with pytest.raises(ValueError, match="need 1 <= first <= last <= 65535"):
        port_range("9-3", "agents.session_ports", "8100")

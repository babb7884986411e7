"""Ports for the servers miles starts (miles.ports): below the OS's ephemeral range, checked free by binding."""

import socket

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

"""Actors build their model and run their hot methods on one thread (Ray's own when single-threaded, a compute thread
when threaded); in-process everything runs inline."""

import threading

import pytest
import ray

from miles.threads import actor_options, init_on_compute_thread, on_compute_thread

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


class Probe:
    @init_on_compute_thread("probe-compute")
    def __init__(self):
        self.built_on = threading.get_ident()

    @on_compute_thread
    def hot(self) -> int:
        return threading.get_ident()

    @on_compute_thread
    def hot_calling_hot(self) -> tuple[int, int]:
        return threading.get_ident(), self.hot()  # runs inline: a second hop would wait on itself

    @on_compute_thread
    def fails(self):
        raise KeyError("from the compute thread")

    def control(self) -> int:
        return threading.get_ident()


def test_in_a_threaded_actor_construction_and_hot_calls_share_one_thread_and_control_calls_do_not(ray_session):
    a = ray.remote(Probe).options(num_cpus=0, **actor_options(4)).remote()
    built_on = ray.get(a.__ray_call__.remote(lambda self: self.built_on))
    hot = {ray.get(a.hot.remote()) for _ in range(8)} | set(ray.get([a.hot.remote() for _ in range(8)]))
    assert hot == {built_on}
    outer, inner = ray.get(a.hot_calling_hot.remote())
    assert outer == inner == built_on
    assert built_on not in {ray.get(a.control.remote()) for _ in range(4)}
    try:
        ray.get(a.fails.remote())
        raise AssertionError("the error was lost")
    except ray.exceptions.RayTaskError as e:
        assert "from the compute thread" in str(e)
    ray.kill(a)


def test_a_single_threaded_actor_runs_everything_on_rays_one_thread_without_a_compute_thread(ray_session):
    a = ray.remote(Probe).options(num_cpus=0, **actor_options(1)).remote()
    built_on = ray.get(a.__ray_call__.remote(lambda self: self.built_on))
    assert ray.get(a.__ray_call__.remote(lambda self: self.compute)) is None
    assert {ray.get(a.hot.remote()) for _ in range(4)} | {ray.get(a.control.remote())} == {built_on}
    ray.kill(a)


def test_outside_an_actor_everything_runs_inline_on_the_callers_thread():
    p = Probe()
    me = threading.get_ident()
    assert p.compute is None and p.built_on == me and p.hot() == me and p.hot_calling_hot() == (me, me)

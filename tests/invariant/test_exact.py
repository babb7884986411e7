"""The CPU building blocks: each matches its reference, and an element's bits never depend on where it sits."""

import math

import pytest
import torch

from miles.invariant import exact


def _places(fn, x):
    """fn over x whole, and over every window of a few lengths at a few offsets: (whole, [(window result, slice)])."""
    whole = fn(x)
    out = []
    for n in (1, 3, 7, 16, 17, 31, 64, 100):
        for off in (0, 1, 5, 13):
            out.append((fn(x[off : off + n].clone()), slice(off, off + n)))
    return whole, out


def test_exp_matches_the_float64_reference_within_two_ulp_and_saturates_like_torch():
    x = torch.cat([torch.linspace(-87, 88, 200_001), torch.randn(10_000) * 3]).float()
    ref = torch.exp(x.double())
    got = exact.exp(x).double()
    ulp = (got - ref).abs() / (torch.nextafter(ref.float(), torch.tensor(math.inf)).double() - ref.float().double())
    assert ulp.max() <= 2.0
    edge = exact.exp(torch.tensor([-math.inf, -200.0, 100.0, math.inf, math.nan]))
    assert edge[:2].tolist() == [0.0, 0.0] and edge[2:4].tolist() == [math.inf, math.inf] and edge[4].isnan()


def test_log_matches_the_float64_reference_within_three_ulp():
    x = torch.cat([torch.linspace(1.0, 300_000.0, 100_001), torch.rand(10_000) * 10 + 1e-3]).float()
    ref = torch.log(x.double())
    got = exact.log(x).double()
    step = torch.nextafter(ref.float().abs(), torch.tensor(math.inf)).double() - ref.float().abs().double()
    assert ((got - ref).abs() / step).max() <= 3.0


@pytest.mark.parametrize(
    "fn",
    [exact.exp, lambda t: exact.log(t.abs() + 0.5), lambda t: exact.reciprocal_sqrt(t.abs() + 1e-3)],
    ids=["exp", "log", "reciprocal_sqrt"],
)
def test_an_elementwise_result_is_the_same_bits_at_every_position_of_any_tensor(fn):
    x = torch.randn(200) * 4
    whole, windows = _places(fn, x)
    for got, at in windows:
        assert torch.equal(got, whole[at])


def test_tree_sum_ignores_any_number_of_trailing_negative_zero_leaves_and_any_other_rows():
    x = torch.randn(5, 37)
    base = exact.tree_sum(x)
    for extra in (1, 27, 91):
        padded = torch.cat([x, torch.full((5, extra), -0.0)], 1)
        assert torch.equal(exact.tree_sum(padded), base)
    assert torch.equal(exact.tree_sum(x[2:3]), base[2:3])
    assert torch.equal(exact.tree_sum(x.T.contiguous(), 0), base)  # layout does not matter
    assert torch.allclose(base.double(), x.double().sum(-1), atol=1e-5)
    assert torch.equal(exact.tree_sum(torch.tensor([[0.0, -0.0]])), torch.tensor([0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_matmul_matches_reference_and_gives_each_row_the_same_bits_for_any_row_count(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 384, generator=g) * 0.05).to(dtype)
    x = torch.randn(700, 384, generator=g).to(dtype)
    whole = exact.exact_matmul(x, w)
    ref = x.double() @ w.double().T
    assert ((whole.double() - ref).abs().max() / ref.abs().max()) < 2e-6
    for rows in (slice(0, 1), slice(3, 5), slice(100, 117), slice(1, 700)):
        assert torch.equal(exact.exact_matmul(x[rows], w), whole[rows])
    perm = torch.randperm(700, generator=g)
    assert torch.equal(exact.exact_matmul(x[perm], w), whole[perm])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(exact.exact_matmul(x, w), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_fixed_point_grid_keeps_every_sum_below_two_to_the_53():
    for k in (1, 2, 64, 128, 384, 576, 1536, 4864, 8960, 1 << 16):
        b = exact.bits_for(k)
        assert k * 4**b <= 2**53 and b >= 18


def test_a_frozen_weights_grid_is_kept_until_the_weight_is_written_and_never_shared_between_weights():
    w = torch.randn(8, 16).requires_grad_(False)
    x, b = torch.randn(3, 16), exact.bits_for(16)
    first = exact.exact_matmul(x, w)
    assert exact.weight_grid(w, exact.bits_for(16)) is exact.weight_grid(w, exact.bits_for(16))  # kept
    w.view(-1).view(torch.uint8)[:4].copy_(torch.zeros(4, dtype=torch.uint8))  # a sync into a byte view
    w.copy_(torch.randn(8, 16))
    assert not torch.equal(exact.exact_matmul(x, w), first)
    assert torch.equal(exact.exact_matmul(x, w), (exact.to_grid(x, b) @ exact.to_grid(w, b).T).float())
    other = torch.randn(8, 16).requires_grad_(False)  # another weight of the same shape and version
    assert torch.equal(exact.exact_matmul(x, other), (exact.to_grid(x, b) @ exact.to_grid(other, b).T).float())

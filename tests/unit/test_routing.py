"""Synthetic routing: shapes, distinct ids, weights, the load pattern of each kind, determinism."""

import pytest
import torch

from megamoe.tools.routing import ROUTING_KINDS, make_routing


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kind", ROUTING_KINDS)
def test_shapes_distinct_ids_and_softmax_weights(kind):
    seed = int(torch.randint(0, 2**31, ()).item())
    ids, w = make_routing(513, 16, 4, kind=kind, world_size=2, target_rank=1, generator=_gen(seed))
    assert ids.shape == (513, 4) and ids.dtype == torch.int64
    assert w.shape == (513, 4) and w.dtype == torch.float32
    assert ((ids >= 0) & (ids < 16)).all()
    s = ids.sort(dim=1).values
    assert (s[:, 1:] != s[:, :-1]).all(), "ids must be distinct within a token"
    assert (w > 0).all()
    torch.testing.assert_close(w.sum(1), torch.ones(513), atol=1e-6, rtol=0)


def test_uniform_is_balanced():
    ids, _ = make_routing(20000, 8, 2, generator=_gen(1))
    counts = torch.bincount(ids.flatten(), minlength=8).double()
    expected = 20000 * 2 / 8
    assert ((counts - expected).abs() / expected).max() < 0.05


def test_zipf_is_skewed_towards_low_experts():
    ids, _ = make_routing(20000, 16, 2, kind="zipf", zipf_alpha=1.2, generator=_gen(2))
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts[0] > 3 * counts[15]
    assert (counts[:-1] >= counts[1:] * 0.9).all(), "load should fall with the expert index"


def test_one_rank_targets_only_that_ranks_experts():
    ids, _ = make_routing(
        1000, 12, 3, kind="one-rank", world_size=3, target_rank=2, generator=_gen(3)
    )
    assert ((ids >= 8) & (ids < 12)).all()
    assert torch.bincount(ids.flatten() - 8, minlength=4).min() > 0


def test_deterministic_for_a_seed_and_differs_across_seeds():
    a = make_routing(300, 32, 8, kind="zipf", generator=_gen(5))
    b = make_routing(300, 32, 8, kind="zipf", generator=_gen(5))
    c = make_routing(300, 32, 8, kind="zipf", generator=_gen(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_zero_tokens():
    ids, w = make_routing(0, 4, 2)
    assert ids.shape == (0, 2) and w.shape == (0, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="bogus"), "kind must be one of"),
        (dict(kind="one-rank", world_size=4), "needs at least top_k=3 experts per rank"),
        (
            dict(kind="one-rank", world_size=2, target_rank=2),
            r"target_rank must be in \[0, world_size=2\)",
        ),
        (dict(kind="one-rank", world_size=5), "must be divisible by world_size"),
        (dict(kind="zipf", zipf_alpha=0.0), "zipf_alpha must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_routing(10, 8, 3, **kwargs)


def test_top_k_larger_than_experts():
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        make_routing(10, 4, 5)
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        make_routing(10.0, 4, 2)

"""`auto`'s choices from the registered costs, on fake topologies (no MPI job needed)."""

from __future__ import annotations

import dataclasses
import math
import os
import types

import pytest
from fake_topology import FakeTopology

from collectives import algorithms, config, mpi_defaults
from collectives.algorithms import flat as flat_algorithms
from collectives.algorithms import hierarchical, shm, tree
from collectives.algorithms import mpi as mpi_algorithm
from collectives.algorithms.costmodel import Layout, Params
from collectives.auto import select
from collectives.runtime.agreement import PIGGYBACK_BYTES, SHARED_BYTES

COLLECTIVES = ("allreduce", "reducescatter", "allgather", "broadcast")
# a distinct prime per parameter: a hand-computed price shows which parameters it used
PRIMES = Params(alpha_intra=3.0, beta_intra=5.0, alpha_inter=7.0, beta_inter=11.0, gamma=13.0,
                overhead=17.0, mpi_call=19.0)


@pytest.fixture(autouse=True)
def default_config(monkeypatch):
    """Every test starts from the default options (no tuning file) and fresh choices."""
    monkeypatch.setattr(config, "_current", config.Config())
    select.estimates_changed()
    yield
    select.estimates_changed()


def fake_algorithm(seconds: float) -> types.SimpleNamespace:
    """A registrable algorithm of the four collectives whose every call costs `seconds`."""
    def run(*args):
        raise AssertionError("only priced, never run")

    return types.SimpleNamespace(cost=lambda collective, nbytes, layout, p: seconds,
                                 **{c: run for c in COLLECTIVES})


def test_tiny_allreduce_rides_in_the_agreement():
    """As shm's single step on one node (the exchange runs in shared memory), as tree's
    recursive doubling across nodes."""
    for sizes in [(2,), (3,), (8,)]:
        assert select.choose("allreduce", 8, FakeTopology(*sizes)) == "shm", sizes
    for sizes in [(2, 2), (4, 4, 4), (1, 1)]:
        assert select.choose("allreduce", 8, FakeTopology(*sizes)) == "tree", sizes


def test_piggyback_costs_only_the_agreement_with_its_payload(monkeypatch):
    # tree's own formula says "never"; a piggybacked allreduce does not pay it
    monkeypatch.setattr(tree, "cost", lambda *args: math.inf)
    topo = FakeTopology(2, 2)
    assert select.choose("allreduce", 1 << 10, topo) == "tree"
    assert select.choose("allreduce", PIGGYBACK_BYTES + 1, topo) != "tree"
    assert select.choose("allgather", 8, topo) != "tree"  # only allreduce piggybacks


def test_shared_piggyback_is_priced_as_one_step(monkeypatch):
    monkeypatch.setattr(shm, "cost", lambda *args: math.inf)  # shm's pipeline: never
    topo = FakeTopology(4)
    assert select.choose("allreduce", 4096, topo) == "shm"
    assert select.choose("allreduce", SHARED_BYTES + 1, topo) != "shm"
    # one step in shared memory: one counter wait (a message inside the node), the payload
    # copied in once, then all L copies folded by every rank; nothing of the links between
    # nodes nor an MPI call. Hand-computed with PRIMES (each parameter a distinct prime).
    assert select.agreement_cost(Layout((4,)), PRIMES) == 3  # alpha_intra
    assert select.agreement_cost(Layout((4,)), PRIMES, 100) == 3 + 100 * 13 + 4 * 100 * 13  # 6503
    assert select.agreement_cost(Layout((8,)), PRIMES, 10) == 3 + 10 * 13 + 8 * 10 * 13  # 1173


def test_piggyback_price_is_the_agreement_exchange():
    """Across nodes, recursive doubling in one call from C: each step one message over the
    links between nodes (alpha_inter 7, beta_inter 11 per byte) and the payload folded
    (gamma 13 per byte), plus the call's fixed cost (mpi_call 19). Hand-computed with PRIMES."""
    # 3 ranks: 2 double (1 step), the third folds in and out (2 steps)
    assert select.agreement_cost(Layout((2, 1)), PRIMES) == 3 * 7 + 19  # 40
    assert select.agreement_cost(Layout((2, 1)), PRIMES, 100) == 3 * (7 + 100 * 24) + 19  # 7240
    assert select.predict("allreduce", 100, Layout((2, 1)), PRIMES)["tree"] == 7240
    # 4 ranks: 2 doubling steps; 5 ranks: 4 doubling, 1 folded in and out: 2 + 2 steps
    assert select.agreement_cost(Layout((2, 2)), PRIMES, 10) == 2 * (7 + 10 * 24) + 19  # 513
    assert select.agreement_cost(Layout((1,) * 5), PRIMES) == 4 * 7 + 19  # 47


def test_doubling_steps():
    assert [tree.doubling_steps(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 3, 2, 4, 3, 5]


def test_hierarchical_only_on_several_nodes_with_shared_ranks():
    assert "hierarchical" not in select.candidates(FakeTopology(4))
    assert "hierarchical" not in select.candidates(FakeTopology(1, 1, 1, 1))
    assert "hierarchical" in select.candidates(FakeTopology(2, 2))
    assert "hierarchical" in select.candidates(FakeTopology(2, 1))
    # slow links between nodes: a large allreduce goes hierarchical
    assert select.choose("allreduce", 64 << 20, FakeTopology(8, 8, 8, 8)) == "hierarchical"


def test_shm_only_on_one_node():
    assert "shm" in select.candidates(FakeTopology(4))
    assert "shm" not in select.candidates(FakeTopology(2, 2))
    for c in COLLECTIVES:
        assert select.choose(c, 64 << 20, FakeTopology(2, 2)) != "shm"
    with pytest.raises(ValueError, match="'shm' needs every rank on one node"):
        algorithms.check("shm", FakeTopology(2, 2))
    algorithms.check("shm", FakeTopology(4))
    algorithms.check("hierarchical", FakeTopology(4))  # runs anywhere; `auto` just skips it


def test_large_messages_leave_tree():
    for c in COLLECTIVES:
        assert select.choose(c, 256 << 20, FakeTopology(8)) != "tree", c


def test_a_registered_algorithm_with_the_lowest_cost_is_chosen(monkeypatch):
    # a hierarchical call made of it costs one such call per level: more than one
    fake = fake_algorithm(1e-12)
    monkeypatch.setitem(flat_algorithms.FLAT, "fake", fake)  # as registering a flat module does
    monkeypatch.setitem(algorithms.REGISTRY, "fake", fake)
    for c in COLLECTIVES:
        assert select.choose(c, 1 << 20, FakeTopology(4)) == "fake", c
        assert select.choose(c, 1 << 20, FakeTopology(2, 2)) == "fake", c
    assert "fake" in select.candidates(FakeTopology(4))
    # and hierarchical's levels pick it too
    steps = hierarchical.plan("allreduce", 1 << 20, Layout((2, 2)), Params())
    assert {algo for *_, algo in steps.values()} == {"fake"}


def test_hierarchical_node_level_never_runs_the_libraries_own(monkeypatch):
    """MPI's one-node reduce_scatter is far slower than its price says: the node level takes
    our own algorithms even where `mpi` is priced cheapest; the cross-node level may take it."""
    monkeypatch.setattr(mpi_algorithm, "cost", lambda *args: 1e-12)
    for c in COLLECTIVES:
        for step, (_, where, _, algo) in hierarchical.plan(c, 64 << 20, Layout((2, 2)),
                                                           Params()).items():
            assert (algo == "mpi") == (where.nodes > 1), (c, step, algo)


@pytest.mark.parametrize("overlaps", [True, False], ids=["two CPUs a rank", "one"])
def test_hierarchical_allreduce_is_priced_as_its_pipeline(monkeypatch, overlaps):
    """Past one chunk, where each rank has a CPU for each of its two threads, the node steps
    of a chunk overlap the cross-node step of another: the price is one chunk's steps plus
    the slower side for every other chunk. Without, the chunks run (and are priced) in
    sequence."""
    monkeypatch.setattr(hierarchical, "overlaps", lambda: overlaps)
    layout, p, m = Layout((2, 2)), Params(), 64 << 20
    k = hierarchical.chunks(m, layout, p)
    assert hierarchical.pipelined(k) == overlaps
    steps = hierarchical.plan("allreduce", m, layout, p)
    t = {step: flat_algorithms.FLAT[algo].cost(flat, size, where,
                                               hierarchical._level_params(where, layout, p))
         for step, (flat, where, size, algo) in steps.items()}
    assert all(size <= m // k for _, _, size, _ in steps.values())
    node, cross = t["intra_rs"] + t["intra_ag"], t["inter_ar"]
    expected = node + cross + (k - 1) * max(node, cross) if overlaps else k * (node + cross)
    assert hierarchical.cost("allreduce", m, layout, p) == pytest.approx(expected)
    assert (expected < k * (node + cross)) == overlaps


def test_an_algorithm_that_cannot_run_is_never_chosen(monkeypatch):
    monkeypatch.setitem(algorithms.REGISTRY, "never", fake_algorithm(math.inf))
    assert "never" not in select.candidates(FakeTopology(4))
    assert select.choose("allgather", 1 << 20, FakeTopology(4)) != "never"


def test_hierarchical_chunks_are_the_most_priced_near_the_cheapest():
    """Of the powers of two up to a 1 MiB shard per local rank, the most chunks whose price
    is within NEAR of the cheapest: on the rig's layout, all of them."""
    p = Params()
    fast = dataclasses.replace(p, alpha_inter=5e-6, beta_inter=8e-11)  # 100 Gbit/s
    assert hierarchical.chunks(64 << 20, Layout((2, 2)), p) == 32
    assert hierarchical.chunks(1 << 20, Layout((2, 2)), p) == 1
    for layout, params in [(Layout((2, 2)), p), (Layout((8,) * 512), fast),
                           (Layout((4, 4, 3)), fast)]:
        for m in (3 << 20, 64 << 20, 256 << 20):
            most = max(1, m // (hierarchical.SHARD_BYTES * layout.max_local))
            priced = {k: hierarchical._allreduce_cost(m, layout, params, k)
                      for k in [1 << i for i in range(most.bit_length())] + [most]}
            near = [k for k, t in priced.items() if t <= min(priced.values()) * 1.01]
            assert hierarchical.chunks(m, layout, params) == max(near), (layout, m)


@pytest.mark.parametrize("overlaps", [True, False])
def test_hierarchical_shards_go_eagerly_over_tcp(monkeypatch, overlaps):
    """Open MPI's TCP transport sends a message in one trip up to its eager limit, which
    collectives sets to hold a shard of any chunk count chunks() picks up to 1 GiB; larger
    ones wait a round trip behind the data queued on the link."""
    monkeypatch.setattr(hierarchical, "overlaps", lambda: overlaps)
    assert os.environ["OMPI_MCA_btl_tcp_eager_limit"] == str(mpi_defaults.TCP_EAGER_BYTES)
    fast = dataclasses.replace(Params(), alpha_inter=5e-6, beta_inter=8e-11)
    for layout in (Layout((2, 2)), Layout((4, 4, 3)), Layout((8,) * 64)):
        for p in (Params(), fast):
            for m in (3 << 20, 64 << 20, 256 << 20, 1 << 30):
                shard = m // hierarchical.chunks(m, layout, p) // layout.max_local
                assert shard + 4096 <= mpi_defaults.TCP_EAGER_BYTES, (layout, p, m)


def test_hierarchical_price_is_the_sum_of_its_level_choices():
    """Each level runs its cheapest algorithm (our own on the node); a call costs the sum of
    its steps, once per chunk where the chunks run in sequence (pipelined: the test
    above)."""
    p = Params()
    for sizes in [(2, 2), (4, 4, 4, 4), (2, 1), (8, 8)]:
        layout = Layout(sizes)
        for c in COLLECTIVES:
            for m in (8, 64 << 10, 16 << 20):
                steps = hierarchical.plan(c, m, layout, p)
                total = 0.0
                for flat, where, nbytes, algo in steps.values():
                    assert where in (Layout((max(sizes),)), Layout((1,) * len(sizes)))
                    # across nodes, the node's L groups share its link: 1/L of its bandwidth
                    seen = p if where.nodes == 1 else dataclasses.replace(
                        p, beta_inter=p.beta_inter * max(sizes))
                    costs = algorithms.costs(flat, nbytes, where, seen)
                    if where.nodes == 1:
                        costs = {a: t for a, t in costs.items() if a in flat_algorithms.ours()}
                    assert algo == min(costs, key=costs.get)  # each level: the cheapest
                    total += costs[algo]
                k = hierarchical.chunks(m, layout, p) if c == "allreduce" else 1
                if not hierarchical.pipelined(k):  # its chunks in sequence
                    assert hierarchical.cost(c, m, layout, p) == pytest.approx(k * total)


def test_hierarchical_runs_the_levels_it_prices():
    topo = FakeTopology(4, 4)
    steps = hierarchical.plan("allreduce", 4 << 20, Layout((4, 4)), Params())
    assert set(steps) == {"intra_rs", "inter_ar", "intra_ag"}
    # a 1/L shard of each chunk crosses nodes
    assert steps["inter_ar"][2] == (4 << 20) // hierarchical.chunks(4 << 20, Layout((4, 4)), Params()) // 4
    run = hierarchical._levels("allreduce", 4 << 20, topo)
    assert run == {step: algorithms.function(algo, flat)
                   for step, (flat, _, _, algo) in steps.items()}
    # the node level may use shared memory; the cross-node level may not
    p = Params()
    for flat, where, m, _ in steps.values():
        assert ("shm" in algorithms.costs(flat, m, where, p)) == (where.nodes == 1)


def test_choices_are_memoized_per_topology(monkeypatch):
    topo = FakeTopology(4)
    first = select.choose("allgather", 1 << 20, topo)
    monkeypatch.setitem(algorithms.REGISTRY, "fake", fake_algorithm(0.0))
    assert select.choose("allgather", 1 << 20, topo) == first
    assert select.choose("allgather", 1 << 20, FakeTopology(4)) == "fake"
    select.estimates_changed()
    assert select.choose("allgather", 1 << 20, topo) == "fake"


def test_every_module_prices_every_collective_it_runs():
    p = Params()
    for name, module in algorithms.REGISTRY.items():
        runs = [c for c in (*COLLECTIVES, "alltoall") if hasattr(module, c)]
        assert runs in (list(COLLECTIVES), ["alltoall"], [*COLLECTIVES, "alltoall"]), name
        for c in runs:
            for layout in (Layout((1,)), Layout((3,)), Layout((2, 2))):
                t = module.cost(c, 1 << 20, layout, p)
                assert t >= 0, (name, c, layout)
            assert callable(getattr(module, c)), (name, c)


def test_alltoall_chooses_among_the_modules_that_run_it():
    assert algorithms.names("alltoall") == ("auto", "mpi", "pairwise")
    for sizes in [(2,), (4,), (2, 2)]:
        for nbytes in (8, 1 << 20, 64 << 20):
            assert select.choose("alltoall", nbytes, FakeTopology(*sizes)) in ("mpi", "pairwise")
    # our pairwise exchange pays o per step where the library's runs in C
    assert select.choose("alltoall", 8, FakeTopology(8)) == "mpi"


def test_mpi_allreduce_is_priced_with_halving_and_doubling_where_it_is_cheapest():
    """The library's Rabenseifner allreduce: ring's bytes in 2 log2 n steps at a power of
    two (cheaper than ring and tree from a few KiB at 64 ranks); with an extra rank its
    fold costs 2 m beta more, and large messages go back to ring's price."""
    from collectives.algorithms import mpi, ring
    p = dataclasses.replace(Params(), overhead=0.0)
    m = 64 << 20

    def priced(n: int) -> tuple[float, float, float]:
        layout = Layout((1,) * n)
        return (mpi.cost("allreduce", m, layout, p) - p.mpi_call,
                ring.cost("allreduce", m, layout, p), tree.cost("allreduce", m, layout, p))

    alpha, _ = Layout((1,) * 64).message(p)
    library, by_ring, by_tree = priced(64)
    assert library == pytest.approx(by_ring - (2 * 63 - 2 * 6) * alpha)
    assert library < min(by_ring, by_tree)
    library, by_ring, by_tree = priced(65)
    assert library == pytest.approx(min(by_ring, by_tree))
    # no other collective gains it
    layout = Layout((1,) * 64)
    assert mpi.cost("allgather", m, layout, p) - p.mpi_call == pytest.approx(
        min(ring.cost("allgather", m, layout, p), tree.cost("allgather", m, layout, p)))

"""python -m collectives.simulate: the scale model prices what `auto`'s model prices."""

from __future__ import annotations

import json

import pytest

from collectives import onebit, select, simulate
from collectives.costmodel import Layout, Params


def test_rows_are_autos_model_on_the_described_cluster():
    p = simulate.params(gbits=100, latency_us=5)
    assert p.beta_inter == pytest.approx(8 / 100e9) and p.alpha_inter == pytest.approx(5e-6)
    assert p.gamma == Params().gamma  # the node is this machine's
    layout = Layout((8,) * 64)
    rows = simulate.table("allreduce", layout, p, [1 << 10, 1 << 20, 1 << 28])
    for row in rows:
        times = select.predict("allreduce", row["size"], layout, p)
        assert row["auto"] == min(times, key=times.get)
        assert row["times"]["onebit"] == onebit.cost(row["size"], layout, p)
    assert rows[0]["auto"] == "tree"  # small allreduces ride in the agreement
    assert rows[1]["auto"] == "hierarchical"  # fewer steps across 64 nodes


def test_hierarchical_shares_each_nodes_link():
    slow = simulate.params(gbits=1, latency_us=30)
    shared = select.predict("allreduce", 256 << 20, Layout((2, 2)), slow)
    # a node's two groups share one 1 Gbit/s link: no faster across than a node-ordered ring
    assert shared["hierarchical"] > 0.9 * shared["ring"] / 2


def test_main_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    simulate.main(["--nodes", "2,4", "--ranks-per-node", "2", "--gbits", "10",
                   "--max-bytes", str(1 << 20), "--json", str(out)])
    printed = capsys.readouterr().out
    assert "# allreduce, 4 nodes x 2 ranks, 10 Gbit/s" in printed
    assert set(json.loads(out.read_text())) == {"2x2 allreduce", "4x2 allreduce"}

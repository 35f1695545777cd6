"""python -m collectives simulate: the scale model prices what `auto`'s model prices."""

from __future__ import annotations

import json

import pytest

from collectives.algorithms import onebit
from collectives.algorithms.costmodel import Layout, Params
from collectives.auto import select, simulate


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
    # the library's two levels at their best: Rabenseifner's 2 log2 64 steps across nodes
    assert rows[1]["auto"] == "mpi"


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


def _measured(np_: int, rows: list[tuple[str, int, list[float]]]) -> dict:
    """bandwidth.py --json's shape: allreduce rows with each round's microseconds."""
    return {"np": np_, "rows": [
        {"op": "allreduce", "algo": algo, "size": size, "rounds_us": rounds,
         "time_us": sorted(rounds)[len(rounds) // 2]} for algo, size, rounds in rows]}


def test_compare_puts_the_model_beside_each_measured_allreduce():
    layout, p = Layout((1, 1)), simulate.params(gbits=1, latency_us=30)
    ring = select.predict("allreduce", 4 << 20, layout, p)["ring"]
    measured = _measured(2, [
        ("ring", 4 << 20, [ring * 1e6, ring * 2e6, ring * 3e6]),  # median 2x the model
        ("onebit", 4 << 20, [100.0]),
        ("gloo", 4 << 20, [100.0]),          # no model: left out
        ("ring", 1 << 10, [1.0]),            # below min_bytes: left out
    ])
    points = simulate.compare(measured, layout, p, min_bytes=1 << 20)
    assert [(pt["algo"], pt["size"]) for pt in points] == [("ring", 4 << 20),
                                                           ("onebit", 4 << 20)]
    assert points[0]["predicted"] == ring
    assert points[0]["median"] == pytest.approx(2 * ring)
    assert points[0]["best"] == pytest.approx(ring)
    assert points[1]["predicted"] == onebit.cost(4 << 20, layout, p)
    with pytest.raises(ValueError, match="ran on 2 ranks, the described cluster has 4"):
        simulate.compare(measured, Layout((2, 2)), p)


def test_main_compare_flags_points_off_by_more_than_30_percent(tmp_path, capsys):
    layout, p = Layout((1, 1)), simulate.params(gbits=1, latency_us=30)
    t = {s: select.predict("allreduce", s, layout, p)["tree"] for s in (1 << 20, 4 << 20)}
    path = tmp_path / "rig.json"
    path.write_text(json.dumps(_measured(2, [("tree", 1 << 20, [t[1 << 20] * 1.1e6]),
                                             ("tree", 4 << 20, [t[4 << 20] * 2e6])])))
    simulate.main(["--nodes", "2", "--ranks-per-node", "1", "--gbits", "1",
                   "--latency-us", "30", "--min-bytes", str(1 << 20), "--compare", str(path)])
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| tree"))
    first, second = row.split(" | ")[1:3]
    assert "(0.91; 0.91)" in first and "**" not in first
    assert "(0.50; 0.50) **" in second
    assert "within 30%: 1 of 2 points against the median, 1 against the best round" in printed
    with pytest.raises(SystemExit, match="one --nodes value"):
        simulate.main(["--nodes", "2,4", "--compare", str(path)])


def test_the_command_line_runs_a_tool_and_names_the_tools_otherwise():
    """`python -m collectives simulate ...` is the scale model's entry (collectives/__main__.py);
    an unknown tool exits non-zero naming the ones there are."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "collectives", "simulate", "--nodes", "2",
                         "--ranks-per-node", "1", "--gbits", "1", "--max-bytes", "1024"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "# allreduce, 2 nodes x 1 ranks, 1 Gbit/s" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "collectives", "simulat"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "{calibrate,simulate,bytes}" in bad.stderr


def test_the_bytes_tool_prints_each_form(capsys):
    """python -m collectives bytes: a row per form, its MiB at each rank count."""
    from collectives.compression import wire

    wire.main(["--count", str(1 << 20), "--ranks", "2,64"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + len(wire.FORMS)
    ring = next(line for line in lines if line.startswith("| float32 ring"))
    assert ring.split("|")[2:4] == [" 4.00 ", " 7.88 "]  # 2 (n-1)/n of 4 MiB

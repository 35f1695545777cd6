"""The pure parts of calibration: the tuning file's parameters and measured times, as `auto`
reads them back (no MPI job needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fake_topology import FakeTopology

from collectives import config
from collectives.algorithms import costmodel
from collectives.algorithms.costmodel import Params
from collectives.auto import calibrate, select

MEASURED = {  # seconds at 1 KiB, 1 MiB and 2 MiB
    "allgather": {"ring": [[1024, 10e-6], [1 << 20, 1e-3], [2 << 20, 2e-3]],
                  "mpi": [[1024, 5e-6], [1 << 20, 2e-3], [2 << 20, 3e-3]]},
}


def use_tuning(tmp_path, monkeypatch, tuning: dict) -> None:
    """Make tuning the one in force, as init installs a tuning file's contents."""
    monkeypatch.setattr(costmodel, "_installed", json.loads(json.dumps(tuning)))
    select.estimates_changed()


@pytest.fixture(autouse=True)
def fresh_choices():
    select.estimates_changed()
    yield
    select.estimates_changed()


def test_params_round_trip_through_the_tuning_file(tmp_path, monkeypatch):
    measured = Params(alpha_intra=2e-6, beta_intra=3e-10, alpha_inter=4e-5, beta_inter=9e-9,
                      gamma=1e-10, overhead=5e-7, mpi_call=6e-7)
    assert measured != Params()
    # as calibrate.main writes it
    use_tuning(tmp_path, monkeypatch, {"params": dataclasses.asdict(measured), "nodes": [2]})
    assert costmodel.params() == measured


def test_no_tuning_means_the_defaults(monkeypatch):
    monkeypatch.setattr(costmodel, "_installed", {})
    assert costmodel.params() == Params()
    assert select._measured("allgather", 1 << 20, FakeTopology(2)) is None


def test_measured_times_are_interpolated(tmp_path, monkeypatch):
    use_tuning(tmp_path, monkeypatch, {"nodes": [2], "measured": MEASURED})
    topo = FakeTopology(2)
    at = select._measured
    assert at("allgather", 8, topo) == {"ring": 10e-6, "mpi": 5e-6}  # below: the first point
    mid = at("allgather", 1 << 19, topo)  # between measured sizes: linear
    share = ((1 << 19) - 1024) / ((1 << 20) - 1024)
    assert mid["ring"] == pytest.approx(10e-6 + share * (1e-3 - 10e-6))
    assert mid["mpi"] == pytest.approx(5e-6 + share * (2e-3 - 5e-6))
    beyond = at("allgather", 4 << 20, topo)  # past the last: the last segment's bandwidth
    assert beyond["ring"] == pytest.approx(4e-3)
    assert beyond["mpi"] == pytest.approx(5e-3)
    assert at("allreduce", 1 << 20, topo) is None  # not measured


def test_measured_times_apply_only_to_the_measured_layout(tmp_path, monkeypatch):
    use_tuning(tmp_path, monkeypatch, {"nodes": [2], "measured": MEASURED})
    assert select._measured("allgather", 1 << 20, FakeTopology(1, 1)) is None
    assert select._measured("allgather", 1 << 20, FakeTopology(3)) is None


def test_auto_takes_the_fastest_measured(tmp_path, monkeypatch):
    use_tuning(tmp_path, monkeypatch, {"nodes": [2], "measured": MEASURED})
    topo = FakeTopology(2)
    assert select.choose("allgather", 1024, topo) == "mpi"
    assert select.choose("allgather", 1 << 20, topo) == "ring"


def test_decision_table_prints_autos_choices(monkeypatch):
    monkeypatch.setattr(config, "_current", config.Config())
    topo = FakeTopology(4)
    lines = calibrate.decision_table(topo)
    assert lines[0].split() == ["size", "allreduce", "allgather", "reducescatter", "broadcast"]
    first = lines[1].split()
    assert int(first[0]) == 8
    assert first[1:] == [select.choose(c, 8, topo)
                         for c in ("allreduce", "allgather", "reducescatter", "broadcast")]

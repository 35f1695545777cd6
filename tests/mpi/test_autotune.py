"""`auto` out of the box (collectives/autotune.py): the first job on a setup measures and
caches, the next reads the cache; tuning-file errors at init; every rank makes the same
choices however noisy its own clock."""

from __future__ import annotations

import hashlib
import json
import time
import types
import warnings

import numpy as np
import pytest

import collectives as C
from collectives import autotune, config, costmodel, select, topology

SMALL = (8, 4 << 10)  # sizes that keep a test's measurement short


def _job(**options) -> types.SimpleNamespace:
    """The job's topology with other options."""
    job = topology.get()
    return types.SimpleNamespace(comm=job.comm, rank=job.rank, size=job.size, nodes=job.nodes,
                                 config=config.Config(**options))


@pytest.fixture
def cache(tmp_path_factory, comm, monkeypatch):
    """An empty cache directory, the same on every rank; small measurements."""
    root = comm.bcast(str(tmp_path_factory.mktemp("cache")) if comm.rank == 0 else None)
    monkeypatch.setenv("XDG_CACHE_HOME", root)
    monkeypatch.setattr(autotune, "SIZES", SMALL)
    return root


def test_the_first_job_measures_and_the_next_reads_the_cache(comm, cache):
    if comm.Get_size() == 1:
        assert autotune.setup(_job()) == {}  # nothing to choose between
        return
    first = autotune.setup(_job())
    assert first["nodes"] == [len(n) for n in topology.get().nodes]
    assert set(first["measured"]) == set(autotune.COLLECTIVES)
    assert all(len(points) == len(SMALL) for table in first["measured"].values()
               for points in table.values())
    path = autotune.cache_path(autotune.key(topology.get()))
    assert str(path).startswith(cache) and (comm.rank != 0 or path.exists())
    start = time.perf_counter()
    again = autotune.setup(_job())
    assert time.perf_counter() - start < 0.2
    assert again == json.loads(json.dumps(first))


def test_the_key_names_what_the_times_depend_on(comm):
    k = autotune.key(topology.get())
    assert k["world_size"] == comm.Get_size() and k["version"] == autotune.version()
    assert sum(k["nodes"]) == comm.Get_size() and len(k["hosts"]) == len(k["nodes"])
    paths = {autotune.cache_path({**k, field: "other"}) for field in k}
    assert autotune.cache_path(k) not in paths and len(paths) == len(k)


def test_a_tuning_file_that_is_missing_or_bad_is_an_error_at_init(comm, tmp_path):
    missing = comm.bcast(str(tmp_path / "nowhere.json") if comm.rank == 0 else None)
    with pytest.raises(ValueError, match=f"COLLECTIVES_TUNING_FILE={missing}: no such file"):
        autotune.setup(_job(tuning_file=missing))
    bad = comm.bcast(str(tmp_path / "bad.json") if comm.rank == 0 else None)
    if comm.rank == 0:
        with open(bad, "w") as f:
            f.write("{not json")
    comm.Barrier()
    with pytest.raises(ValueError, match=f"COLLECTIVES_TUNING_FILE={bad}: not a tuning file"):
        autotune.setup(_job(tuning_file=bad))


def test_a_tuning_file_for_another_layout_warns_and_is_set_aside(comm, tmp_path):
    other = comm.bcast(str(tmp_path / "other.json") if comm.rank == 0 else None)
    if comm.rank == 0:
        with open(other, "w") as f:
            json.dump({"nodes": [comm.Get_size() + 1], "measured": {}}, f)
    comm.Barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert autotune.setup(_job(tuning_file=other, autotune=False)) == {}
    assert any("made for nodes" in str(w.message) for w in caught) == (comm.rank == 0)


def test_every_rank_chooses_the_same_under_per_rank_noise(comm, cache, monkeypatch):
    if comm.Get_size() == 1:
        return
    clock = time.perf_counter
    noise = iter(range(10 ** 6))

    def jittery() -> float:  # each rank's clock runs off by its own amount
        return clock() + (comm.rank + 1) * 1e-4 * (next(noise) % 7)

    monkeypatch.setattr(autotune, "clock", jittery)
    tuning = autotune.setup(_job())
    digest = hashlib.sha256(json.dumps(tuning["measured"], sort_keys=True).encode()).hexdigest()
    assert len(set(comm.allgather(digest))) == 1
    monkeypatch.setattr(costmodel, "_installed", tuning)
    select.choose.cache_clear()
    try:
        choices = [select.choose(c, s, topology.get()) for c in autotune.COLLECTIVES
                   for s in (8, 1 << 10, 1 << 12, 1 << 20)]
        assert len({tuple(x) for x in comm.allgather(choices)}) == 1
        assert C.allreduce(np.full(3, C.rank() + 1.0), op=C.Sum)[0] == \
            sum(range(1, comm.Get_size() + 1))
    finally:
        select.choose.cache_clear()

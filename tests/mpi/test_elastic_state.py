"""An elastic TorchState's snapshot on disk is the commit it is named by, whatever the state
does while the snapshot is being written: the writer thread reads the commit's in-memory
copies, which the next save refills in place (a commit, or the sync after a shrink that
gives every rank rank 0's state, which may be a later commit)."""

from __future__ import annotations

import os
import tempfile
import threading

import torch
from collectives.optim import DistributedOptimizer

import collectives as C
from collectives.elastic import TorchState, snapshot
from collectives.runtime import topology


def test_a_sync_during_a_snapshot_leaves_the_commit_on_disk(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    state = TorchState(model=model, optimizer=opt, step=0)
    root = tempfile.mkdtemp(prefix="collectives-test-snapshots-")
    state.attach(None, snapshot.Writer(root), 0.0)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        state.step += 1

    step()
    started, release, dump = threading.Event(), threading.Event(), snapshot.dump

    def held_dump(payload, path):  # the write starts once the test lets it
        started.set()
        release.wait()
        dump(payload, path)

    monkeypatch.setattr(snapshot, "dump", held_dump)
    state.commit()  # commit 1, on disk through the held writer
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    writing = started.wait(10) if snapshot.first_on_host(topology.get()) else False
    step()  # as if rank 0 were a commit ahead when the job shrank: the sync takes its state
    threading.Timer(0.2, release.set).start()  # (a sync that waits for the write needs it)
    state.sync()
    release.set()
    state.flush_snapshots()
    if not writing:  # only the first rank of a host writes the replicated state
        return
    name = snapshot.file_name(1, C.rank(), C.size(), True, False, None)
    saved = snapshot.load(f"{snapshot.host_dir(root)}/{name}")
    assert saved["commit"] == 1 and saved["replicated"]["values"]["step"] == 1
    on_disk = saved["replicated"]["torch"]
    for k, v in committed.items():
        assert torch.equal(on_disk["model"][k], v), k
    for i, m in enumerate(moments):
        assert torch.equal(on_disk["optimizer"]["state"][i]["exp_avg"], m)


def test_a_resume_removes_its_hosts_files_of_every_other_commit():
    """Commits 1 and 2 on disk, beside a shard-only file numbered 9 (as a job that died
    mid-snapshot leaves): the resume takes commit 2, then each host keeps that commit's
    files alone, and files that are no snapshot's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = TorchState(model=model, step=0)
    root = C.broadcast_object(tempfile.mkdtemp(prefix="collectives-test-snapshots-"), 0)
    state.attach(None, snapshot.Writer(root), 0.0)
    for _ in range(2):
        with torch.no_grad():
            model.weight.add_(1.0)
        state.step += 1
        state.commit()
    state.flush_snapshots()
    first = snapshot.first_on_host(topology.get())
    folder = snapshot.host_dir(root)
    if first:
        for name in (snapshot.file_name(9, 1, 3, False, True, None), "notes.txt"):
            open(f"{folder}/{name}", "w").close()
    C.barrier()
    fresh = torch.nn.Linear(4, 2)
    resumed = TorchState(model=fresh, step=0)
    assert snapshot.resume(resumed, root) == 2
    resumed.sync()
    assert resumed.step == 2 and torch.equal(fresh.weight, model.weight)
    C.barrier()
    left = {(e.commit, e.rank) for e in snapshot.entries(root)}
    assert {k for k, _ in left} == {2}, left
    assert os.path.exists(f"{folder}/notes.txt")

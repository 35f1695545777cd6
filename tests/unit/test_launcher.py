"""The launcher of elastic jobs (collectives-run, collectives/launcher.py) and its pieces: host
sources, host discovery, snapshots; whole runs that grow a job, shrink it in place and
grow it back, on this machine's reserved slots (tests/scripts/launched.py)."""

from __future__ import annotations

import ast
import fcntl
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

from collectives import launcher
from collectives.elastic import discovery, hosts, snapshot

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def discovery_source(tmp: Path, kind: str, listing: str) -> Path:
    """A host-discovery file, or an executable script printing the listing."""
    if kind == "file":
        path = tmp / "hosts.txt"
        path.write_text(listing)
    else:
        path = tmp / "discover.sh"
        path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{listing}EOF\n")
        path.chmod(0o755)
    return path


def test_discovery_listings(tmp_path):
    """host:slots lines (host alone: one slot; comments and blank lines skipped); a line
    that is not one raises naming the source and the line; a script's output is read."""
    assert discovery.parse("a:2\n\n# c\nb  # one\na:1\n", "src") == {"a": 3, "b": 1}
    with pytest.raises(ValueError, match=r"src, line 2: expected host\[:slots\], got 'b:x'"):
        discovery.parse("a:2\nb:x\n", "src")
    script = discovery_source(tmp_path, "script", "h1:2\nh2:2\n")
    assert discovery.read(str(script)) == {"h1": 2, "h2": 2}
    assert first_listing(discovery.Discovery(str(script))) == {"h1": 2, "h2": 2}


def first_listing(found: discovery.Discovery) -> dict[str, int] | None:
    """found's hosts once its thread has read the source (None: no read within 10 s)."""
    for _ in range(1000):
        if (listed := found.hosts()) is not None:
            return listed
        time.sleep(0.01)
    return None


def test_a_failing_discovery_keeps_its_last_listing(tmp_path, monkeypatch):
    """Reads that fail warn once, at the first, saying what the launcher does meanwhile,
    and leave the last good listing in force; after a good read, the next failure warns
    again. (The thread reads once and then sleeps past the test: the reads below are the
    test's.)"""
    source = discovery_source(tmp_path, "file", "h:3\n")
    monkeypatch.setattr(discovery, "POLL_S", 3600.0)
    found = discovery.Discovery(str(source))
    assert first_listing(found) == {"h": 3}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for text in ("h:three\n", "h:four\n", "h:three\n"):  # one failing streak
            source.write_text(text)
            found._read_once()
            assert found.hosts() == {"h": 3}
        source.write_text("h:5\n")
        found._read_once()
        assert found.hosts() == {"h": 5}
        source.write_text("h:six\n")
        found._read_once()
    assert [str(w.message) for w in said] == [
        f"collectives.elastic: host discovery from {source} failed (ValueError: {source}, "
        f"line 1: expected host[:slots], got 'h:three'); the launcher keeps its last "
        f"listing (h:3) until a read succeeds, warning no more until then",
        f"collectives.elastic: host discovery from {source} failed (ValueError: {source}, "
        f"line 1: expected host[:slots], got 'h:six'); the launcher keeps its last "
        f"listing (h:5) until a read succeeds, warning no more until then"]


def test_a_discovery_that_never_succeeds_says_nothing_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery, "POLL_S", 3600.0)
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho broken >&2\nexit 2\n")
    script.chmod(0o755)
    found = discovery.Discovery(str(script))
    with pytest.warns(UserWarning, match=r"exited with status 2: broken\); no listing yet: "
                                         r"no job starts until a read succeeds"):
        found._read_once()
    assert found.hosts() is None


def test_host_sources(tmp_path):
    """-H, a hostfile in either form, a Slurm allocation, and mpirun's --host for a size."""
    assert hosts.from_list("a:2,b,c:1") == {"a": 2, "b": 1, "c": 1}
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=2\nb:3\n# c\n")
    assert hosts.from_hostfile(str(hostfile)) == {"a": 2, "b": 3}
    assert hosts.expand_nodelist("node[01-03,07],login1,x[9-10]") == \
        ["node01", "node02", "node03", "node07", "login1", "x9", "x10"]
    slurm = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert hosts.from_slurm(slurm) == {"n1": 2, "n2": 2, "n3": 1}
    assert hosts.from_slurm({}) is None
    assert hosts.mpirun_hosts({"a": 2, "b": 2, "c": 2}, 3) == "a:2,b:1"


def entry(commit: int, rank: int, size: int, parts: str, held: int | None = None):
    return snapshot.Entry(commit, rank, size, "r" in parts, "s" in parts, held, "")


def test_the_newest_whole_snapshot_is_chosen():
    """Replicated state: the newest commit any host holds. Sharded: the newest whose every
    shard is held (its own file or its buddy's copy); an incomplete newer one is passed."""
    assert snapshot.choose([entry(3, 0, 2, "r"), entry(5, 0, 2, "r")], False) == 5
    assert snapshot.choose([entry(5, 1, 2, "s")], False) is None
    shards = [entry(4, 0, 3, "rs", 2), entry(4, 1, 3, "s", 0), entry(4, 2, 3, "s", 1),
              entry(6, 0, 3, "r"), entry(6, 1, 3, "s", 0)]  # 6: shard 2 missing
    assert snapshot.choose(shards, True) == 4
    # shard 2 of commit 6 lives on as rank 0's copy: 6 is whole without rank 2's file
    whole = [entry(6, 0, 3, "rs", 2), entry(6, 1, 3, "s", 0)]
    assert snapshot.choose(shards + whole, True) == 6
    assert snapshot.choose(whole[1:], True) is None  # no replicated part


def test_a_writer_keeps_the_last_two_snapshots(tmp_path):
    writer = snapshot.Writer(str(tmp_path))
    for commit in range(1, 6):
        writer.write(commit, 0, 1, {"step": commit}, None, None)
    writer.wait()
    found = sorted(e.commit for e in snapshot.entries(str(tmp_path)))
    assert found == [4, 5]
    newest = max(snapshot.entries(str(tmp_path)), key=lambda e: e.commit)
    assert snapshot.load(newest.path)["replicated"]["step"] == newest.commit


def launch(tmp: Path, *args: str, timeout: float = 240,
             **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               COLLECTIVES_AUTOTUNE="0", XDG_CACHE_HOME=str(tmp),
               PATH=f"{BIN}:{os.environ['PATH']}", **env_vars)
    return subprocess.run([str(BIN / "collectives-run"), *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_an_unwritable_snapshot_folder_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_text("")
    done = launch(tmp_path, "--snapshot-dir", str(tmp_path / "file" / "snaps"), "-np", "1",
                    "true")
    assert done.returncode != 0
    assert "snapshot_dir" in done.stderr and "cannot be written" in done.stderr, done.stderr


def test_too_few_slots_end_the_run_after_the_start_timeout(tmp_path):
    """No job is started, and the run ends at its --start-timeout, saying so."""
    done = launch(tmp_path, "-np", "3", "-H", "localhost:2", "--start-timeout", "1", "true")
    assert done.returncode != 0
    assert "2 slots listed" in done.stderr and "fewer than --min-np=3" in done.stderr, \
        done.stderr
    assert "after waiting 1 s (--start-timeout)" in done.stderr, done.stderr
    assert "job 1:" not in done.stderr, done.stderr


def finished(out: str, steps: int) -> list[tuple]:
    """Every rank's line: (rank, size, sizes in order, error, digest)."""
    found = re.findall(r"rank (\d+) of (\d+): trained (\d+) steps, sizes in order (\[.*?\]), "
                       r"max error (\S+), digest (\S+)", out)
    assert found and all(int(f[2]) == steps for f in found), out
    return [(int(r), int(n), ast.literal_eval(runs), float(err), digest)
            for r, n, _, runs, err, digest in found]


@pytest.mark.parametrize("api", ["train", "zero"])
def test_a_job_grows_shrinks_in_place_and_grows_back(tmp_path, api):
    """Started at 2 ranks from a discovery file listing 2 slots; the job lists a third at
    step 8 (the launcher stops it at a commit and starts it at 3, from the snapshot);
    its last rank dies after 3 steps at 3 ranks (the job shrinks in place to 2, and the
    launcher grows it back to 3). The job exits 0, every step ran once at
    the sizes recorded, every rank ends with the same parameters, which match a float64
    replay of those sizes."""
    events = tmp_path / "events"
    events.mkdir()
    listing = discovery_source(tmp_path, "file", "localhost:2\n")
    steps = 60
    done = launch(tmp_path, "-np", "2", "--host-discovery-script", str(listing),
                    "--mpi-args=--oversubscribe",
                    "--snapshot-dir", str(tmp_path / "snaps"),
                    sys.executable, str(ROOT / "tests" / "scripts" / "launched.py"), api,
                    EVENTS=str(events), DISCOVERY=str(listing), GROW_AT="8:localhost:3",
                    KILL_AT="3:3", STEPS=str(steps), STEP_S="0")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    ranks = finished(out, steps)
    assert sorted(r for r, *_ in ranks) == [0, 1, 2] and {n for _, n, *_ in ranks} == {3}, out
    runs = ranks[0][2]
    assert [n for n, _ in runs] == [2, 3, 2, 3], out
    assert all(err < 1e-10 for *_, err, _ in ranks), out
    assert len({digest for *_, digest in ranks}) == 1, out
    assert all(r[2] == runs for r in ranks), out
    assert re.search(r"job 2: 3 ranks on localhost:3 \(3 slots for 2 ranks\)", out), out
    assert re.search(r"job 3: 3 ranks on localhost:3 \(ranks failed; 3 slots for 2 ranks\)",
                     out), out
    assert "trains at 3 ranks" in out and "finished at 3 ranks" in out, out


RIG = Path(os.environ.get("NETRIG", ROOT.parent / "shared" / "netrig")) / "netrig.sh"


@pytest.fixture(scope="module")
def rig():
    """Three emulated hosts at 1 Gbit/s (the rig, its folder in $NETRIG); skips where the rig
    is missing or cannot come up (it needs root and network namespaces). The machine has
    one rig: a test process holds an exclusive lock on it from up to down, so that
    processes running tests side by side (pytest -n) take turns."""
    if not RIG.exists() or os.geteuid() != 0:
        pytest.skip(f"no rig: {RIG} missing or not root")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    with open(Path(tempfile.gettempdir()) / "collectives-tests-rig.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        up = subprocess.run([str(RIG), "up", "3", "1gbit", "0"], capture_output=True,
                            text=True, env=env, timeout=120)
        if up.returncode != 0:
            pytest.skip(f"the rig did not come up: {up.stderr[-500:]}")
        yield env
        subprocess.run([str(RIG), "down"], capture_output=True, env=env, timeout=120)


@pytest.mark.parametrize("api,order", [
    ("train", "together"), ("zero", "together"),
    # Adam's moments and step count in the commits; the host lost before the launcher
    # asks for the stop (the job shrinks in place first, then Open MPI ends it), or after
    ("adam", "lost-first"), ("adam", "unlisted-first")])
def test_on_three_hosts_a_job_grows_survives_a_rank_and_a_host(tmp_path, api, order, rig):
    """On the rig: started on host0 and host1 from a discovery script; host2 is listed at
    step 8 (the job grows to 3); the rank on host2 dies after 3 steps at 3 ranks (the job
    shrinks in place and grows back); at step 45, host1 is killed whole (its daemon and
    rank) and unlisted, in that order or the other: Open MPI ends the job, or it stops at a
    commit, and the launcher starts it again on host0 and host2 from the last snapshot.
    Every step ran, the ranks agree and match the replay."""
    events = tmp_path / "events"
    events.mkdir()
    listing = discovery_source(tmp_path, "script", "host0:1\nhost1:1\n")
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("host0:1\nhost1:1\n")
    listing.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    # Adam as the issue that found a divergence ran it: 700 steps, a host lost at step 450
    steps, host_at = (700, 450) if api == "adam" else (70, 45)
    env = dict(rig, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               COLLECTIVES_AUTOTUNE="0", XDG_CACHE_HOME=str(tmp_path),
               COLLECTIVES_MPIRUN=f"{RIG} mpirun", EVENTS=str(events),
               DISCOVERY=str(hosts_file), GROW_AT="8:host0:1;host1:1;host2:1",
               KILL_AT="3:3", KILL_HOST_AT=f"{host_at}:host1", STEPS=str(steps), STEP_S="0")
    proc = subprocess.Popen(
        [str(BIN / "collectives-run"), "-np", "2", "--min-np", "2",
         "--host-discovery-script", str(listing), "--snapshot-dir", str(tmp_path / "snaps"),
         sys.executable, str(ROOT / "tests" / "scripts" / "launched.py"), api],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def unlist() -> None:
        hosts_file.write_text("host0:1\nhost2:1\n")

    def kill() -> None:
        subprocess.run([str(RIG), "kill-host", "host1"], env=env, timeout=60,
                       capture_output=True)

    # each order's second event waits for the launcher's line about the first
    waits = {"lost-first": (kill, "lost host host1", unlist),
             "unlisted-first": (unlist, "(host host1 no longer listed)", kill),
             "together": (lambda: (unlist(), kill()), "", lambda: None)}[order]
    stage, deadline = 0, time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if stage == 0 and (events / "kill-host").exists():
                waits[0]()
                stage = 1
            if stage == 1 and any(waits[1] in line for line in list(lines)):
                waits[2]()
                stage = 2
            time.sleep(0.1)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert stage == 2, out
    ranks = finished(out, steps)
    assert sorted(r for r, *_ in ranks) == [0, 1] and {n for _, n, *_ in ranks} == {2}, out
    runs = ranks[0][2]
    assert [n for n, _ in runs] == [2, 3, 2, 3, 2], out
    assert all(err < 1e-10 for *_, err, _ in ranks), out
    assert len({digest for *_, digest in ranks}) == 1 and all(r[2] == runs for r in ranks), out
    assert re.search(r"job \d: 2 ranks on host0:1,host2:1", out), out
    # the restart names its cause: either one where both came at once
    assert "lost host host1" in out or "(host host1 no longer listed)" in out, out
    if api == "adam":
        assert_snapshots_replay(tmp_path / "snaps")


def assert_snapshots_replay(root: Path) -> None:
    """Every replicated snapshot file left on any host (the last two of each process that
    wrote, whether or not a restart read it) holds the parameters and Adam's state of the
    float64 replay at its own step count: a file that mixes two commits (its tensors
    refilled while it was written) fails here even where no restart resumes from it."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        from replay import adam_replays
    finally:
        sys.path.pop(0)
    files = [(path, snapshot.load(str(path))["replicated"]) for path in root.glob("*/*.snap")
             if "r" in path.name.split(".")[3]]
    assert files, sorted(root.rglob("*"))
    # launched.py's adam run: batch 24, dim 32, lr 1e-3
    expected = adam_replays({r["values"]["step"] for _, r in files}, 24, 32, 1e-3)
    for path, r in files:
        step = r["values"]["step"]
        assert len(r["values"]["sizes"]) == step, (path, r["values"])
        params, adam = expected[step]
        got, state = list(r["torch"]["model"].values()), r["torch"]["optimizer"]["state"]
        assert len(got) == len(params) and len(state) == len(adam), (path, step)
        for i, want in enumerate(params):
            assert close(got[i], want), (path, step, f"parameter {i}")
        for i, want in enumerate(adam):
            assert set(state[i]) == set(want), (path, step, state[i].keys())
            assert all(close(state[i][k], want[k]) for k in want), (path, step, f"Adam {i}")


def close(got, want) -> bool:
    """Whether got equals want but for the rounding of sums taken in another order."""
    got, want = got.double(), want.double()
    return bool(((got - want).abs() <= 1e-9 * (1 + want.abs())).all())


ELASTIC_EXIT_3 = """
import collectives as C
from collectives import elastic
C.init()

@elastic.run
def train(state):
    raise SystemExit(3)

train(elastic.ObjectState(step=0))
"""


def test_a_job_that_fails_before_any_commit_is_not_started_forever(tmp_path):
    """An elastic job that ends with an error before its first commit, 3 times in a row,
    ends the run with its status (a failure that makes progress is started again)."""
    done = launch(tmp_path, "-np", "1", sys.executable, "-c", ELASTIC_EXIT_3)
    assert done.returncode == 3, done.stderr
    assert re.findall(r"job (\d) ended without finishing \(job \d ended with status 3\)",
                      done.stderr) == ["1", "2"], done.stderr
    assert "job 3 ended with status 3 before any new commit, 3 times in a row; giving up" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("status", [0, 5])
def test_a_command_that_is_not_elastic_runs_once(tmp_path, status):
    """A command that never calls collectives.elastic.run runs once, and the launcher ends
    with its status, saying why it does not start it again."""
    done = launch(tmp_path, "-np", "1", sys.executable, "-c",
                    f"print('ran'); raise SystemExit({status})")
    assert done.returncode == status, done.stderr
    assert done.stdout.count("ran") == 1, done.stdout
    assert f"job 1 ended with status {status} without reaching collectives.elastic.run" \
        in done.stderr and "job 2" not in done.stderr, done.stderr


def test_a_lost_host_comes_back_after_a_cooldown_that_doubles():
    """--blacklist-cooldown-range MIN MAX: MIN seconds after a host's first loss, twice as
    long after each next one, at most MAX; without it a lost host stays out; a range that
    is not 0 <= MIN <= MAX is refused."""
    hosts = launcher.Hosts(launcher.parse_args(
        ["-H", "h0:1,h1:1", "--blacklist-cooldown-range", "10", "35", "true"]))
    assert [hosts.leave_out("h1") for _ in range(4)] == [10.0, 20.0, 35.0, 35.0]
    assert hosts.usable() == {"h0": 1}
    assert hosts.leave_out("h0") == 10.0  # counted per host
    assert hosts.usable() == {}
    at_once = launcher.Hosts(launcher.parse_args(
        ["-H", "h0:1,h1:1", "--blacklist-cooldown-range", "0", "0", "true"]))
    assert at_once.leave_out("h1") == 0.0 and at_once.usable() == {"h0": 1, "h1": 1}
    never = launcher.Hosts(launcher.parse_args(["-H", "h0:1,h1:1", "true"]))
    assert never.leave_out("h1") == float("inf") and never.usable() == {"h0": 1}
    with pytest.raises(SystemExit):
        launcher.parse_args(["--blacklist-cooldown-range", "5", "2", "true"])


def test_what_makes_the_launcher_restart_a_job():
    """More slots than ranks (up to --max-np), or a host of the job unlisted (while the
    others keep --min-np slots); this machine's aliases are its hostname."""
    args = launcher.parse_args(["-np", "1", "--max-np", "3", "true"])
    here = hosts.canonical("localhost")
    job = {"size": 1, "hosts": ["h0"]}
    assert launcher.wanted_change(args, {"h0": 1}, job) == ""
    assert launcher.wanted_change(args, {"h0": 1, "h1": 1}, job) == "2 slots for 1 ranks"
    assert launcher.wanted_change(args, {"h0": 4}, job) == "3 slots for 1 ranks"  # --max-np
    assert launcher.wanted_change(args, {"h1": 1}, job) == "host h0 no longer listed"
    assert launcher.wanted_change(args, {"localhost": 1}, {"size": 1, "hosts": [here]}) == ""


def test_a_host_listed_and_unlisted_between_two_polls_changes_nothing(tmp_path, monkeypatch):
    """The launcher decides from the listing as it is at its poll: a host that discovery
    saw come and go since the last one leaves no trace (no restart, no slots), while one
    still listed asks for one."""
    source = discovery_source(tmp_path, "file", "h0:1\n")
    monkeypatch.setattr(discovery, "POLL_S", 3600.0)  # the reads below are the test's
    args = launcher.parse_args(["-np", "1", "--max-np", "3", "--host-discovery-script",
                           str(source), "true"])
    listing = launcher.Hosts(args)
    assert first_listing(listing.discovery) == {"h0": 1}
    job = {"size": 1, "hosts": ["h0"]}
    source.write_text("h0:1\nh1:2\n")
    listing.discovery._read_once()
    source.write_text("h0:1\n")
    listing.discovery._read_once()
    assert listing.usable() == {"h0": 1}
    assert launcher.wanted_change(args, listing.usable(), job) == ""
    source.write_text("h0:1\nh1:2\n")
    listing.discovery._read_once()
    assert launcher.wanted_change(args, listing.usable(), job) == "3 slots for 1 ranks"

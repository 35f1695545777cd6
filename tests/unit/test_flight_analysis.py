"""The flight recorder's analyzer (collectives/debug.py) and the straggler watch
(runtime/stragglers.py) on records and counters made up here: what each says about a
missing rank, a mismatch, ranks that part, a straggler, and the labels of process sets,
with no job and no clock (tests/unit/test_flight_recorder.py runs them in whole jobs)."""

from __future__ import annotations

import logging

import pytest

from collectives import debug
from collectives.runtime import stragglers


def call(seq: int, collective: str = "allreduce", phase: str = "done", comm: str = "job",
         detail: str = "float32 (100,)", last: int = -1, waited: float = 0.0) -> dict:
    """One call as runtime/flight.py records it (times in seconds on the job's clock)."""
    start = float(seq)
    return {"seq": seq, "comm": comm, "comm_seq": seq, "collective": collective,
            "detail": detail, "algorithm": "ring", "queued": start, "start": start,
            "agreed": None if phase == "entered" else start + 0.1,
            "end": start + 0.2 if phase == "done" else None, "bytes": 400, "last": last,
            "waited": waited, "phase": phase}


def dump(rank: int, size: int, calls: list[dict], clock: float = 100.0,
         state: str = "waiting", survey: dict[str, str] | None = None) -> dict:
    return {"format": debug.FORMAT, "rank": rank, "size": size, "host": f"h{rank}",
            "pid": 1000 + rank, "reason": "asked", "clock": clock,
            "state": {"state": state, "calls": len(calls), "collective": "", "detail": "",
                      "age": 2.5},
            "calls": calls, "survey": survey or {}}


def test_a_rank_that_wrote_nothing_is_named_with_what_the_others_saw():
    """Ranks 0 and 1 finished 4 calls and entered the 5th; rank 2 wrote no record, and rank
    0's watchdog had heard it was in a barrier."""
    calls = [call(s) for s in range(1, 5)] + [call(5, phase="entered")]
    dumps = {0: dump(0, 3, calls, survey={"2": "in a barrier"}), 1: dump(1, 3, calls)}
    report = debug.analyze(dumps)
    assert report[0] == "flight records of 2 of 3 ranks; none from ranks [2] (stopped or dead?)"
    assert "  last call every recorded rank finished: #4 allreduce float32 (100,)" in report
    assert "  they part at #5 allreduce float32 (100,):" in report
    # entered at 5.0 on the job's clock, dumped at 100.0
    assert "    rank 0: entered it, waiting for the others to agree for 95.0 s" in report
    assert "    rank 2: wrote no record; rank 0's watchdog found it in a barrier" in report
    assert not any("MISMATCH" in line for line in report), report


def test_ranks_in_different_calls_at_one_position_are_a_mismatch():
    common = [call(s) for s in range(1, 3)]
    dumps = {0: dump(0, 3, common + [call(3, phase="entered")]),
             1: dump(1, 3, common + [call(3, phase="entered")]),
             2: dump(2, 3, common + [call(3, "allgather", phase="entered", detail="float64 (3,)")])}
    report = debug.analyze(dumps)
    assert report[0] == "flight records of 3 of 3 ranks"
    assert ("  MISMATCH at #3: ranks [0, 1] called allreduce float32 (100,); "
            "ranks [2] called allgather float64 (3,)") in report, report
    # every rank entered the call: the mismatch says all there is
    assert not any("they part" in line for line in report), report


def test_a_rank_behind_the_others_is_shown_as_not_having_entered():
    ahead = [call(s) for s in range(1, 4)] + [call(4, phase="entered")]
    dumps = {0: dump(0, 2, ahead), 1: dump(1, 2, ahead[:2], state="idle")}
    report = debug.analyze(dumps)
    assert "  last call every recorded rank finished: #2 allreduce float32 (100,)" in report
    assert "  they part at #3 allreduce float32 (100,):" in report
    assert "    rank 0: finished it" in report
    assert "    rank 1: had not entered it (idle 2.5 s, after 2 calls here)" in report


def test_the_rank_the_others_waited_for_most_leads():
    calls = [call(s, last=2 if s % 4 else 1, waited=0.3 if s % 4 else 0.1)
             for s in range(1, 9)]
    dumps = {r: dump(r, 3, calls) for r in range(3)}
    report = debug.analyze(dumps)
    # rank 2 last in 6 calls (1.8 s), rank 1 in 2 (0.2 s)
    assert report[-1] == ("  the others waited most for: rank 2 1.800 s (90%), "
                          "rank 1 0.200 s (10%) of 2.000 s of waiting in 8 calls"), report


def test_process_sets_are_read_apart_by_their_labels():
    assert debug.members("job", 4) == [0, 1, 2, 3]
    assert debug.members("job.2", 3) == [0, 1, 2]
    assert debug.members("ranks 0-3,6", 8) == [0, 1, 2, 3, 6]
    assert debug.members("ranks 5", 8) == [5]
    job = [call(s) for s in range(1, 3)]
    pair = [call(s, comm="ranks 0-1") for s in range(1, 4)]
    dumps = {0: dump(0, 3, job + pair), 1: dump(1, 3, job + pair), 2: dump(2, 3, job)}
    report = debug.analyze(dumps)
    assert "communicator job (3 ranks, records from 3):" in report, report
    assert "communicator ranks 0-1 (2 ranks, records from 2):" in report, report
    assert "  last call every recorded rank finished: #3 allreduce float32 (100,)" in report


def test_a_folder_without_records_is_refused(tmp_path):
    with pytest.raises(ValueError, match="DIR: no flight records"):
        debug.load(str(tmp_path))


def test_the_trace_has_a_row_per_rank_and_a_span_per_call():
    calls = [call(1, last=1, waited=0.25), call(2, phase="entered")]
    events = debug.trace({0: dump(0, 2, calls), 1: dump(1, 2, calls[:1])})["traceEvents"]
    spans = [e for e in events if e.get("name") == "allreduce"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in spans] == \
        [(0, 1e6, pytest.approx(0.2e6)), (0, 2e6, pytest.approx(98e6)),
         (1, 1e6, pytest.approx(0.2e6))]  # an unfinished call runs to the dump
    assert spans[0]["args"]["last_to_arrive"] == 1
    assert spans[0]["args"]["others_waited_ms"] == pytest.approx(250)


class Counters:
    """Stand-in for a communicator's _C.Stats: the seconds each rank was waited for."""

    def __init__(self, size: int):
        self.seconds = [0.0] * size

    def waits(self) -> list[float]:
        return list(self.seconds)


@pytest.fixture
def clock(monkeypatch):
    """The watch's clock, moved by the test."""
    now = [1000.0]
    monkeypatch.setattr(stragglers.time, "monotonic", lambda: now[0])
    return now


def said(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records]
    caplog.clear()
    return lines


def test_a_straggler_is_named_once_while_it_stays_one(clock, caplog):
    """Windows of 10 s, 3 ranks, share 0.25: a rank waited for more than a quarter of the
    two others' 20 s is named once, not again while it stays the straggler, and the end of
    it is said once; another one is named in turn."""
    caplog.set_level(logging.WARNING, "collectives")
    counters = Counters(3)
    watch = stragglers.Stragglers(counters, 3, share=0.25, window_s=10.0)

    def window(waited_for: dict[int, float], seconds: float = 10.0) -> list[str]:
        for rank, s in waited_for.items():
            counters.seconds[rank] += s
        clock[0] += seconds
        watch.tick()
        return said(caplog)

    assert window({2: 4.0}) == []  # 20% of their time: under the share
    first = window({2: 6.0})
    assert len(first) == 1 and "spent 30% of their time in the last 10 s waiting for rank 2 " \
        "(6.0 s together)" in first[0], first
    assert watch.named == 2
    assert window({2: 9.0, 1: 1.0}) == []  # still rank 2: quiet
    ended = window({2: 1.0})
    assert len(ended) == 1 and "rank 2 no longer holds the others back (5% of their time" \
        in ended[0], ended
    assert watch.named is None and window({}) == []
    other = window({1: 8.0, 0: 1.0})
    assert len(other) == 1 and "waiting for rank 1" in other[0], other


def test_the_watch_reads_only_at_a_windows_end_and_not_alone(clock, caplog):
    caplog.set_level(logging.WARNING, "collectives")
    counters = Counters(2)
    watch = stragglers.Stragglers(counters, 2, share=0.5, window_s=10.0)
    counters.seconds[1] = 9.0
    clock[0] += 9.0
    watch.tick()  # 9 s of 10: not yet
    assert said(caplog) == [] and watch.named is None
    clock[0] += 1.0
    watch.tick()
    assert watch.named == 1 and len(said(caplog)) == 1  # 9 s of the other's 10 s
    alone = stragglers.Stragglers(Counters(1), 1, share=0.5, window_s=1.0)
    clock[0] += 5.0
    alone.tick()
    assert alone.named is None and said(caplog) == []


def test_the_watch_refuses_a_bad_share_or_window():
    with pytest.raises(ValueError, match=r"COLLECTIVES_STRAGGLER_SHARE: expected a share in "
                                         r"\(0, 1\], got 0"):
        stragglers.Stragglers(Counters(2), 2, share=0, window_s=1.0)
    with pytest.raises(ValueError, match="COLLECTIVES_STRAGGLER_WINDOW_S: expected seconds > 0"):
        stragglers.Stragglers(Counters(2), 2, share=0.5, window_s=0.0)

"""Read the flight recorder's dumps (runtime/flight.py) of a job together:

    python -m collectives.debug DIR [--trace FILE]

says, in a few lines, for each communicator the record holds: the last call every rank that
wrote finished, the call where they part (who entered it, who had not, and what the ranks
that wrote nothing were last seen doing, as the watchdog's survey found them), ranks that
entered different calls at the same position (a mismatch), and the ranks the others waited
for most over the record. It also writes the merged record as a Chrome-trace file
(DIR/trace.json unless --trace says otherwise; one row per rank, on the job's clock), which
Perfetto (ui.perfetto.dev) and chrome://tracing open.

A stopped or dead rank writes no file: what is known of it comes from the others' files.
Calls are matched by their number on their communicator (every member numbers the calls
it makes there alike), so process sets are read apart from the job's communicator."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict
from typing import Any

FORMAT = "collectives-flight-1"  # runtime/flight.py's FORMAT (read without importing MPI)

#: A call's phase in a record (csrc/runtime/engine.h, Record::Phase), as the report says it.
PHASES = {"entered": "entered it, waiting for the others to agree",
          "agreed": "agreed, moving its data", "done": "finished it",
          "failed": "left it with an error"}


def load(folder: str) -> dict[int, dict]:
    """The dumps in folder by rank; ValueError if there are none."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(folder, "rank*.json"))):
        with open(path) as f:
            content = json.load(f)
        if content.get("format") == FORMAT:
            dumps[content["rank"]] = content
    if not dumps:
        raise ValueError(f"DIR: no flight records (rank<R>.json) in {folder!r}")
    return dumps


def members(label: str, size: int) -> list[int]:
    """The job ranks of the communicator a label names ("job", "job.<generation>" or
    "ranks 0-3,6")."""
    if not label.startswith("ranks "):
        return list(range(size))
    out: list[int] = []
    for part in label.removeprefix("ranks ").split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _call(entry: dict) -> str:
    return f"{entry['collective']} {entry['detail']}"


def _seen(dumps: dict[int, dict], rank: int) -> str:
    """What the writing ranks' watchdogs last heard of rank (their surveys)."""
    for dump in dumps.values():
        text = dump.get("survey", {}).get(str(rank))
        if text:
            return f"rank {dump['rank']}'s watchdog found it {text}"
    return "no rank asked it"


def analyze(dumps: dict[int, dict]) -> list[str]:
    """The report's lines."""
    size = next(iter(dumps.values()))["size"]
    silent = sorted(set(range(size)) - set(dumps))
    lines = [f"flight records of {len(dumps)} of {size} ranks"
             + (f"; none from ranks {silent} (stopped or dead?)" if silent else "")]
    for rank, dump in sorted(dumps.items()):
        lines.append(f"  rank {rank} ({dump['host']}, pid {dump['pid']}): {dump['reason']}")
    by_comm: dict[str, dict[int, dict[int, dict]]] = defaultdict(dict)
    for rank, dump in dumps.items():
        for entry in dump["calls"]:
            by_comm[entry["comm"]].setdefault(rank, {})[entry["comm_seq"]] = entry
    for label, calls in sorted(by_comm.items()):
        lines += _communicator(label, calls, dumps, size)
    return lines


def _communicator(label: str, calls: dict[int, dict[int, dict]], dumps: dict[int, dict],
                  size: int) -> list[str]:
    ranks = members(label, size)
    writers = sorted(calls)
    lines = [f"communicator {label} ({len(ranks)} ranks, records from {len(writers)}):"]
    done = {r: max((s for s, e in calls[r].items() if e["phase"] == "done"), default=0)
            for r in writers}
    common = min(done.values())
    if common and all(common in calls[r] for r in writers):
        lines.append(f"  last call every recorded rank finished: #{common} "
                     f"{_call(calls[writers[0]][common])}")
    mismatch = _first_mismatch(calls, writers)
    if mismatch is not None:
        seq, differ = mismatch
        lines.append(f"  MISMATCH at #{seq}: " + "; ".join(
            f"ranks {rs} called {text}" for text, rs in differ.items()))
    part = common + 1
    entered = {r: calls[r][part] for r in writers if part in calls[r]}
    silent = [r for r in ranks if r not in dumps]
    if mismatch is not None and mismatch[0] == part and len(entered) == len(ranks):
        entered = {}  # every rank entered it: the mismatch says all there is
    if entered or silent:
        first = next(iter(entered.values()), None)
        what = _call(first) if first else "the next call"
        lines.append(f"  they part at #{part} {what}:")
        for r in writers:
            e = entered.get(r)
            if e is None:
                state = dumps[r]["state"]
                lines.append(f"    rank {r}: had not entered it ({state['state']} "
                             f"{state['age']:.1f} s, after {done[r]} calls here)")
            else:
                since = dumps[r]["clock"] - (e["start"] or 0)
                lines.append(f"    rank {r}: {PHASES[e['phase']]}"
                             + (f" for {since:.1f} s" if e["phase"] != "done" else ""))
        for r in silent:
            lines.append(f"    rank {r}: wrote no record; {_seen(dumps, r)}")
    lines += _slowest(calls, writers, len(ranks))
    return lines


def _first_mismatch(calls: dict[int, dict[int, dict]],
                    writers: list[int]) -> tuple[int, dict[str, list[int]]] | None:
    """The first call number at which recorded ranks entered different calls."""
    seqs = sorted(set().union(*(calls[r].keys() for r in writers)))
    for seq in seqs:
        texts: dict[str, list[int]] = defaultdict(list)
        for r in writers:
            if seq in calls[r]:
                texts[_call(calls[r][seq])].append(r)
        if len(texts) > 1:
            return seq, dict(texts)
    return None


def _slowest(calls: dict[int, dict[int, dict]], writers: list[int], n: int) -> list[str]:
    """The ranks the others waited for most over the record (every rank's calls carry the
    same waits: the fullest record is read)."""
    fullest = max(writers, key=lambda r: len(calls[r]))
    entries = [e for e in calls[fullest].values() if e["phase"] == "done"]
    waited: dict[int, float] = defaultdict(float)
    for e in entries:
        if e["last"] >= 0:
            waited[e["last"]] += e["waited"]
    total = sum(waited.values())
    if not total or n < 2:
        return []
    top = sorted(waited.items(), key=lambda kv: -kv[1])[:3]
    return ["  the others waited most for: " + ", ".join(
        f"rank {r} {s:.3f} s ({100 * s / total:.0f}%)" for r, s in top)
        + f" of {total:.3f} s of waiting in {len(entries)} calls"]


def trace(dumps: dict[int, dict]) -> dict[str, Any]:
    """The merged record as Chrome-trace JSON: one process per rank, each call a span from
    entering to its end (to the dump for one unfinished), its agreement inside it."""
    events: list[dict] = []
    for rank, dump in sorted(dumps.items()):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank} ({dump['host']})"}})
        for e in dump["calls"]:
            if e["start"] is None:
                continue
            end = e["end"] if e["end"] is not None else dump["clock"]
            args = {k: e[k] for k in ("comm", "comm_seq", "seq", "detail", "algorithm",
                                      "bytes", "phase")}
            if e["last"] >= 0:
                args.update(last_to_arrive=e["last"], others_waited_ms=e["waited"] * 1e3)
            events.append({"name": e["collective"], "cat": e["comm"], "ph": "X", "pid": rank,
                           "tid": 0, "ts": e["start"] * 1e6,
                           "dur": max(0.0, (end - e["start"]) * 1e6), "args": args})
            agreed = e["agreed"] if e["agreed"] is not None else end
            events.append({"name": "agreement", "ph": "X", "pid": rank, "tid": 0,
                           "ts": e["start"] * 1e6, "dur": max(0.0, (agreed - e["start"]) * 1e6)})
        events.append({"name": f"dump: {dump['reason']}", "ph": "i", "s": "p", "pid": rank,
                       "tid": 0, "ts": dump["clock"] * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collectives.debug", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="the folder the ranks dumped into")
    parser.add_argument("--trace", help="Chrome-trace file to write (default DIR/trace.json)")
    args = parser.parse_args(argv)
    try:
        dumps = load(args.dir)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("\n".join(analyze(dumps)))
    path = args.trace or os.path.join(args.dir, "trace.json")
    with open(path, "w") as f:
        json.dump(trace(dumps), f)
    print(f"trace (Perfetto, chrome://tracing): {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

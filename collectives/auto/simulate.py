"""Predict every algorithm's time on a cluster we cannot run, and what `auto` would choose.

    python -m collectives simulate --nodes 2,64,512,4096 --ranks-per-node 8 \\
        --gbits 100 --latency-us 5 --plot clusters.png

The cluster is nodes x ranks-per-node with the given link between nodes; inside a node,
costmodel.Params' defaults (2 ranks on a two-core host), or --tuning FILE's. Each
algorithm is priced by its own cost() (the formula its module states, select.predict adds
the agreement's exchange), and 1-bit compressed allreduce by onebit.cost. The table gives
microseconds per call, `auto`'s choice (the model's minimum: on a real cluster the first job
also measures) and its speedup over `mpi`, the MPI library's own collective.

    python -m collectives simulate --nodes 2 --ranks-per-node 1 --gbits 1 --latency-us 30 \\
        --min-bytes 1048576 --compare measured.json

checks the model against a `benchmarks/bandwidth.py --json` run on such a cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from collectives.algorithms import onebit
from collectives.algorithms.costmodel import Layout, Params
from collectives.auto import select

COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")


def params(gbits: float, latency_us: float, base: Params | None = None) -> Params:
    """base (a node's parameters: Params' defaults when None) with the inter-node link replaced."""
    return dataclasses.replace(base or Params(), alpha_inter=latency_us * 1e-6,
                               beta_inter=8 / (gbits * 1e9))


def table(collective: str, layout: Layout, p: Params, sizes: list[int],
          block_size: int | None = 32) -> list[dict]:
    """One row per size: each algorithm's predicted seconds, auto's choice."""
    rows = []
    for nbytes in sizes:
        times = select.predict(collective, nbytes, layout, p)
        choice = min(times, key=times.get)
        row = {"size": nbytes, "auto": choice, "times": dict(times)}
        if collective == "allreduce":
            row["times"]["onebit"] = onebit.cost(nbytes, layout, p, block_size)
        rows.append(row)
    return rows


def compare(measured: dict, layout: Layout, p: Params, min_bytes: int = 1 << 20,
            block_size: int | None = 32) -> list[dict]:
    """The model beside a measurement: for each allreduce row of `benchmarks/bandwidth.py
    --json` (its {"np", "rows"}) of at least min_bytes whose algorithm the model prices,
    {"algo", "size", "predicted", "median", "best"} in seconds (median and best of its
    timing rounds). Raises ValueError when the measurement ran on another number of ranks."""
    if measured["np"] != layout.size:
        raise ValueError(f"the measurement ran on {measured['np']} ranks, the described "
                         f"cluster has {layout.size}")
    out = []
    for row in measured["rows"]:
        if row["op"] != "allreduce" or row["size"] < min_bytes:
            continue
        times = table("allreduce", layout, p, [row["size"]], block_size)[0]["times"]
        if row["algo"] not in times:
            continue
        rounds = row.get("rounds_us") or [row["time_us"]]
        out.append({"algo": row["algo"], "size": row["size"],
                    "predicted": times[row["algo"]], "median": row["time_us"] * 1e-6,
                    "best": min(rounds) * 1e-6})
    return out


def _format_compare(points: list[dict], tolerance: float = 0.3) -> list[str]:
    """A markdown table, one row per algorithm: predicted / median ms (predicted / median;
    predicted / best round), `**` where the median is off by more than tolerance."""
    sizes = sorted({pt["size"] for pt in points})
    lines = ["| algorithm | " + " | ".join(_size_text(s) for s in sizes) + " |",
             "|---" * (len(sizes) + 1) + "|"]
    for algo in dict.fromkeys(pt["algo"] for pt in points):
        cells = []
        for size in sizes:
            pt = next((q for q in points if q["algo"] == algo and q["size"] == size), None)
            if pt is None:
                cells.append("-")
                continue
            ratio, best = pt["predicted"] / pt["median"], pt["predicted"] / pt["best"]
            flag = " **" if abs(ratio - 1) > tolerance else ""
            cells.append(f"{pt['predicted'] * 1e3:.1f} / {pt['median'] * 1e3:.1f} "
                         f"({ratio:.2f}; {best:.2f}){flag}")
        lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    within = sum(abs(pt["predicted"] / pt["median"] - 1) <= tolerance for pt in points)
    best = sum(abs(pt["predicted"] / pt["best"] - 1) <= tolerance for pt in points)
    lines.append(f"\nwithin {tolerance:.0%}: {within} of {len(points)} points against the "
                 f"median, {best} against the best round")
    return lines


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _format(rows: list[dict]) -> list[str]:
    algos = sorted({a for r in rows for a in r["times"]})
    lines = [f"{'size':>12} " + " ".join(f"{a:>13}" for a in algos)
             + f" {'auto':>13} {'vs_mpi':>7}"]
    for r in rows:
        t = r["times"]
        cells = " ".join(f"{t[a] * 1e6:13.1f}" if a in t and math.isfinite(t[a]) else
                         f"{'-':>13}" for a in algos)
        vs = t["mpi"] / t[r["auto"]] if "mpi" in t else math.nan
        lines.append(f"{r['size']:>12} {cells} {r['auto']:>13} {vs:7.2f}")
    return lines


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,64,512,4096", help="node counts, comma-separated")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--gbits", type=float, default=100.0, help="link between nodes, Gbit/s")
    ap.add_argument("--latency-us", type=float, default=5.0, help="link latency, us")
    ap.add_argument("--tuning", help="a tuning file whose params describe a node")
    ap.add_argument("--collectives", default="allreduce")
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--block-size", type=int, default=32, help="1-bit scales' block")
    ap.add_argument("--json", help="write every table here")
    ap.add_argument("--plot", help="write allreduce busbw per algorithm here (PNG)")
    ap.add_argument("--compare", metavar="JSON",
                    help="a `benchmarks/bandwidth.py --json` measurement on the described "
                         "cluster (one --nodes value): print predicted / measured allreduce "
                         "times from --min-bytes up instead of the tables")
    args = ap.parse_args(argv)
    base = None
    if args.tuning:
        with open(args.tuning) as f:
            base = Params(**json.load(f)["params"])
    p = params(args.gbits, args.latency_us, base)
    if args.compare:
        _compare_main(args, p)
        return
    sizes = _sizes(args.min_bytes, args.max_bytes)
    out = {}
    for nodes in (int(n) for n in args.nodes.split(",")):
        layout = Layout((args.ranks_per_node,) * nodes)
        for collective in args.collectives.split(","):
            if collective not in COLLECTIVES:
                raise SystemExit(f"--collectives: expected some of {COLLECTIVES}, got "
                                 f"{collective!r}")
            rows = table(collective, layout, p, sizes, args.block_size or None)
            out[f"{nodes}x{args.ranks_per_node} {collective}"] = rows
            print(f"# {collective}, {nodes} nodes x {args.ranks_per_node} ranks, "
                  f"{args.gbits:g} Gbit/s, {args.latency_us:g} us between nodes; us per call")
            print("\n".join(_format(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        _plot(out, args.plot)


def _compare_main(args: argparse.Namespace, p: Params) -> None:
    nodes = args.nodes.split(",")
    if len(nodes) != 1:
        raise SystemExit(f"--compare: give one --nodes value, got {args.nodes!r}")
    with open(args.compare) as f:
        measured = json.load(f)
    layout = Layout((args.ranks_per_node,) * int(nodes[0]))
    try:
        points = compare(measured, layout, p, args.min_bytes, args.block_size or None)
    except ValueError as e:
        raise SystemExit(f"--compare {args.compare}: {e}") from None
    print(f"# allreduce, {nodes[0]} nodes x {args.ranks_per_node} ranks, {args.gbits:g} "
          f"Gbit/s, {args.latency_us:g} us: predicted / measured ms (ratio to the median; "
          f"to the best round)")
    print("\n".join(_format_compare(points)))


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {k: v for k, v in out.items() if k.endswith("allreduce")}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels.items()):
        for algo in sorted({a for r in rows for a in r["times"]}):
            pts = [(r["size"], r["size"] / r["times"][algo] / 1e9) for r in rows
                   if math.isfinite(r["times"].get(algo, math.inf))]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("bytes")
        ax.set_ylabel("size / time (GB/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


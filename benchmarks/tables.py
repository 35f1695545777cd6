"""Markdown tables from bandwidth.py's --json files: one row per (op, size), one column per
algorithm, each cell "time / busbw (x mpi)", as benchmarks/README.md shows them.

    python benchmarks/tables.py benchmarks/results/np2-allreduce.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _time(us: float) -> str:
    return f"{us / 1e3:.1f} ms" if us >= 1e4 else f"{us:.0f} us" if us >= 100 else f"{us:.1f} us"


def table(rows: list[dict]) -> str:
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    keys = list(dict.fromkeys((r["op"], r["size"]) for r in rows))
    cell = {(r["op"], r["size"], r["algo"]): r for r in rows}
    ops = {op for op, _ in keys}
    head = (["op"] if len(ops) > 1 else []) + ["size"] + algos
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op, size in keys:
        cells = []
        for a in algos:
            r = cell.get((op, size, a))
            if r is None:
                cells.append("")
                continue
            ratio = r.get("vs_mpi", float("nan"))
            ratio_text = "" if a == "mpi" or ratio != ratio else f" ({ratio:.2f}x)"
            cells.append(f"{_time(r['time_us'])} / {r['busbw']:.3f}{ratio_text}")
        lines.append("| " + " | ".join(([op] if len(ops) > 1 else []) + [_size(size)] + cells)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    for path in p.parse_args().files:
        with open(path) as f:
            data = json.load(f)
        print(f"<!-- {path}, np={data['np']} -->")
        print(table(data["rows"]))
        print()


if __name__ == "__main__":
    main()

"""Bytes on the wire: what each rank receives in one allreduce of a float32 vector, for
float32's ring and each compressed form on one level of n ranks (no link enters: what a
form sends depends only on the vector and the ranks).

    python -m collectives bytes --count 16777216 --ranks 2,4,8,64,1024

The formulas are the modules' own (twophase.received_bytes, algorithms/onebit's,
topk.received_bytes); the table shows which forms grow with the ranks (the allgather of
every rank's quantized vector, Top-K's allgather of every rank's pairs) and which do not
(the two phases, 1-bit's exchange, the ring)."""

from __future__ import annotations

import argparse
import json

from collectives.algorithms import onebit
from collectives.compression import Int4Compressor, Int8Compressor, topk, twophase

#: the forms priced: float32's ring, then each compressed allreduce
FORMS = ("float32 ring", "int8 allgather", "int8 two-phase", "int4 allgather",
         "int4 two-phase", "1-bit", "Top-K 1%")


def received_bytes(form: str, n: int, count: int, block_size: int | None = 32,
                   rank: int = 0) -> int:
    """Bytes a rank receives in one allreduce of count float32 elements on n ranks in form
    (FORMS; 1-bit with block_size elements per scale; the two phases' chunks differ by a
    block from rank to rank: rank's): a ring's reduce-scatter and allgather receive n - 1
    chunks of the vector each."""
    if form == "float32 ring":
        return 2 * (n - 1) * 4 * -(-count // n) if n > 1 else 0
    if form == "1-bit":
        return onebit.received_bytes(count, n, block_size)
    if form == "Top-K 1%":
        return topk.received_bytes(count, n, 0.01)
    if form not in FORMS:
        raise ValueError(f"form: expected one of {list(FORMS)}, got {form!r}")
    bits, shape = form.split(" ")
    codec = Int8Compressor() if bits == "int8" else Int4Compressor()
    return twophase.received_bytes(shape, codec, n, count, rank)


def table(count: int, ranks: list[int], block_size: int | None = 32) -> list[dict]:
    """One row per form: {"form", "bytes": {n: bytes received per rank}}."""
    return [{"form": form, "bytes": {n: received_bytes(form, n, count, block_size)
                                     for n in ranks}} for form in FORMS]


def format_table(count: int, rows: list[dict]) -> list[str]:
    """rows as a Markdown table in MiB."""
    ranks = list(rows[0]["bytes"])
    lines = [f"| MiB received a rank, {4 * count / 2**20:g} MiB of float32 | "
             + " | ".join(f"N = {n}" for n in ranks) + " |",
             "|---|" + "---:|" * len(ranks)]
    for row in rows:
        lines.append(f"| {row['form']} | "
                     + " | ".join(f"{b / 2**20:.2f}" for b in row["bytes"].values()) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1 << 24, help="float32 elements")
    ap.add_argument("--ranks", default="2,4,8,64,1024", help="rank counts, comma-separated")
    ap.add_argument("--block-size", type=int, default=32, help="1-bit scales' block")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = table(args.count, [int(n) for n in args.ranks.split(",")], args.block_size or None)
    print("\n".join(format_table(args.count, rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)

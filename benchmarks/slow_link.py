"""Training a byte-level transformer language model across a slow link: samples/s, loss and
time to a target loss per data-parallel setup, this library's beside PyTorch's own (gloo
DDP, with PowerSGD or fp16 compression).

    python benchmarks/slow_link.py --json alone.json                  # one rank: the base
    rig_run 2 1 python benchmarks/slow_link.py --baseline alone.json --json 1gbit.json
    python benchmarks/slow_link.py --plot slow_link.png --baseline alone.json \\
        1gbit=1gbit.json 100mbit=100mbit.json                          # no MPI: the plot

Model: a pre-norm transformer (--dim 384, --layers 6, 6 heads, 4x MLP: about 10.9M
parameters) predicting the next byte of --seq bytes. Data: the Python standard library's
own source (the .py files under sysconfig's stdlib path, sorted, the first --data-mb MiB):
text every machine with Python has. Every step, each rank trains on its --batch windows of
a global batch drawn with the step's seed, so every setup sees the same data from the same
weights (Adam, --lr). Per setup:
  samples/s     over the steps after --warmup, the slowest rank's step time
  loss          the ranks' mean loss over the last --window steps
  to target     seconds from the first step until that windowed loss first falls under
                --target (empty if it does not within --steps)
  scaling       samples/s / (np x the one-rank base's samples/s), given --baseline
  held out      the final model's loss on 64 windows of the corpus's last tenth (training
                draws from the first nine tenths); DiLoCo's: the ranks' shared model
  MB/step       bytes this rank sent per step (this library's setups; not gloo's)
Setups at np > 1 (--setups): DistributedOptimizer (`none`, `fp16`, `int8`, `int4`, `topk`:
Top-K 1% with error feedback), `onebit-adam`
(OnebitAdam, --freeze-step), DDP on this library's backend with its hooks (`ddp-fp16`,
`ddp-int8`, `ddp-onebit`; `ddp` uncompressed), `zero2-int8` (ZeroOptimizer stage 2, int8
gradients and parameters), and gloo DDP: `gloo`, `gloo-powersgd` (PowerSGD rank 4),
`gloo-fp16`; DiLoCo over Adam, `diloco-H[-fF][-fp16|int8|int4][-avg]` (sync_every H,
F fragments, overlapped; `-avg`: the outer optimizer plain SGD at lr 1, which averages the
ranks' models, instead of Nesterov 0.7/0.9; not in the default list). At np 1 the one
setup is `alone` (torch's Adam, no communication).
--compile runs each setup's model through torch.compile (torch.compile(DDP(model)) for
the DDP setups; keep its first compiled steps inside --warmup)."""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

SETUPS = ("none", "fp16", "int8", "int4", "topk", "onebit-adam", "ddp", "ddp-fp16", "ddp-int8", "ddp-onebit",
          "zero2-int8", "gloo", "gloo-powersgd", "gloo-fp16")


class ByteLM(nn.Module):
    """Next-byte prediction: byte and position embeddings, pre-norm transformer layers with
    a causal mask, a linear head over the 256 bytes."""

    def __init__(self, dim: int, layers: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, max(1, dim // 64), 4 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        return self.head(self.norm(self.body(h, mask=self.mask[:n, :n], is_causal=True)))


def corpus(megabytes: float) -> torch.Tensor:
    """The first `megabytes` MiB of the standard library's .py files, as bytes."""
    limit, parts, size = int(megabytes * 2**20), [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(parts)[:limit]), dtype=torch.uint8)


#: The share of the corpus training draws from; evaluate() reads the rest.
TRAIN_SHARE = 0.9


def batch(data: torch.Tensor, step: int, args, rank: int, size: int):
    """This rank's windows of step's global batch: inputs and next-byte targets."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, int(data.numel() * TRAIN_SHARE) - args.seq - 1,
                          args.batch * size)[rank::size]
    rows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def diloco_options(setup: str) -> tuple[int, int, str, bool]:
    """diloco-H[-fF][-none|fp16|int8|int4][-avg] -> (H, F, compression, averaging: the outer
    optimizer plain SGD at lr 1, i.e. the ranks' models averaged, instead of the default
    Nesterov SGD 0.7/0.9)."""
    parts = setup.split("-")[1:]
    h, fragments, compression, averaging = int(parts[0]), 1, "none", False
    for part in parts[1:]:
        if part.startswith("f"):
            fragments = int(part[1:])
        elif part == "avg":
            averaging = True
        else:
            compression = part
    return h, fragments, compression, averaging


def setup_training(setup: str, net: nn.Module, args):
    """(model to call, optimizer, process group backend or None) for setup."""
    from collectives.optim import DistributedOptimizer, OnebitAdam, ZeroOptimizer

    import collectives as C

    adam = torch.optim.Adam
    if setup.startswith("diloco-"):
        from collectives.optim import DiLoCo

        h, fragments, compression, averaging = diloco_options(setup)
        outer = torch.optim.SGD(net.parameters(), lr=1.0) if averaging else None
        return net, DiLoCo(net, adam(net.parameters(), lr=args.lr), outer, sync_every=h,
                           fragments=fragments,
                           compression=getattr(C.Compression, compression)), None
    if setup == "alone":
        return net, adam(net.parameters(), lr=args.lr), None
    if setup in ("none", "fp16", "int8", "int4", "topk"):
        compression = C.Compression.topk(0.01) if setup == "topk" else \
            getattr(C.Compression, setup)
        return net, DistributedOptimizer(adam(net.parameters(), lr=args.lr),
                                         named_parameters=net.named_parameters(),
                                         compression=compression), None
    if setup == "onebit-adam":
        return net, OnebitAdam(net.parameters(), lr=args.lr, freeze_step=args.freeze_step), None
    if setup == "zero2-int8":
        return net, ZeroOptimizer(adam(net.parameters(), lr=args.lr), stage=2,
                                  compression=C.Compression.int8,
                                  parameter_compression=C.Compression.int8), None
    backend = "gloo" if setup.startswith("gloo") else "collectives"
    dist.init_process_group(backend)
    hook = setup.split("-", 1)[1] if "-" in setup else None
    # PowerSGD on gloo in one bucket: its hook starts each bucket's second allreduce from
    # the first's completion, on gloo's thread, so with several buckets the ranks can
    # issue them in different orders (gloo then fails on a size mismatch)
    ddp = nn.parallel.DistributedDataParallel(
        net, bucket_cap_mb=1024 if hook == "powersgd" else 25)
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook == "fp16" and backend == "gloo":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is not None:
        from collectives.integrations import ddp_hooks

        state = ddp_hooks.OnebitHookState(warmup_steps=args.freeze_step) \
            if hook == "onebit" else None
        ddp.register_comm_hook(state, getattr(ddp_hooks, f"{hook}_hook"))
    return ddp, adam(ddp.parameters(), lr=args.lr), backend


def measure(setup: str, data: torch.Tensor, args) -> dict:
    import collectives as C

    torch.manual_seed(args.seed)
    net = ByteLM(args.dim, args.layers, args.seq)
    model, opt, backend = setup_training(setup, net, args)
    if args.compile:
        model = torch.compile(model)
    rank, size = C.rank(), C.size()
    losses, times = [], []
    sent = C.stats()["bytes_sent"]
    try:
        for step in range(args.steps):
            x, y = batch(data, step, args, rank, size)
            start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        if hasattr(opt, "use_anchor"):  # DiLoCo: the ranks' shared model
            opt.use_anchor()
        sent = (C.stats()["bytes_sent"] - sent) / args.steps
        held_out = evaluate(model, data, args)
    finally:
        if backend is not None:
            dist.destroy_process_group()
    times = np.max(C.allgather(np.array([times])), axis=0)  # the slowest rank's steps
    losses = C.allreduce(np.array(losses), op=C.Average)
    window = np.convolve(losses, np.ones(args.window) / args.window, "valid")
    below = np.nonzero(window < args.target)[0]
    timed = times[args.warmup:]
    return {"setup": setup + (" compiled" if args.compile else ""), "np": size,
            "params": sum(p.numel() for p in net.parameters()),
            "samples_per_s": args.batch * size * len(timed) / timed.sum(),
            "loss": float(window[-1]), "samples": args.batch * size * args.steps,
            "to_target_s": float(np.cumsum(times)[below[0] + args.window - 1])
            if below.size else None, "held_out_loss": held_out,
            "sent_per_step": None if backend == "gloo" else float(sent),
            "losses": losses.tolist(),
            "step_s": times.tolist()}


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, args) -> float:
    """The model's loss on 64 windows from the corpus past TRAIN_SHARE, which the training
    batches never hold."""
    g = torch.Generator().manual_seed(12345)
    lo = int(len(data) * TRAIN_SHARE)
    starts = lo + torch.randint(0, len(data) - lo - args.seq - 1, (64,), generator=g)
    rows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()]).long()
    logits = model(rows[:, :-1])
    return float(nn.functional.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1)))


def table(rows: list[dict], base: float | None) -> None:
    print(f"# ~{rows[0]['params'] / 1e6:.1f}M parameters, np={rows[0]['np']}")
    print(f"{'setup':>18} {'samples/s':>10} {'loss':>7} {'held out':>9} {'to target s':>12} "
          f"{'scaling':>8} {'MB/step':>8}")
    for r in rows:
        eff = "" if base is None else f"{r['samples_per_s'] / (r['np'] * base):.2f}"
        to = "" if r["to_target_s"] is None else f"{r['to_target_s']:.0f}"
        sent = "" if r["sent_per_step"] is None else f"{r['sent_per_step'] / 1e6:.2f}"
        print(f"{r['setup']:>18} {r['samples_per_s']:>10.1f} {r['loss']:>7.3f} "
              f"{r['held_out_loss']:>9.3f} {to:>12} {eff:>8} {sent:>8}")


def plot(path: str, runs: list[str], base: float | None) -> None:
    """Scaling efficiency and time to the target loss against the link, a line per setup;
    runs: LABEL=FILE.json or LABEL=FILE.json@ALONE.json (that run's own one-rank base, else
    `base`), in the order of the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, tables, bases = [], [], []
    for run in runs:
        label, _, files = run.partition("=")
        file, _, alone = files.partition("@")
        labels.append(label)
        with open(file) as f:
            tables.append({r["setup"]: r for r in json.load(f)})
        bases.append(one_rank(alone) if alone else base)
        if bases[-1] is None:
            raise SystemExit(f"--plot: {run}: no one-rank base (--baseline or @ALONE.json)")
    fig, (eff, tt) = plt.subplots(1, 2, figsize=(11, 4))
    for setup in dict.fromkeys(s for t in tables for s in t):
        rows = [t.get(setup) for t in tables]
        style = {"marker": "o", "linestyle": "--" if setup.startswith("gloo") else "-"}
        eff.plot(labels, [r["samples_per_s"] / (r["np"] * b) if r else np.nan
                          for r, b in zip(rows, bases)], label=setup, **style)
        tt.plot(labels, [r["to_target_s"] if r and r["to_target_s"] else np.nan for r in rows],
                label=setup, **style)
    eff.set_ylabel("scaling efficiency")
    tt.set_ylabel("seconds to the target loss")
    for ax in (eff, tt):
        ax.set_xlabel("link")
        ax.grid(True, alpha=0.3)
    eff.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def one_rank(path: str) -> float:
    """The samples/s of a one-rank run's JSON: a scaling's base."""
    with open(path) as f:
        return json.load(f)[0]["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", type=lambda s: s.split(","), help=f"default: {','.join(SETUPS)}")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of samples/s")
    p.add_argument("--window", type=int, default=5, help="steps the loss is averaged over")
    p.add_argument("--target", type=float, default=3.0, help="loss (nats per byte)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--freeze-step", type=int, default=10,
                   help="OnebitAdam's warm-up steps; the 1-bit DDP hook's too")
    p.add_argument("--data-mb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile each setup's model")
    p.add_argument("--baseline", help="JSON of a one-rank run: the scaling's base")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="draw LABEL=FILE.json runs (positional) to this PNG")
    p.add_argument("runs", nargs="*", help="with --plot: LABEL=FILE.json[@ALONE.json], one "
                   "per link (ALONE.json: that run's one-rank base, else --baseline's)")
    args = p.parse_args()
    base = one_rank(args.baseline) if args.baseline else None
    if args.plot:
        if not args.runs:
            p.error("--plot: needs LABEL=FILE.json runs")
        return plot(args.plot, args.runs, base)
    if args.steps < max(args.window, args.warmup + 1):
        p.error("--steps: must exceed --warmup and reach --window")
    import collectives as C

    torch.set_num_threads(1)
    C.init()
    setups = ["alone"] if C.size() == 1 else (args.setups or list(SETUPS))
    for s in setups:
        if s not in SETUPS and s != "alone" and not s.startswith("diloco-"):
            p.error(f"--setups: {s!r} is not one of {SETUPS}")
    data = corpus(args.data_mb)
    rows = []
    for setup in setups:
        rows.append(measure(setup, data, args))
        if C.rank() == 0:
            print(f"done {setup}", file=sys.stderr, flush=True)
    if C.rank() == 0:
        table(rows, base)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

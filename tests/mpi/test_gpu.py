"""The collectives on device memory: CuPy arrays and torch CUDA tensors, every algorithm, op
and dtype, in place and out of place, against the NumPy reference and against the same call
on host memory (the CUDA kernels that pack, quantize and compress on the device must give the
bits the C++ kernels give on the host). Also DistributedOptimizer, a DDP step on the
torch.distributed backend, and compression, on a CUDA model.

Skipped where no CUDA GPU is visible (CI has none); run on a GPU machine with
`ci/mpitest.sh 2 "" -k gpu`. Ranks share the GPUs round-robin by local rank."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import (
    DTYPES,
    OPS,
    assert_equal,
    assert_same_on_all_ranks,
    make_input,
    reference_reduce,
    rounding_bound,
    run_case,
)

import collectives as C
from collectives.algorithms.onebit import error_sizes

pytestmark = pytest.mark.mpi

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch: device-memory collectives need one",
                allow_module_level=True)
cupy = pytest.importorskip("cupy", reason="CuPy is not installed: the CUDA kernels run through it")

ALGOS = list(C.ALGORITHMS)
BIG = (1 << 20) + 3
FRAMEWORKS = ("cupy", "torch")


@pytest.fixture(scope="module", autouse=True)
def device():
    index = C.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    cupy.cuda.Device(index).use()
    return index


def counts(n: int) -> list[int]:
    return sorted({0, 1, n - 1, n + 1, 17, 1001}) + [BIG]


def on_device(a: np.ndarray, dtype: str, framework: str):
    """a (float64 for bfloat16) as a CuPy array or torch CUDA tensor of dtype."""
    if framework == "cupy":
        return cupy.asarray(a.astype(dtype))
    return torch.from_numpy(a.copy()).to(getattr(torch, dtype)).cuda()


def host(x) -> np.ndarray:
    """A device result as a NumPy array (float64 for bfloat16), for comparison."""
    if isinstance(x, torch.Tensor):
        assert x.is_cuda, f"result on {x.device}, expected the input's CUDA device"
        x = x.cpu()
        return x.double().numpy() if x.dtype == torch.bfloat16 else x.numpy()
    assert isinstance(x, cupy.ndarray), f"result is {type(x).__name__}, expected cupy.ndarray"
    return cupy.asnumpy(x)


def frameworks(dtype: str) -> tuple[str, ...]:
    return ("torch",) if dtype == "bfloat16" else FRAMEWORKS  # CuPy has no bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", [*ALGOS, "device"])
def test_gpu_allreduce(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for k, op in enumerate(OPS):
        for count in counts(n):
            for j, framework in enumerate(frameworks(dtype)):
                for inplace in (False, True) if count < BIG else ((k + j) % 2 == 0,):
                    what = f"allreduce {algo} {op.name} {dtype} ({count},) {framework} {inplace=}"
                    x = on_device(make_input(dtype, (count,), 7919 * k + 31 * count + r),
                                  dtype, framework)
                    fn = C.allreduce_ if inplace else C.allreduce
                    before, got = run_case(lambda t: fn(t, op=op, algorithm=algo), x,  # noqa: B023
                                           inplace, what, host)
                    assert_equal(got, reference_reduce(comm.allgather(before), op, dtype, n), what)
                    assert_same_on_all_ranks(comm, got, what)


def test_gpu_device_allreduce_stays_on_the_device(comm):
    """On one node, `auto` reduces 4 MiB of device data on the device (counted as
    allreduce/device, nothing staged through the host), in place and out, async, for torch
    and CuPy; host
    data under algorithm="device" is refused on every rank; a rank passing host data to
    the others' device call gets a MismatchError, as they do."""
    n, r = comm.Get_size(), comm.Get_rank()
    calls = lambda: C.stats()["per_op"].get("allreduce/device", {}).get("calls", 0)  # noqa: E731
    before = calls()
    for framework in FRAMEWORKS:
        x = on_device(np.full(BIG, r + 1, np.float32), "float32", framework)
        y = C.allreduce(x, op=C.Sum)
        assert_equal(host(y), np.full(BIG, n * (n + 1) / 2, np.float32), f"{framework} sum")
        assert_equal(host(x), np.full(BIG, r + 1, np.float32), f"{framework}: input modified")
        handle = C.allreduce_async_(x, op=C.Average)
        assert C.synchronize(handle) is x
        assert_equal(host(x), np.full(BIG, (n + 1) / 2, np.float32), f"{framework} async")
    assert calls() - before == 4, "auto staged device data through the host on one node"
    with pytest.raises(ValueError, match="algorithm: 'device' reduces device memory"):
        C.allreduce(np.ones(3, np.float32), algorithm="device")
    if n > 1:
        x = np.ones(BIG, np.float32) if r == 0 else torch.ones(BIG, device="cuda")
        with pytest.raises(C.MismatchError, match="allreduce memory mismatch"):
            C.allreduce(x, op=C.Sum)


def test_gpu_device_allreduce_with_a_joined_rank(comm):
    """The last rank joins; the others' device Averages divide by the ranks that are left
    and Sums see the joined rank's zeros."""
    n, r = comm.Get_size(), comm.Get_rank()
    if n < 2:
        pytest.skip("needs two ranks")
    if r == n - 1:
        C.join()
        return
    for op, expected in ((C.Sum, sum(range(1, n))), (C.Average, sum(range(1, n)) / (n - 1))):
        x = torch.full((1001,), float(r + 1), device="cuda")
        assert_equal(host(C.allreduce(x, op=op, algorithm="device")),
                     np.full(1001, expected, np.float32), f"{op.name} with rank {n - 1} joined")
    C.join()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ALGOS)
def test_gpu_allgather_reducescatter_broadcast(comm, algo, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    for count in counts(n):
        for framework in frameworks(dtype):
            rows = count + r % 2  # uneven allgather
            x = on_device(make_input(dtype, (rows,), 13 * count + r), dtype, framework)
            what = f"allgather {algo} {dtype} ({rows},) {framework}"
            before, got = run_case(lambda t: C.allgather(t, algorithm=algo), x, False, what,  # noqa: B023
                                   host)
            assert_equal(got, np.concatenate(comm.allgather(before)), what)

            x = on_device(make_input(dtype, (count,), 17 * count + r), dtype, framework)
            what = f"reducescatter {algo} {dtype} ({count},) {framework}"
            before, got = run_case(lambda t: C.reducescatter(t, op=C.Sum, algorithm=algo),  # noqa: B023
                                   x, False, what, host)
            full = reference_reduce(comm.allgather(before), C.Sum, dtype, n)
            split = [count // n + (1 if i < count % n else 0) for i in range(n)]
            assert_equal(got, full[sum(split[:r]):sum(split[:r + 1])], what)

            root = (count + 1) % n
            x = on_device(make_input(dtype, (count,), 19 * count + r), dtype, framework)
            what = f"broadcast {algo} root={root} {dtype} ({count},) {framework}"
            before, got = run_case(lambda t: C.broadcast_(t, root_rank=root, algorithm=algo),  # noqa: B023
                                   x, True, what, host)
            assert_equal(got, comm.allgather(before)[root], what)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_gpu_alltoall_grouped_and_async(comm, framework):
    n, r = comm.Get_size(), comm.Get_rank()
    splits = np.array([(r + j) % 3 for j in range(n)], dtype=np.int64)
    x = on_device(make_input("float32", (int(splits.sum()), 2), 23 + r), "float32", framework)
    got, received = C.alltoall(x, splits=splits)
    sent = comm.alltoall(np.split(host(x), np.cumsum(splits)[:-1]))
    assert_equal(host(got), np.concatenate(sent), f"alltoall {framework}")
    assert list(np.asarray(received)) == [len(s) for s in sent]

    for dtype in ("float32", "int32"):  # one dtype per group
        tensors = [on_device(make_input(dtype, (c,), 29 * c + r), dtype, framework)
                   for c in (5, 1001, 0, BIG)]
        befores = [host(t).copy() for t in tensors]
        outs = C.grouped_allreduce(tensors, op=C.Sum)
        for before, out, t in zip(befores, outs, tensors, strict=True):
            assert_equal(host(out), reference_reduce(comm.allgather(before), C.Sum, dtype, n),
                         f"grouped_allreduce {framework} {dtype} ({before.size},)")
            assert_equal(host(t), before, "grouped_allreduce modified its input")

    x = on_device(make_input("float32", (BIG,), 31 + r), "float32", framework)
    before = host(x).copy()
    handle = C.allreduce_async_(x, op=C.Max)
    assert C.synchronize(handle) is x
    assert_equal(host(x), reference_reduce(comm.allgather(before), C.Max, "float32", n),
                 f"allreduce_async_ {framework}")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_gpu_strided_views_are_read_and_written_back(comm, framework):
    """A strided device view: read through a contiguous copy, and the in-place result
    written back into the view alone."""
    n = comm.Get_size()
    start = np.arange(40, dtype=np.float32).reshape(8, 5)
    base = on_device(start, "float32", framework)
    view = base[:, ::2]
    expected = start[:, ::2] * n
    assert_equal(host(C.allreduce(view, op=C.Sum)), expected, f"{framework} strided")
    assert_equal(host(base), start, f"{framework} strided: input modified")
    assert C.allreduce_(view, op=C.Sum) is view
    assert_equal(host(base)[:, ::2], expected, f"{framework} strided, in place")
    assert_equal(host(base)[:, 1::2], start[:, 1::2], f"{framework}: beside the view")
    scalar = on_device(np.array(2.5, np.float32), "float32", framework)
    assert float(host(C.allreduce(scalar, op=C.Sum))) == 2.5 * n


def no_full_staging(monkeypatch) -> None:
    """Make staging a whole device buffer through pinned host memory fail: compressed device
    data must stage only what travels."""
    from collectives.runtime import buffers

    def refuse(*args, **kwargs):
        raise AssertionError("a device buffer was staged whole through the host")

    monkeypatch.setattr(buffers, "_pinned_like", refuse)


@pytest.mark.parametrize("compression", ["fp16", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_compression_gives_the_host_bits(comm, compression, dtype, monkeypatch):
    """Quantized on the device by the CUDA kernels (only the compressed values staged), on
    the host by the C++ kernels: the same bits, on every rank, in place and out."""
    g = torch.Generator().manual_seed(37 + comm.Get_rank())
    for count in (1, 1000, BIG):
        x = torch.randn(count, generator=g).to(getattr(torch, dtype))
        kind = getattr(C.Compression, compression)
        on_host = C.allreduce(x, op=C.Average, compression=kind)
        with monkeypatch.context() as m:
            no_full_staging(m)
            on_gpu = C.allreduce(x.cuda(), op=C.Average, compression=kind)
            inplace = x.cuda()
            assert C.allreduce_(inplace, op=C.Average, compression=kind) is inplace
        assert torch.equal(inplace.cpu(), on_host), f"{compression} {dtype} in place"
        what = f"{compression} {dtype} ({count},)"
        assert on_gpu.is_cuda and on_gpu.dtype == x.dtype, what
        assert torch.equal(on_gpu.cpu(), on_host), f"{what}: device and host bits differ"
        assert_same_on_all_ranks(comm, on_gpu.cpu().view(torch.uint8).numpy(), what)


def test_gpu_onebit_gives_the_host_bits(comm, monkeypatch):
    """The 1-bit compressed allreduce with error feedback, on CUDA tensors and CUDA error
    buffers (compressed, served and decompressed on the device, only the packets staged),
    over three calls: the host's bits, and both error buffers updated in place."""
    n = comm.Get_size()
    g = torch.Generator().manual_seed(41 + comm.Get_rank())
    count = 300001
    worker, server = error_sizes(count, n)
    errors = {dev: (torch.zeros(worker, device=dev), torch.zeros(server, device=dev))
              for dev in ("cpu", "cuda")}
    for step in range(3):
        x = torch.randn(count, generator=g)
        out = {"cpu": C.compressed_allreduce(x, *errors["cpu"])}
        with monkeypatch.context() as m:
            no_full_staging(m)
            out["cuda"] = C.compressed_allreduce(x.cuda(), *errors["cuda"])
        assert out["cuda"].is_cuda
        assert torch.equal(out["cuda"].cpu(), out["cpu"]), f"step {step}: results differ"
        for a, b in zip(errors["cuda"], errors["cpu"], strict=True):
            assert torch.equal(a.cpu(), b), f"step {step}: error buffers differ"
        assert bool(errors["cpu"][0].abs().sum() > 0), "error feedback never written"


def test_gpu_onebit_hook_on_cuda_buckets_gives_the_host_bits(comm, monkeypatch):
    """The DDP onebit hook on a CUDA bucket on our backend: the bits of the same steps on a
    CPU bucket (compressed_allreduce on the device, only the packets staged), error buffers
    that stay CUDA tensors, in the hook's state_dict too."""
    import torch.distributed as dist
    from test_ddp_hooks import _Bucket

    from collectives.integrations.ddp_hooks import OnebitHookState, onebit_hook

    dist.init_process_group("collectives")
    try:
        states = {dev: OnebitHookState(warmup_steps=1, block_size=32) for dev in ("cpu", "cuda")}
        g = torch.Generator().manual_seed(53 + comm.Get_rank())
        for step in range(4):
            x = torch.randn(300001, generator=g)
            got = {"cpu": onebit_hook(states["cpu"], _Bucket(x.clone())).wait()}
            with monkeypatch.context() as m:
                if step >= 1:  # after the warm-up step, which is a plain average
                    no_full_staging(m)
                got["cuda"] = onebit_hook(states["cuda"], _Bucket(x.cuda())).wait()
            assert got["cuda"].is_cuda, f"step {step}"
            if step == 0:  # a plain average: its sum's order is the algorithm's auto picks,
                # so each result lies within u x the terms' size of the exact mean (the sum's
                # roundings, and the division's), and the two within twice that
                terms = torch.from_numpy(comm.allreduce(x.abs().numpy()))
                bound = rounding_bound(torch.float32, 2 * comm.Get_size(), terms / comm.Get_size())
                diff = (got["cuda"].cpu() - got["cpu"]).abs()
                assert bool((diff <= bound).all()), f"step 0: off by {float((diff - bound).max())}"
            else:
                assert torch.equal(got["cuda"].cpu(), got["cpu"]), f"step {step}"
        for w_gpu, w_cpu in zip(states["cuda"].errors[0][1:], states["cpu"].errors[0][1:],
                                strict=True):
            assert w_gpu.is_cuda and torch.equal(w_gpu.cpu(), w_cpu)
        saved = states["cuda"].state_dict()["errors"][0]
        assert saved[1].is_cuda and torch.equal(saved[1], states["cuda"].errors[0][1])
    finally:
        dist.destroy_process_group()


def _sgd_steps(comm, device: str, algorithm: str, steps: int = 3) -> list[torch.Tensor]:
    """DistributedOptimizer(SGD) on device, gradients set to rank-dependent values: the
    parameters after each step. lr 1 and no momentum: the update p - g is one correctly
    rounded subtraction on either device, so any difference is the library's."""
    from collectives.optim import DistributedOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(device))
              for shape in ((300, 7), (7,), (BIG,), (1,))]
    opt = DistributedOptimizer(torch.optim.SGD(params, lr=1.0), algorithm=algorithm)
    g = torch.Generator().manual_seed(43 + comm.Get_rank())
    history = []
    for _ in range(steps):
        opt.zero_grad()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in params]).cpu())
    return history


def test_gpu_distributed_optimizer_gives_the_host_bits(comm):
    """Gradients fused into buckets by the CUDA pack kernel and averaged on the device (the
    4 MiB bucket is priced for the device algorithm): the same parameters, bit for bit, as
    the same steps on the host under shm, which adds in rank order as the device fold does
    (from 3 ranks, another order, such as ring's, may give other bits), on every rank."""
    for step, (gpu, cpu) in enumerate(zip(_sgd_steps(comm, "cuda", "auto"),
                                          _sgd_steps(comm, "cpu", "shm"), strict=True)):
        assert torch.equal(gpu, cpu), f"step {step}: {int((gpu != cpu).sum())} values differ"
        assert_same_on_all_ranks(comm, gpu.numpy(), f"step {step}")


def test_gpu_ddp_step_on_the_torch_backend(comm):
    """DDP over a CUDA model on the `collectives` process group: every rank's gradients are
    the average of the ranks' own, and all_reduce / all_gather take CUDA tensors."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n, r = comm.Get_size(), comm.Get_rank()
    dist.init_process_group("collectives")
    try:
        t = torch.arange(5, dtype=torch.int64, device="cuda") * (r + 1)
        dist.all_reduce(t)
        assert t.is_cuda and t.tolist() == [i * n * (n + 1) // 2 for i in range(5)]
        parts = [torch.empty(3, device="cuda") for _ in range(n)]
        dist.all_gather(parts, torch.full((3,), float(r), device="cuda"))
        assert [p.tolist() for p in parts] == [[float(j)] * 3 for j in range(n)]

        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 3)).cuda()
        model = DDP(copy.deepcopy(plain), device_ids=[torch.cuda.current_device()])
        g = torch.Generator().manual_seed(47 + r)
        x, y = torch.randn(16, 20, generator=g).cuda(), torch.randint(0, 3, (16,), generator=g).cuda()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            mine = q.grad.double().cpu().numpy()
            expected = sum(comm.allgather(mine)) / n
            np.testing.assert_allclose(p.grad.double().cpu().numpy(), expected, rtol=1e-5,
                                       atol=1e-6)
            assert_same_on_all_ranks(comm, p.grad.cpu().numpy(), "DDP gradient")
    finally:
        dist.destroy_process_group()


def test_gpu_fsdp2_on_the_torch_backend(comm):
    """FSDP2's fully_shard over a CUDA model on the `collectives` process group: three SGD
    steps on each rank's part of the batch give the weights of one process on the whole
    batch on the CPU (torch before 2.13 gathers through the group's _allgather_base)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    n, r = comm.Get_size(), comm.Get_rank()
    dist.init_process_group("collectives")
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                  torch.nn.Linear(16, 4))
        ref = copy.deepcopy(net)
        net.cuda()
        fully_shard(net[0])
        fully_shard(net)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 4, generator=g)
            mine = slice(4 * r, 4 * r + 4)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[mine].cuda()), y[mine].cuda()).backward()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            whole = p.full_tensor().detach()
            assert whole.is_cuda
            torch.testing.assert_close(whole.cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()

"""Adapters from NumPy arrays, torch tensors and CuPy arrays to the flat host buffers the
algorithms work on, and back to the caller's type, device, dtype and shape.

Contiguous host input is viewed, never copied. Non-contiguous input is copied (and, for
in-place calls, the result is copied back). Device memory (torch CUDA, CuPy) is staged
through page-locked host memory (torch's and CuPy's caching pinned allocators): the
algorithms hand only host buffers to MPI, and a staging copy runs at the bus's speed with no
page faults (pageable memory, fresh each call, adds page faults and the driver's own bounce
copy to every transfer; benchmarks/README.md, GPU, has the staged call's times)."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from collectives import config
from collectives.dtypes import NAMES, NUMPY_NAMES, STORAGE, loaded_torch, torch_dtype_name
from collectives.kernels import _C

try:
    import cupy
    import cupyx
except ImportError:
    cupy = cupyx = None


class Buffer:
    """A caller's array seen as one C-contiguous 1-D host array (`flat`).

    `dtype` is our dtype name; `flat` holds its storage type (bfloat16 as uint16)."""

    __slots__ = ("orig", "kind", "flat", "dtype", "shape", "staged", "pinned")

    def __init__(self, orig: Any, kind: str, flat: np.ndarray, dtype: str, shape: tuple,
                 staged: bool, pinned: Any = None):
        self.orig, self.kind, self.flat = orig, kind, flat
        self.dtype, self.shape, self.staged = dtype, shape, staged
        # device data's page-locked host copy, which flat views (a torch CPU tensor or a
        # NumPy array), None for host data; orig then gives the device, dtype and shape
        self.pinned = pinned

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def empty(self, shape: tuple) -> Buffer:
        """A new buffer of the caller's kind, dtype and device with this shape (host memory
        from the result pool: host_empty). For device data, a pinned host buffer whose
        result() makes the device array: nothing is copied to the host first."""
        if self.pinned is not None:
            return _pinned_like(self.orig, self.kind, self.dtype, tuple(shape))
        if self.kind == "numpy":
            return wrap(host_empty(shape, self.flat.dtype), "out")
        if self.kind == "torch":
            import torch

            if not self.orig.is_cpu:
                return wrap(torch.empty(shape, dtype=self.orig.dtype, device=self.orig.device),
                            "out")
            host = host_empty(shape, self.flat.dtype)  # its flat view is ours: no wrap()
            t = torch.from_numpy(host)
            return Buffer(t.view(torch.bfloat16) if self.dtype == "bfloat16" else t, "torch",
                          host.reshape(-1), self.dtype, tuple(shape), False)
        return wrap(cupy.empty(shape, dtype=self.orig.dtype), "out")

    def result(self) -> Any:
        """The caller-type object holding this buffer's data (device data written back)."""
        if not self.staged:
            return self.orig
        if self.pinned is not None:
            if self.kind == "torch":
                import torch

                out = torch.empty(self.shape, dtype=self.orig.dtype, device=self.orig.device)
                return out.copy_(self.pinned.view(self.shape))
            with self.orig.device:
                out = cupy.empty(self.shape, dtype=self.orig.dtype)
                out.set(self.pinned.reshape(self.shape))
                return out
        data = self.flat.reshape(self.shape)
        if self.kind == "numpy":
            return data
        if self.kind == "torch":
            import torch

            host = torch.from_numpy(data)
            if self.dtype == "bfloat16":
                host = host.view(torch.bfloat16)
            return host.to(self.orig.device)
        return cupy.asarray(data)

    def result_from(self, out: Buffer) -> Any:
        """The caller's result of a call on this buffer whose output is out: the caller's
        own object for an in-place call (out is self: staged data written back into it),
        else out's."""
        if out is self:
            self.write_back()
            return self.orig
        return out.result()

    def write_back(self) -> None:
        """Copy a staged buffer's data into the caller's original object (in-place calls)."""
        if not self.staged:
            return
        if self.pinned is not None and self.kind == "torch":
            import torch

            with torch.no_grad():
                self.orig.copy_(self.pinned.view(self.shape))
        elif self.pinned is not None and self.orig.flags.c_contiguous:
            with self.orig.device:
                self.orig.set(self.pinned.reshape(self.shape))
        elif self.pinned is not None:
            self.orig[...] = self.result()
        elif self.kind == "numpy":
            self.orig[...] = self.flat.reshape(self.shape)
        elif self.kind == "torch":
            import torch

            with torch.no_grad():
                self.orig.copy_(self.result())
        else:
            self.orig[...] = cupy.asarray(self.flat.reshape(self.shape))


#: Host results of at least this many bytes come from the result pool.
POOL_MIN_BYTES = 256 << 10


def host_empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """An uninitialized host array for a collective's result. From POOL_MIN_BYTES up its
    memory comes from the result pool (csrc/runtime/pool.h): a block of the same size
    dropped by an earlier result, already faulted in, instead of fresh pages whose first
    touch costs a fault and the kernel's zeroing each (a quarter of a 64 MiB alltoall).
    Smaller ones come from malloc, which reuses them by itself."""
    count = math.prod(shape)
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes < POOL_MIN_BYTES:
        return np.empty(shape, dtype)
    if not _pool_ready:
        _make_pool()
    return np.frombuffer(_C.pooled(nbytes), dtype, count).reshape(shape)


_pool_ready = False


def _make_pool() -> None:
    global _pool_ready
    _C.set_pool_capacity(config.get().result_pool_bytes)
    _pool_ready = True


def host_float(flat: np.ndarray, dtype: str) -> np.ndarray:
    """The values of flat storage of a floating dtype as a host array: the storage itself
    for float16, float32 and float64; bfloat16 widened to float32 (exact: it is float32's
    top half)."""
    if dtype != "bfloat16":
        return flat
    return (flat.astype(np.uint32) << 16).view(np.float32)


def store_float(flat: np.ndarray, dtype: str, values: np.ndarray) -> None:
    """flat (storage of a floating dtype) = values rounded to dtype (to nearest even)."""
    if dtype == "bfloat16":  # only a torch tensor's storage: torch is imported
        import torch

        flat[...] = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    else:
        flat[...] = values


def _unsupported(name: str, what: str) -> TypeError:
    return TypeError(f"{name}: unsupported {what}; expected one of {list(NAMES)}")


def _stageable(name: str, x: Any, nbytes: int) -> None:
    """ValueError naming `name` where a copy of x (a non-contiguous view: broadcast or
    expanded, whose elements may share memory) would not fit in this machine's memory: the
    copy would fail deep in NumPy or torch, or push the machine into swap."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > memory:
        raise ValueError(f"{name}: a non-contiguous view of {nbytes / 2**30:.1f} GiB (shape "
                         f"{tuple(x.shape)}); it is copied to be sent, and this machine has "
                         f"{memory / 2**30:.1f} GiB: pass a contiguous array of what you "
                         "mean to reduce")


def wrap(x: Any, name: str = "x") -> Buffer:
    """View x as a Buffer, or TypeError naming `name` if x is not a supported array
    (ValueError where a non-contiguous x could not be copied)."""
    if isinstance(x, np.ndarray):
        dtype = NUMPY_NAMES.get(x.dtype)
        if dtype is None:
            raise _unsupported(name, f"dtype {x.dtype}")
        contiguous = x.flags.c_contiguous
        if not contiguous:
            _stageable(name, x, x.nbytes)
        flat = x.reshape(-1) if contiguous else np.ascontiguousarray(x).reshape(-1)
        return Buffer(x, "numpy", flat, dtype, x.shape, not contiguous)
    torch = loaded_torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense tensor, got layout {x.layout}; pass "
                            f"{name}.to_dense(), or reduce a sparse gradient with "
                            "collectives.horovod.sparse_allreduce")
        dtype = torch_dtype_name(x.dtype)
        if dtype is None:
            raise _unsupported(name, f"dtype {x.dtype}")
        t = x.detach() if x.requires_grad else x
        contiguous = t.is_contiguous()
        if t.is_cpu and contiguous and dtype != "bfloat16":  # a view (the common case)
            return Buffer(x, "torch", t.numpy().reshape(-1), dtype, tuple(x.shape), False)
        if not contiguous:
            _stageable(name, x, x.numel() * x.element_size())
        if t.device.type == "cuda":
            buf = _pinned_like(x, "torch", dtype, tuple(x.shape))
            buf.pinned.copy_(t)  # waits for the copy: the algorithms read it next
            return buf
        staged = not contiguous or t.device.type != "cpu"
        t = t.contiguous().cpu().reshape(-1)
        if dtype == "bfloat16":
            t = t.view(torch.int16)
        flat = t.numpy().view(STORAGE[dtype])
        return Buffer(x, "torch", flat, dtype, tuple(x.shape), staged)
    if cupy is not None and isinstance(x, cupy.ndarray):
        dtype = NUMPY_NAMES.get(np.dtype(x.dtype))
        if dtype is None:
            raise _unsupported(name, f"dtype {x.dtype}")
        buf = _pinned_like(x, "cupy", dtype, x.shape)
        # (cupy.ascontiguousarray makes a 0-d array 1-d: only strided arrays go through it)
        (x if x.flags.c_contiguous else cupy.ascontiguousarray(x)).get(out=buf.pinned)
        return buf
    raise TypeError(
        f"{name}: expected a numpy.ndarray, torch.Tensor or cupy.ndarray, got {type(x).__name__}"
    )


def is_device_data(x: Any) -> bool:
    """A torch CUDA tensor or a CuPy array."""
    module = type(x).__module__
    return module.startswith("cupy") or module.startswith("torch") and \
        getattr(getattr(x, "device", None), "type", None) == "cuda"


def to_host(x: Any) -> np.ndarray:
    """A host copy of a CuPy array's bytes (x itself for a NumPy array): how compressed
    device data is staged, only what travels (compression/)."""
    if isinstance(x, np.ndarray):
        return x
    return cupy.asnumpy(x)


def to_device(host: np.ndarray, like: Any) -> Any:
    """host on like's device as a CuPy array (host itself where like is a NumPy array)."""
    if isinstance(like, np.ndarray):
        return host
    with like.device:
        return cupy.asarray(host)


def _pinned_like(like: Any, kind: str, dtype: str, shape: tuple) -> Buffer:
    """A staged Buffer for device data of like's kind, dtype and device with this shape: an
    uninitialized page-locked host array, flat viewing it."""
    if kind == "torch":
        import torch

        host = torch.empty(shape, dtype=like.dtype, pin_memory=True)
        view = host.view(torch.int16) if dtype == "bfloat16" else host
        flat = view.reshape(-1).numpy().view(STORAGE[dtype])
        return Buffer(like, kind, flat, dtype, shape, True, host)
    host = cupyx.empty_pinned(shape, dtype=like.dtype)
    return Buffer(like, kind, host.reshape(-1), dtype, shape, True, host)

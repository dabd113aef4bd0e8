"""Binary -> launchable kernel: a cubin through ``cupy.RawModule``, a CPU library through ctypes.

Kernels take typed arguments ``(kind, value)`` with kind ``"ptr" | "i32" | "i64" | "f32"``, so one
argument list (built in api.py) serves both backends.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .render import RenderedSource

_NUMPY = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "f32": np.float32}
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_longlong,
           "f32": ctypes.c_float}
_STREAMS: dict = {}


@dataclass
class CudaKernel:
    """A loaded CUDA kernel and its launch shape (threads, dynamic shared memory, rows/CTA)."""

    function: object          # cupy.RawKernel
    module: object            # cupy.RawModule, kept alive with the function
    threads: int
    smem_bytes: int
    rows_per_cta: int
    kind: str

    def launch(self, grid: tuple, args: list, stream_ptr: int, device_index: int) -> None:
        """Launch on the CUDA stream ``stream_ptr`` (torch's current stream); no sync."""
        import cupy
        stream = _STREAMS.get((stream_ptr, device_index))
        if stream is None:
            stream = _STREAMS[(stream_ptr, device_index)] = cupy.cuda.ExternalStream(
                stream_ptr, device_index)
        packed = tuple(_NUMPY[k](v) for k, v in args)
        with cupy.cuda.Device(device_index), stream:
            self.function(grid, (self.threads,), packed, shared_mem=self.smem_bytes)


@dataclass
class CpuKernel:
    """The CPU backend's library: one entry point per dtype tag."""

    library: ctypes.CDLL
    entries: dict             # dtype tag -> ctypes function

    def launch(self, dtype_tag: str, args: list) -> None:
        fn = self.entries[dtype_tag]
        rc = fn(*(_CTYPES[k](v) for k, v in args))
        if rc != 0:
            raise RuntimeError(f"jitattn CPU kernel returned {rc}")


def load_cuda(path: Path, src: RenderedSource, device_index: int) -> CudaKernel:
    """Load a cubin on device ``device_index`` and raise its shared-memory limit if needed."""
    import cupy
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(path=str(path))
        function = module.get_function(src.entries[0])
        smem = src.tiles.smem_bytes(src.kind, src.head_dim)
        if smem > 48 * 1024:
            function.max_dynamic_shared_size_bytes = smem
    return CudaKernel(function, module, threads=32 * src.tiles.num_warps, smem_bytes=smem,
                      rows_per_cta=src.tiles.rows_per_cta(src.kind), kind=src.kind)


def load_cpu(path: Path, src: RenderedSource) -> CpuKernel:
    library = ctypes.CDLL(str(path))
    entries = {}
    for name in src.entries:
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        entries[name.rsplit("_", 1)[-1]] = fn
    return CpuKernel(library, entries)

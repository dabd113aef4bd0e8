"""Binary -> launchable kernel: a cubin through ``cupy.RawModule``, a CPU library through ctypes.

Kernels take typed arguments ``(kind, value)`` with kind ``"ptr" | "i32" | "i64" | "f32"``, so one
argument list (built in api.py) serves both backends.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path

from .render import RenderedSource

_STRUCT = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f"}
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_longlong,
           "f32": ctypes.c_float}


class _ParamBuffer:
    """Kernel arguments packed in place for cuLaunchKernel: one buffer laid out with C
    alignment, and the array of pointers into it. Built once per argument signature, so a launch
    costs one struct.pack_into."""

    def __init__(self, kinds: tuple):
        self.kinds = kinds
        self.format = "@" + "".join(_STRUCT[k] for k in kinds)
        self.buffer = ctypes.create_string_buffer(max(8, struct.calcsize(self.format)))
        base = ctypes.addressof(self.buffer)
        offsets, fmt = [], "@"
        for k in kinds:
            fmt += _STRUCT[k]
            offsets.append(struct.calcsize(fmt) - struct.calcsize("@" + _STRUCT[k]))
        self.pointers = (ctypes.c_void_p * len(kinds))(*(base + o for o in offsets))
        self.address = ctypes.addressof(self.pointers)

    def pack(self, values) -> int:
        struct.pack_into(self.format, self.buffer, 0, *values)
        return self.address


@dataclass
class CudaKernel:
    """A loaded CUDA kernel and its launch shape (threads, dynamic shared memory, rows/CTA)."""

    function: object          # cupy.RawKernel
    module: object            # cupy.RawModule, kept alive with the function
    threads: int
    smem_bytes: int
    rows_per_cta: int
    kind: str
    _params: _ParamBuffer | None = None

    def launch(self, grid: tuple, args: list, stream_ptr: int) -> None:
        """Launch on the CUDA stream ``stream_ptr`` (torch's current stream); no sync.
        ``args`` are ``(kind, value)`` pairs; the caller makes the kernel's device current."""
        from cupy.cuda import driver
        kinds = tuple(k for k, _ in args)
        if self._params is None or self._params.kinds != kinds:
            self._params = _ParamBuffer(kinds)
        params = self._params.pack([v for _, v in args])
        driver.launchKernel(self.function.kernel.ptr, grid[0], grid[1], grid[2], self.threads,
                            1, 1, self.smem_bytes, stream_ptr, params, 0)


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
        function.kernel  # load the module now, not at the first launch
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

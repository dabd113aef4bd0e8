"""Binary -> launchable kernel: a cubin through the CUDA driver API (ctypes on libcuda), a CPU
library through ctypes. (The first design named cupy.RawModule; importing CuPy alone costs
100-400 ms, more than the whole warm-load budget, so the driver is called directly. CuPy
remains the NVRTC fallback when nvcc is missing.)

Kernels take their arguments as a tuple of kinds (``"ptr" | "i32" | "i64" | "f32"``, and for
CUDA kernels ``"tmaps"``: two TMA tensor maps, 256 bytes) and a list of values, so one argument
list (built in launch.py) serves both backends.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from .render import RenderedSource

_STRUCT = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f", "tmaps": "256s"}
_ALIGN = {"ptr": 8, "i32": 4, "i64": 8, "f32": 4, "tmaps": 64}  # as the kernel's parameters
_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_longlong,
           "f32": ctypes.c_float}


class BadBinary(OSError):
    """A kernel binary that does not load as one (not an image, for another GPU, without its
    entry point): jit rebuilds a cached one. Errors of the device or the driver are not."""


# cuModuleLoad's codes for a file that is not a usable image: INVALID_IMAGE, NO_BINARY_FOR_GPU,
# INVALID_PTX, FILE_NOT_FOUND; cuModuleGetFunction's NOT_FOUND
_BAD_IMAGE = (200, 209, 218, 301)
_NOT_FOUND = (500,)


class _ParamBuffer:
    """Kernel arguments packed in place for cuLaunchKernel: one buffer laid out with C
    alignment, and the array of pointers into it. Built once per argument signature, so a launch
    costs one struct.pack_into."""

    def __init__(self, kinds: tuple):
        self.kinds = kinds
        offsets, fmt, size = [], "=", 0  # standard sizes, the alignment padding spelled out
        for k in kinds:
            pad = -size % _ALIGN[k]
            fmt += f"{pad}x{_STRUCT[k]}" if pad else _STRUCT[k]
            offsets.append(size + pad)
            size += pad + struct.calcsize("=" + _STRUCT[k])
        self.format = fmt
        self.buffer = ctypes.create_string_buffer(max(8, size) + 64)
        self.start = -ctypes.addressof(self.buffer) % 64  # a 64-byte aligned start
        base = ctypes.addressof(self.buffer) + self.start
        self.pointers = (ctypes.c_void_p * len(kinds))(*(base + o for o in offsets))
        self.address = ctypes.addressof(self.pointers)

    def pack(self, values) -> int:
        struct.pack_into(self.format, self.buffer, self.start, *values)
        return self.address


# cuda.h's CUtensorMapDataType, CUtensorMapSwizzle and CUtensorMapL2promotion values
TMA_FLOAT16, TMA_BFLOAT16 = 6, 9
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3


class _Driver:
    """The few CUDA driver API calls jitattn needs, through ctypes on libcuda. Modules are loaded
    into the device's primary context, the one PyTorch's runtime uses."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        sig = {"cuInit": [u], "cuDeviceGet": [ctypes.POINTER(i), i],
               "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), i],
               "cuCtxGetCurrent": [ctypes.POINTER(vp)], "cuCtxPushCurrent_v2": [vp],
               "cuCtxPopCurrent_v2": [ctypes.POINTER(vp)],
               "cuModuleLoad": [ctypes.POINTER(vp), ctypes.c_char_p],
               "cuModuleGetFunction": [ctypes.POINTER(vp), vp, ctypes.c_char_p],
               "cuFuncSetAttribute": [vp, i, i],
               "cuLaunchKernel": [vp, u, u, u, u, u, u, u, vp, vp, vp],
               "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
               "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(i), vp, i,
                                                               ctypes.c_size_t],
               "cuTensorMapEncodeTiled": [vp, i, u, vp, vp, vp, vp, vp, i, i, i, i]}
        for name, argtypes in sig.items():
            if name == "cuTensorMapEncodeTiled" and not hasattr(lib, name):
                continue  # drivers before CUDA 12: no TMA maps (encode_tiled gives None)
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = i
        self.lib = lib
        self.check(lib.cuInit(0), "cuInit")
        self.contexts: dict = {}
        # launch(): cuLaunchKernel without argtypes (its arguments come as ctypes values,
        # built once per launch shape)
        self._launch_raw = lib["cuLaunchKernel"]

    def check(self, rc: int, what: str, bad_binary: tuple = ()) -> None:
        """RuntimeError for a failed driver call; BadBinary for the codes in ``bad_binary``."""
        if rc != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            error = BadBinary if rc in bad_binary else RuntimeError
            raise error(f"{what} failed: CUDA error {rc} "
                        f"({(msg.value or b'unknown').decode()})")

    def primary_context(self, device_index: int) -> int:
        ctx = self.contexts.get(device_index)
        if ctx is None:
            dev, handle = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), dev),
                       "cuDevicePrimaryCtxRetain")
            ctx = self.contexts[device_index] = handle.value
        return ctx

    def call_in_context(self, device_index: int, fn, *args):
        """fn(*args) with the device's primary context current, restoring the caller's after."""
        ctx = self.contexts.get(device_index) or self.primary_context(device_index)
        current = ctypes.c_void_p()
        self.lib.cuCtxGetCurrent(ctypes.byref(current))
        if current.value == ctx:
            return fn(*args)
        self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            return fn(*args)
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(current))

    def launch_args(self, function: int, grid: tuple, threads: int, smem_bytes: int,
                    stream_ptr: int, params: int) -> tuple:
        """cuLaunchKernel's arguments as ctypes values, for launch()."""
        u, vp = ctypes.c_uint, ctypes.c_void_p
        return (vp(function), u(grid[0]), u(grid[1]), u(grid[2]), u(threads), u(1), u(1),
                u(smem_bytes), vp(stream_ptr), vp(params), None)

    def launch(self, device_index: int, args: tuple) -> int:
        """cuLaunchKernel(*args) (args from launch_args) in the device's primary context; the
        CUDA result code."""
        return self.call_in_context(device_index, self._launch_raw, *args)

    def encode_tiled(self, data_type: int, address: int, dims: tuple, strides: tuple,
                     box: tuple) -> bytes | None:
        """A TMA tensor map (CUtensorMap, 128 bytes) of the tensor at ``address``: ``dims``
        innermost first, ``strides`` in bytes of dims 1.. , boxes of ``box`` elements, no
        interleave, 128-byte swizzle, L2 promotion of 256 bytes, zero fill out of bounds;
        None where the driver refuses it (addresses or strides TMA cannot take) or has no TMA
        (before CUDA 12)."""
        if not hasattr(self.lib, "cuTensorMapEncodeTiled"):
            return None
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        rank = len(dims)
        out = ctypes.create_string_buffer(128 + 64)
        at = ctypes.addressof(out) + (-ctypes.addressof(out) % 64)
        rc = self.lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(at), data_type, rank, ctypes.c_void_p(address),
            (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box),
            (u32 * rank)(*([1] * rank)), 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
        return ctypes.string_at(at, 128) if rc == 0 else None


_DRIVER: _Driver | None = None


def _driver() -> _Driver:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@dataclass
class CudaKernel:
    """A loaded CUDA kernel (a CUfunction) and its launch shape."""

    function: int             # CUfunction handle
    device_index: int
    threads: int
    smem_bytes: int
    rows_per_cta: int
    kind: str
    kv_tile: int = 0          # keys per K/V tile (0: the merge kernel)
    tma: bool = False         # wgmma: takes kv_tma and TMA maps of k and v last (launch.py)
    _params: _ParamBuffer | None = None
    _launch: tuple = (None, ())  # ((grid, stream, params), cuLaunchKernel's ctypes arguments)

    def resident_ctas_per_sm(self) -> int:
        """How many CTAs of this kernel one SM holds at once (occupancy)."""
        drv, n = _driver(), ctypes.c_int()
        drv.check(drv.call_in_context(self.device_index, lambda: drv.lib.
                                      cuOccupancyMaxActiveBlocksPerMultiprocessor(
                                          ctypes.byref(n), self.function, self.threads,
                                          self.smem_bytes)), "cuOccupancyMaxActiveBlocks")
        return max(1, n.value)

    def launch(self, grid: tuple, kinds: tuple, values: list, stream_ptr: int) -> None:
        """Launch on the CUDA stream ``stream_ptr`` (torch's current stream); no sync.
        ``kinds`` and ``values`` match the kernel's signature."""
        if self._params is None or (self._params.kinds is not kinds and
                                    self._params.kinds != kinds):
            self._params = _ParamBuffer(kinds)
        params = self._params.pack(values)
        drv = _driver()
        key, args = self._launch  # (one tuple: a pair another thread wrote stays a pair)
        if key != (grid, stream_ptr, params):  # (one plan's launches repeat it)
            args = drv.launch_args(self.function, grid, self.threads, self.smem_bytes,
                                   stream_ptr, params)
            self._launch = ((grid, stream_ptr, params), args)
        rc = drv.launch(self.device_index, args)
        if rc != 0:
            drv.check(rc, f"cuLaunchKernel (grid {grid}, {self.threads} threads, "
                          f"{self.smem_bytes} B shared memory)")


@dataclass
class CpuKernel:
    """The CPU backend's library: one entry point per dtype tag."""

    library: ctypes.CDLL
    entries: dict             # symbol name -> ctypes function

    def launch(self, entry: str, kinds: tuple, values: list) -> None:
        """Call entry point ``entry`` (its full symbol name) with arguments of ``kinds``."""
        fn = self.entries[entry]
        if getattr(fn, "kinds", None) is not kinds:  # ctypes converts by argtypes
            fn.argtypes = [_CTYPES[k] for k in kinds]
            fn.kinds = kinds
        rc = fn(*values)
        if rc != 0:
            raise RuntimeError(f"jitattn CPU kernel returned {rc}")


def load_cuda(path: Path, src: RenderedSource, device_index: int) -> CudaKernel:
    """Load a cubin into device ``device_index``'s primary context; raise the kernel's dynamic
    shared-memory limit when it needs more than the default 48 KiB."""
    drv = _driver()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    smem = src.smem_bytes()

    def load():
        drv.check(drv.lib.cuModuleLoad(ctypes.byref(module), str(path).encode()),
                  f"cuModuleLoad({path})", bad_binary=_BAD_IMAGE)
        drv.check(drv.lib.cuModuleGetFunction(ctypes.byref(function), module,
                                              src.entries[0].encode()), "cuModuleGetFunction",
                  bad_binary=_NOT_FOUND)
        if smem > 48 * 1024:
            drv.check(drv.lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, smem),
                      f"cuFuncSetAttribute(max dynamic shared memory = {smem} B)")
    drv.call_in_context(device_index, load)
    if src.tiles is None:  # merge: 4 warps, one output row per warp
        return CudaKernel(function.value, device_index, threads=128, smem_bytes=0,
                          rows_per_cta=4, kind=src.kind)
    return CudaKernel(function.value, device_index, threads=32 * src.tiles.num_warps,
                      smem_bytes=smem, rows_per_cta=src.tiles.rows_per_cta(src.kind),
                      kind=src.kind, kv_tile=src.tiles.kv_tile, tma=src.tma)


def tensor_map(data_type: int, address: int, dims: tuple, strides: tuple,
               box: tuple) -> bytes | None:
    """A TMA tensor map through the driver (_Driver.encode_tiled), or None."""
    return _driver().encode_tiled(data_type, address, dims, strides, box)


def _elf_truncated(data: bytes) -> str | None:
    """Why a 64-bit little-endian ELF image (the CPU backend's library on x86-64 / aarch64
    Linux) is shorter than its own headers say, else None (other formats are left to the
    loader). dlopen maps a truncated library's segments past the end of its file, and the first
    read there kills the process with SIGBUS, which no exception can catch."""
    if len(data) < 64 or data[:6] != b"\x7fELF\x02\x01":
        return None
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    if phnum == 0xffff or phnum and phentsize < 0x28:  # (the count held elsewhere; too short)
        return None if phnum == 0xffff else f"corrupt: program headers of {phentsize} bytes"
    ends = [phoff + phnum * phentsize, shoff + shnum * shentsize]
    if ends[0] <= len(data):
        for i in range(phnum):  # each segment's file bytes: p_offset, p_filesz
            offset, = struct.unpack_from("<Q", data, phoff + i * phentsize + 0x08)
            size, = struct.unpack_from("<Q", data, phoff + i * phentsize + 0x20)
            ends.append(offset + size)
    if max(ends) > len(data):
        return f"truncated: {len(data)} bytes, its ELF headers reach byte {max(ends)}"
    return None


def load_cpu(path: Path, src: RenderedSource) -> CpuKernel:
    """The CPU backend's library at ``path``; BadBinary when it is not a loadable library
    with the source's entry points (a truncated one included, which dlopen would map and
    then fault on)."""
    truncated = _elf_truncated(path.read_bytes())
    if truncated:
        raise BadBinary(f"{path}: {truncated}")
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        hint = " (linked without the C++ runtime: JITATTN_CXX must name a C++ compiler " \
               "driver, g++ or clang++, not gcc)" \
            if re.search(r"undefined symbol: (__gxx|_Z)", str(e)) else ""
        raise BadBinary(f"{e}{hint}") from None
    entries = {}
    for name in src.entries:
        try:
            fn = getattr(library, name)
        except AttributeError as e:
            raise BadBinary(str(e)) from None
        fn.restype = ctypes.c_int
        entries[name] = fn
    return CpuKernel(library, entries)

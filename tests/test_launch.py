"""The CUDA launch path's argument packing, on a machine without a GPU: CudaKernel.launch over
a stand-in for the driver, the packed parameters read back through the pointers that
cuLaunchKernel would receive."""

import ctypes

import torch

import jitattn as ja
from jitattn import launch, load

from helpers import make_paged

_READ = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64,
         "f32": ctypes.c_float}


class _FakeDriver:
    """Records cuLaunchKernel's arguments, as the driver's launch_args builds them, and reads
    the parameters back at once (the buffer is reused by the next launch)."""

    launch_args = load._Driver.launch_args

    def __init__(self):
        self.launches = []

    def check(self, rc, what):
        assert rc == 0, what

    def launch(self, device_index, args):
        function, gx, gy, gz, bx, by, bz, smem, stream, params, extra = (
            a if a is None else a.value or 0 for a in args)  # (a NULL c_void_p: None)
        assert extra is None
        self.launches.append(((gx, gy, gz), (bx, by, bz), smem, stream, params))
        return 0


def _read_back(kinds, params: int) -> list:
    pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.cast(pointers[i], ctypes.POINTER(_READ[k])).contents.value
            for i, k in enumerate(kinds)]


def test_cuda_launch_packs_every_argument_in_order(monkeypatch):
    fake = _FakeDriver()
    monkeypatch.setattr(load, "_DRIVER", fake)
    cap = ja.scalar("cap")
    slopes = ja.tensor("slopes", ("num_qo_heads",), "float32")
    variant = ja.Variant("packing", mask="causal",
                         score_mod=lambda s, b, h, q, k: cap * ja.tanh(s / cap) +
                         slopes[h] * (k - q))
    (k, v), kv_indptr, kv_indices, last = make_paged([10, 20], 2, 64, 16, "NHD",
                                                     torch.float16, "cpu", seed=0)
    w = ja.BatchPrefill(variant, page_size=16, device="cpu")
    w.plan(torch.tensor([0, 3, 5], dtype=torch.int32), kv_indptr, kv_indices, last, 4, 2, 64)
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    out, lse = torch.empty_like(q), torch.empty(5, 4)
    bound = variant.bind({"cap": 20.0, "slopes": torch.ones(4)}, device=q.device,
                         sizes=w._planned["sizes"])
    kv = launch.KVView.paged(k, v, w._ws.view("kv_indices"), "NHD")
    fixed = launch._fixed_args(None, None, w._device_plan, 2, 0, 0, 4, 2, kv.kv_indices,
                               kv.page_size)
    kinds = launch._attention_kinds(variant)
    values = launch._fill_args(fixed, q, k, v, out, lse, kv.k_strides, kv.v_strides, 0.125,
                               variant, bound)
    assert len(kinds) == len(values) == 32 + 1 + 2
    assert values[0] == q.data_ptr() and values[-3] == 20.0
    assert values[-2] == bound["slopes"].data_ptr() and values[-1] == 4
    kernel = load.CudaKernel(function=1234, device_index=0, threads=256, smem_bytes=4096,
                             rows_per_cta=128, kind="prefill")
    kernel.launch((7, 1, 1), kinds, values, 99)
    grid, block, smem, stream, params = fake.launches[-1]
    assert (grid, block, smem, stream) == ((7, 1, 1), (256, 1, 1), 4096, 99)
    assert _read_back(kinds, params) == values
    buffer = kernel._params
    values2 = list(values)
    values2[14] = 3  # another single_qo_len: the same buffer, repacked
    kernel.launch((1, 1, 1), kinds, values2, 0)
    assert kernel._params is buffer and _read_back(kinds, fake.launches[-1][4]) == values2
    assert fake.launches[-1][:4] == ((1, 1, 1), (256, 1, 1), 4096, 0)  # (not the last call's)
    merge_kinds = launch._MERGE_KINDS
    merge_values = [1, 2, 3, 4, 5, 6, 7, 8, 1 << 40, 9, 10, 11, 12, 128, 1]
    kernel.launch((1, 1, 1), merge_kinds, merge_values, 0)  # another signature: a new buffer
    assert kernel._params is not buffer
    assert _read_back(merge_kinds, fake.launches[-1][4]) == merge_values


def test_tma_maps_are_packed_64_byte_aligned(monkeypatch):
    """The TMA kernels' last two arguments: kv_tma and both maps as one 256-byte parameter
    (KVMaps, 64-byte aligned in the kernel's parameter space and so in the packed buffer),
    after an odd number of 4-byte arguments."""
    fake = _FakeDriver()
    monkeypatch.setattr(load, "_DRIVER", fake)
    variant = ja.Variant("tma_packing", mask="causal")
    kinds = launch._attention_kinds(variant, tma=True)
    assert kinds[:-2] == launch._attention_kinds(variant) and kinds[-2:] == ("i32", "tmaps")
    maps = bytes(range(256))
    values = list(range(1, len(kinds) - 1)) + [1, maps]
    kernel = load.CudaKernel(function=1, device_index=0, threads=256, smem_bytes=0,
                             rows_per_cta=128, kind="prefill", tma=True)
    kernel.launch((1, 1, 1), kinds, values, 0)
    params = fake.launches[-1][4]
    pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    assert ctypes.string_at(pointers[len(kinds) - 1], 256) == maps
    assert pointers[len(kinds) - 1] % 64 == 0
    assert _read_back(kinds[:-1], params) == values[:-1]


def test_a_driver_without_tma_maps_falls_back_to_cp_async():
    """A driver before CUDA 12 has no cuTensorMapEncodeTiled: no map, so kv_tma = 0 (the
    kernels then copy K / V with cp.async) rather than an error."""
    drv = object.__new__(load._Driver)
    drv.lib = object()  # no symbols at all
    assert drv.encode_tiled(load.TMA_FLOAT16, 1 << 20, (128, 8, 100), (256, 2048),
                            (64, 1, 128)) is None

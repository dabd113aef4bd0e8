"""torch dtypes -> short tags and the C++ type names each backend uses for them."""

from __future__ import annotations

import torch

#: Attention input/output dtypes the kernels are built for.
QKV_DTYPES = (torch.float16, torch.bfloat16)
#: KV-cache dtypes besides q's own, by tag: fp8 e4m3 and e5m2 (dequantized on load, exactly;
#: the batch wrappers' kv_dtype)
FP8_TAG = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
FP8_KV_DTYPES = tuple(FP8_TAG)
FP8_TAGS = tuple(FP8_TAG.values())

TAG = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "bool",
}
FROM_NAME = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}

#: C++ type per tag, per backend. The CPU backend keeps 16-bit floats as tagged uint16 structs.
#: fp8 on CUDA: e4m3 as the raw byte, e5m2 as a 1-byte enum of its own (the kernels tell the
#: formats apart by the type, at compile time; jitattn_cuda_types.cuh).
CTYPE = {
    "cuda": {"f16": "half", "bf16": "__nv_bfloat16", "f32": "float", "i32": "int",
             "i64": "long long", "bool": "unsigned char", "e4m3": "__nv_fp8_storage_t",
             "e5m2": "ja_e5m2"},
    "cpu": {"f16": "ja_f16", "bf16": "ja_bf16", "f32": "float", "i32": "int",
            "i64": "long long", "bool": "unsigned char", "e4m3": "ja_e4m3", "e5m2": "ja_e5m2"},
}


def tag(dtype: torch.dtype) -> str:
    """Filename-safe tag of a dtype, e.g. ``torch.float16 -> "f16"``."""
    try:
        return TAG[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported; expected one of {list(TAG)}") from None


def kv_tag(dtype: torch.dtype) -> str:
    """Tag of a KV-cache dtype: q's own (f16, bf16) or fp8 ("e4m3", "e5m2")."""
    return FP8_TAG.get(dtype) or tag(dtype)


def is_float_tag(t: str) -> bool:
    return t in ("f16", "bf16", "f32")

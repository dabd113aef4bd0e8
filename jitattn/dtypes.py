"""torch dtypes -> short tags and the C++ type names each backend uses for them."""

from __future__ import annotations

import torch

#: Attention input/output dtypes the kernels are built for.
QKV_DTYPES = (torch.float16, torch.bfloat16)
#: KV-cache dtypes besides q's own: fp8 e4m3 (dequantized on load; the batch wrappers' kv_dtype)
FP8_KV_DTYPES = (torch.float8_e4m3fn,)

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
CTYPE = {
    "cuda": {"f16": "half", "bf16": "__nv_bfloat16", "f32": "float", "i32": "int",
             "i64": "long long", "bool": "unsigned char", "e4m3": "__nv_fp8_storage_t"},
    "cpu": {"f16": "ja_f16", "bf16": "ja_bf16", "f32": "float", "i32": "int",
            "i64": "long long", "bool": "unsigned char", "e4m3": "ja_e4m3"},
}


def tag(dtype: torch.dtype) -> str:
    """Filename-safe tag of a dtype, e.g. ``torch.float16 -> "f16"``."""
    try:
        return TAG[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported; expected one of {list(TAG)}") from None


def kv_tag(dtype: torch.dtype) -> str:
    """Tag of a KV-cache dtype: q's own (f16, bf16) or fp8 e4m3."""
    return "e4m3" if dtype == torch.float8_e4m3fn else tag(dtype)


def is_float_tag(t: str) -> bool:
    return t in ("f16", "bf16", "f32")

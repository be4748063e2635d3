"""Moving arrays between the host and the GPU, and the BF16 dtype CuPy holds them in."""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np

_BF16, _U16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16)


@functools.lru_cache(maxsize=1)
def bf16_dtype() -> Any:
    """ml_dtypes.bfloat16 where this CuPy has a BF16 dtype, else uint16 (same bytes)."""
    import cupy

    try:
        cupy.zeros(1, dtype=ml_dtypes.bfloat16)
        return np.dtype(ml_dtypes.bfloat16)
    except Exception:
        return np.dtype(np.uint16)


def require_bf16(array: Any, what: str, name: str = "hidden") -> None:
    """TypeError unless `array` holds BF16: ml_dtypes.bfloat16, or uint16 bits where this CuPy
    has no BF16 dtype (uint16 is otherwise refused: it may hold integers)."""
    if array.dtype != _BF16 and not (array.dtype == _U16 == bf16_dtype()):
        hint = " (BF16 bits held as uint16: .view(ml_dtypes.bfloat16))" if array.dtype == _U16 else ""
        raise TypeError(f"{what}: {name} must be BF16 (ml_dtypes.bfloat16), got dtype {array.dtype}{hint}")


def to_device_bf16(array: np.ndarray) -> Any:
    """A host array rounded to BF16 (nearest even) on the current GPU, as a CuPy array."""
    import cupy

    host = np.ascontiguousarray(np.asarray(array, dtype=ml_dtypes.bfloat16))
    return cupy.asarray(host.view(np.uint16)).view(bf16_dtype())


def to_device_f32(array: np.ndarray) -> Any:
    """A host array as FP32 on the current GPU."""
    import cupy

    return cupy.asarray(np.ascontiguousarray(np.asarray(array, dtype=np.float32)))


def to_host(array: Any) -> np.ndarray:
    """Device array -> host NumPy (BF16 buffers come back as ml_dtypes.bfloat16)."""
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    if host.dtype == np.uint16:
        host = host.view(ml_dtypes.bfloat16)
    return host


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src for two CuPy arrays of one shape and dtype, on the current stream: one
    asynchronous device-to-device memcpy where both are C-contiguous (an API call, not an
    element-wise kernel: a few us less host time per decode call), else an element-wise copy."""
    import cupy

    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_into: {src.dtype} {list(src.shape)} into {dst.dtype} {list(dst.shape)}")
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        if dst.nbytes:
            dst.data.copy_from_device_async(src.data, src.nbytes, cupy.cuda.get_current_stream())
    else:
        dst[...] = src


def copy_of(src: Any) -> Any:
    """A new C-contiguous CuPy array equal to src (see copy_into)."""
    import cupy

    out = cupy.empty(src.shape, src.dtype)
    copy_into(out, src)
    return out

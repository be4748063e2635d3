"""Conv + SiLU + L2 + split of a prefill (kernels_src/conv.cu)."""

from __future__ import annotations

import functools
import math

import cupy
import ml_dtypes
import numpy

from .. import build as kernels
from .checks import *  # noqa: F403
from .checks import _F32_DTYPE, _check_dtype, _f32, _i32, _require, _require_aligned, _require_head_dim, _require_int32, _require_rows, _row_stride, _slot_rows, _state_or_pool_heads, _token_slices  # noqa: F401

CONV_MAX_KERNEL = 4  # taps the kernel's registers hold
CONV_PREFILL_TILE = 64  # tokens per block of conv_prefill_silu_l2_bf16
CONV_PREFILL_HEADS_PER_BLOCK = 4  # heads of q, k or v per block: one per warp


def _conv_kernel_size(conv_state, conv_w, conv_dim: int) -> int:
    _check_dtype("conv_state", conv_state, "f32")
    if conv_state.ndim != 2 or conv_state.shape[0] != conv_dim:
        raise ValueError(f"conv_state: expected [{conv_dim}, K], got {list(conv_state.shape)}")
    kernel_size = conv_state.shape[1]
    if not 1 <= kernel_size <= CONV_MAX_KERNEL:
        raise ValueError(f"conv kernel size must be 1..{CONV_MAX_KERNEL}, got {kernel_size}")
    _require("conv_state", conv_state, "f32", (conv_dim, kernel_size))
    _check_dtype("conv_w", conv_w, "bf16")
    # [conv_dim, K] or the checkpoint's [conv_dim, 1, K]: the same bytes.
    if tuple(conv_w.shape) not in ((conv_dim, kernel_size), (conv_dim, 1, kernel_size)):
        raise ValueError(
            f"conv_w: expected [{conv_dim}, {kernel_size}] (conv_state's K), got {list(conv_w.shape)}"
        )
    if not conv_w.flags.c_contiguous:
        raise ValueError("conv_w: must be C-contiguous")
    return kernel_size


def conv_prefill_silu_l2_bf16(
    conv_state, qkv_proj, conv_w, conv_out, query, key, value, heads: int, head_dim: int, l2_eps: float,
    tokens: int | None = None,
) -> None:
    """T tokens of conv + SiLU + L2 + split in one pass, leaving conv_state as T decode steps would.

    conv_state [conv_dim, K] FP32 (in place), qkv_proj [>= T, conv_dim] BF16, conv_w
    [conv_dim, K] BF16; writes conv_out [>= T, conv_dim] BF16 and query, key (L2-normalised
    per head), value [>= T, H, D] FP32, conv_dim = 3 * H * D; qkv_proj, conv_out, query, key
    and value 16-byte aligned (vector loads and stores). Grid (ceil(3H / 4), ceil(T / 64)),
    one warp per head of q, k or v and tile of tokens.
    """
    _require_head_dim(head_dim)
    _check_dtype("conv_state", conv_state, "f32")
    conv_dim = 3 * heads * head_dim
    kernel_size = _conv_kernel_size(conv_state, conv_w, conv_dim)
    if tokens is None:
        tokens = qkv_proj.shape[0]
    _require_rows("qkv_proj", qkv_proj, "bf16", tokens, (conv_dim,), aligned=True)
    _require_rows("conv_out", conv_out, "bf16", tokens, (conv_dim,), aligned=True)
    for name, array in (("query", query), ("key", key), ("value", value)):
        _require_rows(name, array, "f32", tokens, (heads, head_dim), aligned=True)
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    kernels.launch(
        "conv_prefill_silu_l2_bf16",
        (-(-3 * heads // CONV_PREFILL_HEADS_PER_BLOCK), -(-tokens // CONV_PREFILL_TILE)),
        (HEAD_BLOCK,),
        (conv_state, qkv_proj, conv_w, conv_out, query, key, value, _i32(heads), _i32(head_dim),
         _i32(kernel_size), _i32(tokens), _f32(l2_eps)),
    )

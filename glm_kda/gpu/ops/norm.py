"""The sigmoid-gated RMSNorm of a prefill (kernels_src/norm.cu)."""

from __future__ import annotations

import functools
import math

import cupy
import ml_dtypes
import numpy

from .. import build as kernels
from .checks import *  # noqa: F403
from .checks import _F32_DTYPE, _check_dtype, _f32, _i32, _require, _require_aligned, _require_head_dim, _require_int32, _require_rows, _row_stride, _slot_rows, _state_or_pool_heads, _token_slices  # noqa: F401

TOKENS_PER_BLOCK = 8  # tokens per block of the norm kernel


def gated_rmsnorm_sigmoid_bf16(
    core, out_gate, norm_w, o_norm_out, heads: int, head_dim: int, eps: float, tokens: int | None = None
) -> None:
    """o_norm_out = bf16(core / sqrt(mean(core^2) + eps) * norm_w * sigmoid(out_gate)) per head.

    core [>= T, H, D] FP32, out_gate [>= T, H*D] BF16, norm_w [D] BF16,
    o_norm_out [>= T, H*D] BF16. The gate is a SIGMOID, not SiLU.
    """
    _require_head_dim(head_dim)
    if tokens is None:
        tokens = out_gate.shape[0]
    _require_rows("core", core, "f32", tokens, (heads, head_dim))
    _require_rows("out_gate", out_gate, "bf16", tokens, (heads * head_dim,))
    _require_rows("o_norm_out", o_norm_out, "bf16", tokens, (heads * head_dim,))
    _require("norm_w", norm_w, "bf16", (head_dim,))
    for start, end in _token_slices(tokens):
        kernels.launch(
            "gated_rmsnorm_sigmoid_bf16",
            (heads, -(-(end - start) // TOKENS_PER_BLOCK)),
            (HEAD_BLOCK,),
            (core[start:end], out_gate[start:end], norm_w, o_norm_out[start:end], _i32(heads), _i32(head_dim), _f32(eps),
             _i32(end - start)),
        )

"""The sigmoid-gated RMSNorm of a prefill (kernels_src/norm.cu)."""

from __future__ import annotations

from .. import build
from .checks import HEAD_BLOCK, _f32, _i32, _require, _require_head_dim, _require_rows, _token_slices

# Tokens per block of the kernel (NORM_TOKENS_PER_BLOCK).
_TOKENS_PER_BLOCK = 4
# Heads per block (NORM_HEADS_PER_BLOCK): one per warp of its HEAD_BLOCK threads.
_HEADS_PER_BLOCK = 4


def kda_gated_rmsnorm_sigmoid_bf16(core, out_gate, norm_w, o_norm_out, heads: int, head_dim: int, eps: float,
                                   tokens: int | None = None) -> None:
    """o_norm_out = bf16(core / sqrt(mean(core^2) + eps) * norm_w * sigmoid(out_gate)) per head.

    core [>= T, H, D] FP32, out_gate [>= T, H*D] BF16, norm_w [D] BF16,
    o_norm_out [>= T, H*D] BF16, all 16-byte aligned (vector loads and stores). The gate is a
    SIGMOID, not SiLU. Grid (ceil(H / 4), ceil(T / 4)) per slice of at most MAX_GRID_Y rows: one
    warp per head and group of tokens.
    """
    _require_head_dim(head_dim)
    if tokens is None:
        tokens = out_gate.shape[0]
    _require_rows("core", core, "f32", tokens, (heads, head_dim), aligned=True)
    _require_rows("out_gate", out_gate, "bf16", tokens, (heads * head_dim,), aligned=True)
    _require_rows("o_norm_out", o_norm_out, "bf16", tokens, (heads * head_dim,), aligned=True)
    _require("norm_w", norm_w, "bf16", (head_dim,), aligned=True)
    for start, end in _token_slices(tokens):
        grid = (-(-heads // _HEADS_PER_BLOCK), -(-(end - start) // _TOKENS_PER_BLOCK))
        build.launch("kda_gated_rmsnorm_sigmoid_bf16", grid, (HEAD_BLOCK,),
                     (core[start:end], out_gate[start:end], norm_w, o_norm_out[start:end], _i32(heads), _i32(head_dim),
                      _f32(eps), _i32(end - start)))

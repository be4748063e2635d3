"""Conv + SiLU + L2 + split of a prefill (kernels_src/conv.cu)."""

from __future__ import annotations

from .. import build
from .checks import HEAD_BLOCK, _f32, _i32, _require_head_dim, _require_int32, _require_rows, conv_kernel_size

# Tokens per block of the kernel (CONV_PREFILL_TILE).
_TILE = 64
# Heads of q, k or v per block: one per warp of its HEAD_BLOCK threads.
_HEADS_PER_BLOCK = 4


def kda_conv_prefill_silu_l2_bf16(conv_state, qkv_proj, conv_w, conv_out, query, key, value, heads: int, head_dim: int,
                                  l2_eps: float, tokens: int | None = None) -> None:
    """T tokens of conv + SiLU + L2 + split in one pass, leaving conv_state as T decode steps would.

    conv_state [conv_dim, K] FP32 (in place), qkv_proj [>= T, conv_dim] BF16, conv_w
    [conv_dim, K] BF16; writes conv_out [>= T, conv_dim] BF16 (None: not written) and query, key
    (L2-normalised per head), value [>= T, H, D] FP32, conv_dim = 3 * H * D; qkv_proj, conv_out,
    query, key and value 16-byte aligned (vector loads and stores). Grid (ceil(3H / 4), ceil(T / 64)),
    one warp per head of q, k or v and tile of tokens.
    """
    _require_head_dim(head_dim)
    conv_dim = 3 * heads * head_dim
    kernel_size = conv_kernel_size(conv_state, conv_w, conv_dim)
    if tokens is None:
        tokens = qkv_proj.shape[0]
    _require_rows("qkv_proj", qkv_proj, "bf16", tokens, (conv_dim,), aligned=True)
    if conv_out is not None:
        _require_rows("conv_out", conv_out, "bf16", tokens, (conv_dim,), aligned=True)
    for name, array in (("query", query), ("key", key), ("value", value)):
        _require_rows(name, array, "f32", tokens, (heads, head_dim), aligned=True)
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    grid = (-(-3 * heads // _HEADS_PER_BLOCK), -(-tokens // _TILE))
    build.launch("kda_conv_prefill_silu_l2_bf16", grid, (HEAD_BLOCK,),
                 (conv_state, qkv_proj, conv_w, conv_out, query, key, value, _i32(heads), _i32(head_dim),
                  _i32(kernel_size), _i32(tokens), _f32(l2_eps)))

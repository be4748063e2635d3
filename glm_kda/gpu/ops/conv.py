"""Conv + SiLU + L2 + split of a prefill (kernels_src/conv.cu)."""

from __future__ import annotations

from .. import build
from .checks import HEAD_BLOCK, _f32, _i32, _require_head_dim, _require_int32, _require_rows, conv_kernel_size

# Tokens per block of the kernel (CONV_PREFILL_TILE).
_TILE = 64
# Heads of q, k or v per block: one per warp of its HEAD_BLOCK threads.
_HEADS_PER_BLOCK = 4


def kda_conv_prefill_silu_l2_bf16(conv_state, qkv_proj, conv_w, conv_out, query, key, value, heads: int, head_dim: int,
                                  l2_eps: float, tokens: int | None = None, inv_norms=None) -> None:
    """T tokens of conv + SiLU + L2 + split in one pass, leaving conv_state as T decode steps would.

    conv_state [conv_dim, K] FP32 (in place), qkv_proj [>= T, conv_dim] BF16, conv_w
    [conv_dim, K] BF16, conv_dim = 3 * H * D. Writes what is not None of: conv_out [>= T, conv_dim]
    BF16 (SiLU of the conv, rounded); inv_norms [>= T, 2, H] FP32 (1 / sqrt(sum of squares + l2_eps) of
    each head of q, then of k); query, key (conv_out's q and k times their inv_norms) and value [>= T, H, D]
    FP32, the three together. qkv_proj, conv_out, query, key and value 16-byte aligned (vector loads
    and stores). Grid (ceil(3H / 4), ceil(T / 64)), one warp per head of q, k or v and tile of tokens.
    """
    _require_head_dim(head_dim)
    conv_dim = 3 * heads * head_dim
    kernel_size = conv_kernel_size(conv_state, conv_w, conv_dim)
    if tokens is None:
        tokens = qkv_proj.shape[0]
    _require_rows("qkv_proj", qkv_proj, "bf16", tokens, (conv_dim,), aligned=True)
    if conv_out is not None:
        _require_rows("conv_out", conv_out, "bf16", tokens, (conv_dim,), aligned=True)
    if inv_norms is not None:
        _require_rows("inv_norms", inv_norms, "f32", tokens, (2, heads))
    split = (("query", query), ("key", key), ("value", value))
    if any(array is None for _, array in split) and any(array is not None for _, array in split):
        missing = [name for name, array in split if array is None]
        raise ValueError(f"kda_conv_prefill_silu_l2_bf16: query, key and value are written together; "
                         f"{', '.join(missing)} None")
    if query is not None:
        for name, array in split:
            _require_rows(name, array, "f32", tokens, (heads, head_dim), aligned=True)
    if conv_out is None and inv_norms is None and query is None:
        raise ValueError("kda_conv_prefill_silu_l2_bf16: nothing to write (conv_out, inv_norms and query, key, value "
                         "all None)")
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    grid = (-(-3 * heads // _HEADS_PER_BLOCK), -(-tokens // _TILE))
    build.launch("kda_conv_prefill_silu_l2_bf16", grid, (HEAD_BLOCK,),
                 (conv_state, qkv_proj, conv_w, conv_out, inv_norms, query, key, value, _i32(heads), _i32(head_dim),
                  _i32(kernel_size), _i32(tokens), _f32(l2_eps)))

"""Forget gate and beta of a prefill (kernels_src/gate.cu)."""

from __future__ import annotations

import math

import numpy

from .. import build
from .checks import HEAD_DIM, _check_dtype, _f32, _i32, _require_aligned, _require_rows, _row_stride, _token_slices

# Tokens per block of the kernel (GATE_TOKENS_PER_BLOCK).
_TOKENS_PER_BLOCK = 32
# Threads of a block of the kernel (GATE_THREADS).
_THREADS = 128
# gate_law of the softplus law (KDA_GATE_SOFTPLUS of kernels_src/common/math.cuh).
_GATE_SOFTPLUS = 0
# gate_law of the bounded law (KDA_GATE_BOUNDED).
_GATE_BOUNDED = 1


def gate_law_args(bounded: bool, lower_bound: float) -> tuple[numpy.int32, numpy.float32]:
    """The gate_law and lower_bound arguments of a kernel that forms the forget gate: the bounded law
    (lower_bound * sigmoid(exp(A_log) u); lower_bound must be finite) or the softplus law."""
    if bounded and not math.isfinite(lower_bound):
        raise ValueError(f"bounded gate needs a finite lower_bound, got {lower_bound}")
    return _i32(_GATE_BOUNDED if bounded else _GATE_SOFTPLUS), _f32(lower_bound if bounded else 0.0)


def check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads: int, head_dim: int, tokens: int) -> int:
    """Checks the forget gate's and beta's sources (see :func:`kda_gate_beta_f32`) for `tokens`
    rows (forget_proj 16-byte aligned: both readers load it in vectors); returns the beta
    logits' row stride in elements."""
    qkv = heads * head_dim
    _require_rows("forget_proj", forget_proj, "bf16", tokens, (qkv,), aligned=True)
    for name, array, size, per in (("dt_bias", dt_bias, qkv, "channel"), ("a_log", a_log, heads, "head")):
        _check_dtype(name, array, "f32")
        if array.size != size or not array.flags.c_contiguous:
            raise ValueError(f"{name}: expected {size} contiguous values (per {per}), got {list(array.shape)}")
    _check_dtype("beta_logits", beta_logits, "bf16")
    if beta_logits.ndim != 2 or beta_logits.shape[0] < tokens or beta_logits.shape[1] < heads:
        raise ValueError(f"beta_logits: expected [>= {tokens}, >= {heads}], got {list(beta_logits.shape)}")
    return _row_stride("beta_logits", beta_logits, "bf16", tokens, beta_logits.shape[1])


def kda_gate_beta_f32(forget_proj, dt_bias, a_log, beta_logits, gate, beta, heads: int, head_dim: int, bounded: bool,
                      lower_bound: float, tokens: int | None = None) -> None:
    """Forget-gate log-decay and beta.

    forget_proj [>= T, H*D] BF16, dt_bias [H*D] FP32 (per channel), a_log [H] FP32
    (per head; Kimi's [1, 1, H, 1] is accepted), beta_logits [>= T, >= H] BF16 (may
    be a column slice of a wider buffer), gate [>= T, H, D] FP32, beta [>= T, H]
    FP32. bounded: gate = lower_bound * sigmoid(exp(A_log) u); else the softplus
    law (lower_bound ignored).
    """
    if tokens is None:
        tokens = forget_proj.shape[0]
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim = {head_dim}: the gate kernel is compiled for D = {HEAD_DIM}")
    ld_beta = check_gate_sources(forget_proj, dt_bias, a_log, beta_logits, heads, head_dim, tokens)
    _require_aligned("dt_bias", dt_bias)
    _require_rows("gate", gate, "f32", tokens, (heads, head_dim), aligned=True)
    _require_rows("beta", beta, "f32", tokens, (heads,))
    law = gate_law_args(bounded, lower_bound)
    for start, end in _token_slices(tokens):
        build.launch("kda_gate_beta_f32", (heads, -(-(end - start) // _TOKENS_PER_BLOCK)), (_THREADS,),
                     (forget_proj[start:end], dt_bias, a_log, beta_logits[start:end], _i32(ld_beta), gate[start:end],
                      beta[start:end], _i32(heads), _i32(head_dim), *law, _i32(end - start)))

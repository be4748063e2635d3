"""The tensor-core chunked prefill (``kernels_src/chunk_tc.cu``): launch wrappers and a
float64 NumPy model of its blocked algorithm.

Same inputs and outputs as the FP32 pair ``ops.kda_chunk_prepare_f32`` +
``ops.kda_chunk_scan_f32`` (which stay the reference path): query, key, value, gate
[>= T, H, D] FP32, beta [>= T, H] FP32, the carried state [H, D, D] FP32 (K-major, updated
in place) and core [>= T, H, D] FP32 out. Every matrix product runs on mma.sync TF32 with
FP32 accumulation; chunk 64, sub-chunks of 16. The scratch the scan reads as mma operands
(q_decay, k_tail, W, B) is stored as FP16, which holds those TF32 values exactly in its
normal range (SCRATCH_KINDS). The gate follows the BOUNDED law with lower_bound >= -5
(:func:`chunk_tc_supported`): the kernel turns the pairwise decays exp(G_t - G_s) into matrix
products through one reference row per 16-row sub-chunk, and the range of those factors is
only bounded when every g >= -5 (see the comment above the pair products in the .cu file).
lower_bound=None takes any gate <= 0 (the softplus law) through
kda_chunk_tc_prepare_unbounded_f32: the blocks below the diagonal keep the products (both
factors <= 1 for any gate); a diagonal block keeps them too where the decay across it is
within the bounded range (DIAGONAL_RANGE), and is formed as exact FP32 sums where it is not.
The layer takes it for the softplus law (:func:`prepare_lower_bound`).

Call sequence (one prefill of T tokens; the scratch is that of ``KdaWorkspace`` with chunk
64, see :func:`scratch_shapes`)::

    chunk_prefill_tc(query, key, value, gate, beta, state, core, T, lower_bound,
                     q_decay, k_tail, w, u, attn, chunk_decay)

which is ``kda_chunk_tc_prepare_f32`` (grid (nchunks, H)) then ``kda_chunk_tc_scan_f32``
(grid (H, D / 32)).

:func:`model_chunk_tc` follows the kernels step by step in float64: the same sub-chunk
reference rows, the same block order of the triangular inverse, and TF32 rounding
(:func:`round_tf32`, bit-identical to the kernel's) applied to exactly the operands the
kernels round, the FP16 storage of the scratch (:func:`round_f16`), and the kernel's FP32
cumulative gate and exponent arguments. With
``emulate_rounding=False`` it is the exact blocked algorithm and equals
:func:`glm_kda.reference.chunk_scan` to float64 rounding. The rest of the kernels' FP32
arithmetic (expf, products, mma accumulation) is float64 here, so kernel and model differ
at the FP32 level plus rare TF32 rounding flips of operands.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from glm_kda import kernels, ops
from glm_kda.ops import HEAD_DIM, _check_dtype, _f32, _i32, _require, _require_int32, _require_rows, recurrent_state_heads
from glm_kda.state import array_module

CHUNK = 64
SUB_CHUNK = 16
# The smallest bounded-law lower bound for which the sub-chunk decay factors stay within
# FP32 range: exp(5 * 15) = 3.7e32 (the argument is in kernels_src/chunk_tc.cu).
MIN_LOWER_BOUND = -5.0
# The widest decay across a 16-row diagonal block that the unbounded prepare still forms by
# the reference-row products (the bounded law's range, 15 gates of at least -5); wider blocks
# take exact FP32 sums (CHUNK_TC_DIAGONAL_RANGE in the .cu file).
DIAGONAL_RANGE = -MIN_LOWER_BOUND * (SUB_CHUNK - 1)
PREPARE_THREADS = 256
SCAN_THREADS = 128
SCAN_COLUMNS = 32
D_STRIDE = HEAD_DIM + 4
C_STRIDE = CHUNK + 4
# Three reusable units of a [D][C + 4] tile, plus beta [C]: 104,704 bytes, two blocks per SM.
PREPARE_SMEM_BYTES = 4 * (3 * HEAD_DIM * C_STRIDE + CHUNK)
# FP16 row stride (halves) of the scan's W and q_decay tiles.
H_STRIDE = HEAD_DIM + 32
# W and q_decay FP16 [C][D + 32], the TF32 state copy [32][D + 4], U^T [32][C + 4]: 66,560 bytes.
SCAN_SMEM_BYTES = 2 * 2 * CHUNK * H_STRIDE + 4 * (SCAN_COLUMNS * D_STRIDE + SCAN_COLUMNS * C_STRIDE)
# The scratch the scan reads as mma operands is FP16 (TF32 values, which FP16 holds exactly
# in its normal range: kernels_src/chunk_tc.cu); U and the chunk decay stay FP32.
SCRATCH_KINDS = {"q_decay": "f16", "k_tail": "f16", "w": "f16", "u": "f32", "attn": "f16", "chunk_decay": "f32"}


def chunk_tc_supported(config: Any) -> tuple[bool, str]:
    """(usable, reason): whether the tensor-core prefill applies to this KdaConfig.

    Needs D = 128 and chunk 64 (the workspace's chunk scratch is sized by config.chunk and
    reused as is). The bounded law with -5 <= lower_bound <= 0 takes the bounded prepare;
    any other gate (the softplus law, or a bounded law below -5) takes the unbounded one
    (:func:`prepare_lower_bound`). Otherwise the layer keeps the FP32 path. Device
    requirement (checked at launch): 104,704 bytes of opt-in shared memory per block (sm_80,
    sm_90, sm_100; not sm_86 / sm_89 / sm_120).
    """
    if config.head_dim != HEAD_DIM:
        return False, f"head_dim={config.head_dim}: the kernels are compiled for D = {HEAD_DIM}"
    if config.chunk != CHUNK:
        return False, (f"chunk={config.chunk}: the tensor-core path runs chunk {CHUNK} on the workspace's "
                       f"chunk scratch")
    bound = prepare_lower_bound(config)
    if bound is None:
        law = (f"gate law {config.gate_law!r}" if not config.bounded
               else f"bounded law with gate_lower_bound={config.gate_lower_bound} < {MIN_LOWER_BOUND}")
        return True, f"{law}: the unbounded prepare (exact FP32 sums for wide diagonal blocks), chunk {CHUNK}"
    return True, f"bounded law, lower_bound={bound}, chunk {CHUNK}"


def prepare_lower_bound(config: Any) -> float | None:
    """The lower_bound a tensor-core prefill of this KdaConfig passes: the bounded law's
    bound where -5 <= bound <= 0 (the bounded prepare, which may also form the gate itself),
    else None (the unbounded prepare, fed by the gate kernel: any gate <= 0)."""
    if config.bounded and MIN_LOWER_BOUND <= config.gate_lower_bound <= 0.0:
        return float(config.gate_lower_bound)
    return None


def chunk_count(tokens: int) -> int:
    """nchunks = ceil(T / 64); the padded length is nchunks * 64."""
    return (tokens + CHUNK - 1) // CHUNK


def scratch_shapes(tokens: int, heads: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the scratch buffers of one call (any larger first dimension is fine); their
    dtypes are SCRATCH_KINDS: q_decay, k_tail, w, attn FP16, u and chunk_decay FP32.

    Shapes as the chunk scratch of ``KdaWorkspace`` at chunk 64: q_decay, k_tail, w
    (workspace ``chunk_w_f16``), u (``chunk_u``) [Tp, H, D]; attn [nchunks, H, 64, 64];
    chunk_decay [nchunks, H, D]. k_tail holds the same number of elements as [Tp, H, D] but
    in the chunk-transposed order [nchunks, H, D, 64].
    """
    nchunks = chunk_count(tokens)
    padded = nchunks * CHUNK
    return {
        "q_decay": (padded, heads, HEAD_DIM),
        "k_tail": (padded, heads, HEAD_DIM),
        "w": (padded, heads, HEAD_DIM),
        "u": (padded, heads, HEAD_DIM),
        "attn": (nchunks, heads, CHUNK, CHUNK),
        "chunk_decay": (nchunks, heads, HEAD_DIM),
    }


def f16_view(buffer: Any) -> Any:
    """An FP16 view of the first half of a C-contiguous FP32 buffer's bytes, of the buffer's
    shape: the workspace keeps one allocation per scratch for both chunk paths."""
    flat = buffer.reshape(-1)
    return flat[: flat.size // 2].view(array_module(buffer).float16).reshape(buffer.shape)


def new_scratch(xp: Any, tokens: int, heads: int, fill: float = 0.0) -> dict[str, Any]:
    """Scratch buffers of :func:`scratch_shapes` and SCRATCH_KINDS, filled with `fill`."""
    dtypes = {"f16": xp.float16, "f32": xp.float32}
    return {name: xp.full(shape, fill, dtypes[SCRATCH_KINDS[name]])
            for name, shape in scratch_shapes(tokens, heads).items()}


def _launch(name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int) -> None:
    """kernels.launch with the largest shared-memory carveout: two scan blocks of 93 KB per SM
    need more than the driver's default split leaves when it is free to favour L1 (the
    carveout is a hint; a block that cannot run at all is always given enough)."""
    kernels.launch(name, grid, block, args, shared_mem=shared_mem, carveout=100)


def _require_lower_bound(lower_bound: float | None) -> None:
    if lower_bound is None:  # no lower bound: the unbounded prepare
        return
    try:
        bound = float(lower_bound)
    except (TypeError, ValueError):
        bound = math.nan
    if not MIN_LOWER_BOUND <= bound <= 0.0:
        raise ValueError(
            f"lower_bound = {lower_bound!r}: the tensor-core prefill needs the bounded gate law with "
            f"{MIN_LOWER_BOUND} <= lower_bound <= 0, or lower_bound=None for gates without a bound (the softplus "
            f"law; a bound below {MIN_LOWER_BOUND} is such a gate)"
        )


def _checked_call_needs_work(lower_bound: float | None, gate_source: Any, tokens: int) -> bool:
    """The checks every prefill call starts with (the bound, the gate source it allows, tokens);
    False for zero tokens (nothing to launch)."""
    _require_lower_bound(lower_bound)
    if lower_bound is None and gate_source is not None:
        raise ValueError("gate_source forms the bounded law's gate: it needs a lower_bound")
    _require_int32("tokens", tokens)
    return tokens != 0


def _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens: int, heads: int) -> None:
    nchunks = chunk_count(tokens)
    padded = nchunks * CHUNK
    # Every scratch access is a 16-, 8- or 4-byte vector.
    for name, array in (("q_decay", q_decay), ("k_tail", k_tail), ("w", w), ("u", u)):
        _require_rows(name, array, SCRATCH_KINDS[name], padded, (heads, HEAD_DIM), aligned=True)
    _require_rows("attn", attn, SCRATCH_KINDS["attn"], nchunks, (heads, CHUNK, CHUNK), aligned=True)
    _require_rows("chunk_decay", chunk_decay, "f32", nchunks, (heads, HEAD_DIM), aligned=True)


def _heads_of(beta) -> int:
    _check_dtype("beta", beta, "f32")
    if beta.ndim != 2:
        raise ValueError(f"beta: expected [>= T, H], got {list(beta.shape)}")
    return beta.shape[1]


class GateSource(NamedTuple):
    """What the forget gate and beta are formed from (as ops.gate_beta_f32 takes them):
    forget_proj [>= T, H*D] BF16, dt_bias [H*D] FP32, a_log [H] FP32, beta_logits [>= T, >= H]
    BF16 (a column slice of a wider buffer is fine)."""

    forget_proj: Any
    dt_bias: Any
    a_log: Any
    beta_logits: Any


def kda_chunk_tc_prepare_f32(query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
                             tokens: int, lower_bound: float | None, scale: float | None = None,
                             gate_source: GateSource | None = None) -> None:
    """Intra-chunk work of every chunk (no state): grid (nchunks, H), 256 threads.

    lower_bound: the bounded law's bound (-5 <= lower_bound <= 0), or None for gates with no
    lower bound (the softplus law): the kda_chunk_tc_prepare_unbounded_f32 entry point, which
    forms a diagonal 16 x 16 block of A and B whose decay exceeds DIAGONAL_RANGE as exact FP32
    sums instead of tensor-core products (their factors are only bounded under a bound on the
    decay; :func:`diagonal_in_range`). Not with `gate_source`.

    query, key, value, gate [>= T, H, D] and beta [>= T, H] FP32, 16-byte aligned; rows >= T
    are never read. With `gate_source`, gate and beta are OUTPUTS instead: the
    kda_chunk_tc_prepare_gate_f32 entry point forms them from the projections (the bounded
    law at lower_bound, bit for bit what ops.gate_beta_f32 writes) and writes their T rows.
    It measured slower than the gate kernel + this prepare (benchmarks/NOTES.md).

    Writes the scratch of :func:`scratch_shapes`: q_decay = f16(tf32(scale q exp(G))),
    k_tail = f16(tf32(k exp(G_last - G))) chunk-transposed, w = f16(tf32(W)), u = Uc (FP32),
    attn = f16(tf32(B)) (zero above the diagonal), chunk_decay = exp(G_last) (FP32); padded
    rows zero.
    """
    if not _checked_call_needs_work(lower_bound, gate_source, tokens):
        return
    heads = _heads_of(beta)
    _require_rows("beta", beta, "f32", tokens, (heads,))
    for name, array in (("query", query), ("key", key), ("value", value), ("gate", gate)):
        _require_rows(name, array, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    if scale is None:
        scale = 1.0 / math.sqrt(HEAD_DIM)
    args = (query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
            _i32(tokens), _i32(heads), _f32(scale), _f32(0.0 if lower_bound is None else lower_bound))
    name = "kda_chunk_tc_prepare_f32" if lower_bound is not None else "kda_chunk_tc_prepare_unbounded_f32"
    if gate_source is not None:
        sources = GateSource(*gate_source)
        ld_beta = ops.check_gate_sources(*sources, heads, HEAD_DIM, tokens)
        name, args = "kda_chunk_tc_prepare_gate_f32", (*args, *sources, _i32(ld_beta))
    _launch(name, (chunk_count(tokens), heads), (PREPARE_THREADS,), args, shared_mem=PREPARE_SMEM_BYTES)


def kda_chunk_tc_scan_f32(q_decay, k_tail, w, u, attn, chunk_decay, state, core, tokens: int) -> None:
    """The inter-chunk scan: grid (H, D / 32), 128 threads; state [H, D, D] FP32 in place,
    core [>= T, H, D] FP32 written for the T real tokens only. The scratch comes from
    :func:`kda_chunk_tc_prepare_f32` with the same tokens."""
    _require_int32("tokens", tokens)
    if tokens == 0:
        return
    heads = recurrent_state_heads(state, aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _launch(
        "kda_chunk_tc_scan_f32",
        (heads, HEAD_DIM // SCAN_COLUMNS),
        (SCAN_THREADS,),
        (q_decay, k_tail, w, u, attn, chunk_decay, state, core, _i32(tokens), _i32(heads)),
        shared_mem=SCAN_SMEM_BYTES,
    )


def chunk_prefill_tc(query, key, value, gate, beta, state, core, tokens: int, lower_bound: float | None,
                     q_decay, k_tail, w, u, attn, chunk_decay, scale: float | None = None,
                     gate_source: GateSource | None = None) -> None:
    """The chunked prefill core on tensor cores: core [>= T, H, D] and the carried state
    [H, D, D] (in place) from query, key, value, gate [>= T, H, D] and beta [>= T, H].

    Scratch (C-contiguous, 16-byte aligned; :func:`scratch_shapes`, dtypes SCRATCH_KINDS),
    with Tp = ceil(T / 64) * 64: q_decay, k_tail, w (FP16), u (FP32) [>= Tp, H, D]; attn (FP16)
    [>= Tp / 64, H, 64, 64]; chunk_decay (FP32) [>= Tp / 64, H, D]. The workspace's
    q_decay_f16, k_tail_f16, chunk_w_f16, chunk_u, attn_f16 and chunk_decay are exactly these
    when its chunk is 64.

    lower_bound is the bounded gate law's bound (-5 <= lower_bound <= 0), or None for gates
    without a lower bound (the unbounded prepare, see :func:`kda_chunk_tc_prepare_f32`); anything
    else is refused here, before any launch. With `gate_source` (:class:`GateSource`) gate and beta
    are written from the projections instead of read (see :func:`kda_chunk_tc_prepare_f32`).
    Every argument is checked before the first launch, so a refused call leaves the state
    untouched.
    """
    if not _checked_call_needs_work(lower_bound, gate_source, tokens):
        return
    heads = _heads_of(beta)
    _check_dtype("state", state, "f32")
    if tuple(state.shape) != (heads, HEAD_DIM, HEAD_DIM):
        raise ValueError(f"state: expected [{heads}, {HEAD_DIM}, {HEAD_DIM}] (H from beta), got {list(state.shape)}")
    _require("state", state, "f32", (heads, HEAD_DIM, HEAD_DIM), aligned=True)
    _require_rows("core", core, "f32", tokens, (heads, HEAD_DIM), aligned=True)
    _require_scratch(q_decay, k_tail, w, u, attn, chunk_decay, tokens, heads)
    # The gate sources are the prepare's alone: it checks them before its launch.
    kda_chunk_tc_prepare_f32(query, key, value, gate, beta, q_decay, k_tail, w, u, attn, chunk_decay,
                             tokens, lower_bound, scale, gate_source)
    kda_chunk_tc_scan_f32(q_decay, k_tail, w, u, attn, chunk_decay, state, core, tokens)


# --------------------------------------------------------------------------------------
# The float64 model of the blocked algorithm
# --------------------------------------------------------------------------------------


def round_tf32(x: Any) -> Any:
    """x (float64) -> FP32 -> TF32 with round-to-nearest, ties away from zero, as a float64
    array: bit for bit the kernel's round_tf32 of the same FP32 value. Inf and NaN pass."""
    xp = array_module(x)
    bits = xp.asarray(x, dtype=xp.float32).view(xp.uint32)
    special = (bits & xp.uint32(0x7F800000)) == xp.uint32(0x7F800000)
    rounded = xp.where(special, bits, (bits + xp.uint32(0x1000)) & xp.uint32(0xFFFFE000))
    return rounded.view(xp.float32).astype(xp.float64)


def round_f16(x: Any) -> Any:
    """x (float64) -> FP32 -> FP16 (nearest even, subnormals kept, overflow to inf) as float64."""
    xp = array_module(x)
    return xp.asarray(x, dtype=xp.float32).astype(xp.float16).astype(xp.float64)


def _round_f16_of_tf32(x: Any) -> Any:
    return round_f16(round_tf32(x))


def _exact(x: Any) -> Any:
    return array_module(x).asarray(x, dtype=array_module(x).float64)


def _blocks(matrix: Any, i: int, j: int) -> Any:
    """Sub-chunk block (i, j) of [..., C, C] (a view)."""
    return matrix[..., SUB_CHUNK * i : SUB_CHUNK * (i + 1), SUB_CHUNK * j : SUB_CHUNK * (j + 1)]


def diagonal_in_range(cumgate: Any, i: int) -> Any:
    """[nchunks, H] bool: whether diagonal block i of each chunk may take the reference-row
    products in the unbounded prepare: G_r - G_last <= DIAGONAL_RANGE in every channel, r and
    last its first and last rows, as the kernel's FP32 difference (a NaN is out of range).
    cumgate [nchunks, H, 64, D], the chunk's cumulative (FP32) gate."""
    xp = array_module(cumgate)
    first_row = cumgate[:, :, SUB_CHUNK * i, :].astype(xp.float32)
    last_row = cumgate[:, :, SUB_CHUNK * (i + 1) - 1, :].astype(xp.float32)
    return ((first_row - last_row) <= DIAGONAL_RANGE).all(-1)


def model_chunk_tc_prepare(query, key, value, gate, beta, lower_bound: float | None, scale: float | None = None,
                           emulate_rounding: bool = True, pad_value: float = 0.0) -> dict[str, Any]:
    """kda_chunk_tc_prepare_f32 in float64: the scratch it writes, in its layouts
    (see :func:`scratch_shapes`; k_tail as [nchunks, H, D, 64]).

    The inputs are padded to a multiple of 64 rows with `pad_value` and the padding is then
    replaced BY INDEX (q = k = v = 0, g = 0, beta = 0) before any arithmetic, as the kernel
    never reads those rows. lower_bound None: the unbounded prepare (a diagonal block of A and B
    wider than DIAGONAL_RANGE as exact sums, see :func:`diagonal_in_range`; the gate only
    capped at 0).
    """
    _require_lower_bound(lower_bound)
    xp = array_module(query)
    rnd = round_tf32 if emulate_rounding else _exact
    # The scratch the scan reads as mma operands is stored FP16 (exact for TF32 values in
    # FP16's normal range; rounded to nearest even below it, as cvt.rn.f16.f32 does).
    stored = _round_f16_of_tf32 if emulate_rounding else _exact
    # The kernel's cumulative gate is an FP32 running sum and every exponent argument an FP32
    # difference; emulated, because their FP32 error (1e-5 relative in exp at |G| ~ 300)
    # would otherwise flip many TF32 roundings between kernel and model.
    gate_dtype = xp.float32 if emulate_rounding else xp.float64

    def exp_of_difference(a, b):
        return xp.exp((a.astype(gate_dtype) - b.astype(gate_dtype)).astype(xp.float64))

    tokens, heads, dim = query.shape
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    nchunks = chunk_count(tokens)
    padded = nchunks * CHUNK
    valid = xp.arange(padded) < tokens

    def chunked(x):
        # [T, H, ...] -> [nchunks, H, C, ...], padding zero by index.
        full = xp.full((padded,) + x.shape[1:], pad_value, dtype=xp.float64)
        full[:tokens] = x
        full = xp.where(valid.reshape((padded,) + (1,) * (x.ndim - 1)), full, 0.0)
        full = full.reshape((nchunks, CHUNK) + x.shape[1:])
        return xp.moveaxis(full, 1, 2)

    q, k, v, g = (chunked(x) for x in (query, key, value, gate))
    b = chunked(beta)  # [nchunks, H, C]
    # The kernel's clamp to [lower_bound, 0]: the identity on the bounded law's gates.
    g = xp.where(g > 0.0, 0.0, g)
    if lower_bound is not None:
        g = xp.where(g < lower_bound, lower_bound, g)
    # G_t = G_{t-1} + g_t in row order, as the kernel sums (CuPy's cumsum is a parallel scan).
    cumgate = g.astype(gate_dtype)
    for t in range(1, CHUNK):
        cumgate[:, :, t] += cumgate[:, :, t - 1]
    cumgate = cumgate.astype(xp.float64)
    last = cumgate[:, :, -1:, :]

    # 1. Elementwise outputs.
    q_decay = stored(scale * q * xp.exp(cumgate))
    k_tail = stored(k * exp_of_difference(last, cumgate))
    chunk_decay = xp.exp(last[:, :, 0, :])

    # 2. A and B by row block i, reference row 16 i (range argument in the .cu file).
    pair_kk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    pair_qk = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    for i in range(CHUNK // SUB_CHUNK):
        rows = slice(SUB_CHUNK * i, SUB_CHUNK * (i + 1))
        columns = slice(0, SUB_CHUNK * (i + 1))
        reference = cumgate[:, :, SUB_CHUNK * i : SUB_CHUNK * i + 1, :]
        factor = exp_of_difference(cumgate[:, :, rows], reference)
        key_row = rnd(k[:, :, rows] * factor)
        query_row = rnd(q[:, :, rows] * factor)
        source_exponent = (reference.astype(gate_dtype) - cumgate[:, :, columns].astype(gate_dtype)).astype(xp.float64)
        if lower_bound is None:
            # Only a diagonal block wider than DIAGONAL_RANGE reaches the cap (the earlier
            # columns' exponents are <= 0), and its products are replaced below.
            source_exponent = xp.minimum(source_exponent, DIAGONAL_RANGE)
        key_source = rnd(k[:, :, columns] * xp.exp(source_exponent))
        pair_kk[:, :, rows, columns] = key_row @ xp.swapaxes(key_source, -1, -2)
        pair_qk[:, :, rows, columns] = query_row @ xp.swapaxes(key_source, -1, -2)
        if lower_bound is None:
            # The unbounded prepare's diagonal block where its decay exceeds DIAGONAL_RANGE:
            # sum_d x_t k_s exp(G_t - G_s) with no TF32 operands.
            in_range = diagonal_in_range(cumgate, i)[..., None, None]
            decayed = k[:, :, None, rows] * exp_of_difference(cumgate[:, :, rows, None], cumgate[:, :, None, rows])
            for pair, x in ((pair_kk, k), (pair_qk, q)):
                pair[:, :, rows, rows] = xp.where(in_range, pair[:, :, rows, rows], (x[:, :, rows, None] * decayed).sum(-1))
    position = xp.arange(CHUNK)
    strict = position[:, None] > position[None, :]
    inclusive = position[:, None] >= position[None, :]
    lower = xp.where(strict, b[..., :, None] * pair_kk, 0.0)
    attn = stored(xp.where(inclusive, scale * pair_qk, 0.0))

    # 3. T = (I + L)^-1: exact diagonal blocks (the kernel's FP32 forward substitution),
    # then the blocks below the diagonal in waves of distance 1, 2, 3.
    inverse = xp.zeros((nchunks, heads, CHUNK, CHUNK))
    eye = xp.eye(SUB_CHUNK)
    subs = CHUNK // SUB_CHUNK
    for i in range(subs):
        _blocks(inverse, i, i)[...] = xp.linalg.inv(eye + _blocks(lower, i, i))
    for distance in range(1, subs):
        for i in range(distance, subs):
            j = i - distance
            total = sum(rnd(_blocks(lower, i, k_)) @ rnd(_blocks(inverse, k_, j)) for k_ in range(j, i))
            _blocks(inverse, i, j)[...] = -(rnd(_blocks(inverse, i, i)) @ rnd(total))

    # 4. W and Uc.
    key_beta = rnd(b[..., None] * k * xp.exp(cumgate))
    value_beta = rnd(b[..., None] * v)
    w = stored(rnd(inverse) @ key_beta)
    u = rnd(inverse) @ value_beta

    def rows_major(x):  # [nchunks, H, C, D] -> [Tp, H, D]
        return xp.moveaxis(x, 2, 1).reshape(padded, heads, dim)

    return {
        "q_decay": rows_major(q_decay),
        "k_tail": xp.swapaxes(k_tail, -1, -2).copy(),  # [nchunks, H, D, C]
        "w": rows_major(w),
        "u": rows_major(u),
        "attn": attn,
        "chunk_decay": chunk_decay,
    }


def model_chunk_tc_scan(scratch: dict[str, Any], recurrent: Any, tokens: int,
                        emulate_rounding: bool = True) -> tuple[Any, Any]:
    """kda_chunk_tc_scan_f32 in float64 on a prepare's scratch (the model's or a kernel's,
    host or device arrays): returns (core [T, H, D], state [H, D, D])."""
    rnd = round_tf32 if emulate_rounding else _exact
    q_decay = _exact(scratch["q_decay"])
    xp = array_module(q_decay)
    k_tail, w, u = (_exact(scratch[name]) for name in ("k_tail", "w", "u"))
    attn, chunk_decay = _exact(scratch["attn"]), _exact(scratch["chunk_decay"])
    heads, dim = recurrent.shape[0], recurrent.shape[1]
    nchunks = chunk_count(tokens)
    k_tail = k_tail.reshape(-1)[: nchunks * heads * dim * CHUNK].reshape(nchunks, heads, dim, CHUNK)
    state = xp.asarray(recurrent, dtype=xp.float64).copy()
    core = xp.zeros((nchunks * CHUNK, heads, dim))
    position = xp.arange(CHUNK)
    for n in range(nchunks):
        rows = slice(n * CHUNK, (n + 1) * CHUNK)
        valid = (position < tokens - n * CHUNK)[None, :, None]
        state_operand = rnd(state)
        w_chunk, u_chunk, q_chunk = (xp.swapaxes(x[rows], 0, 1) for x in (w, u, q_decay))  # [H, C, D]
        new_value = xp.where(valid, u_chunk - w_chunk @ state_operand, 0.0)
        new_value_operand = rnd(new_value)
        out = q_chunk @ state_operand + attn[n] @ new_value_operand
        state = chunk_decay[n][:, :, None] * state + k_tail[n] @ new_value_operand
        core[rows] = xp.swapaxes(out, 0, 1)
    return core[:tokens], state


def model_chunk_tc(query, key, value, gate, beta, recurrent, lower_bound: float | None, scale: float | None = None,
                   emulate_rounding: bool = True, pad_value: float = 0.0) -> tuple[Any, Any]:
    """The whole tensor-core prefill in float64: (core [T, H, D], state [H, D, D]).

    query, key, value, gate [T, H, D], beta [T, H], recurrent [H, D, D] (NumPy, or CuPy to
    run on a GPU). With emulate_rounding=False, equal to reference.chunk_scan(..., chunk=64) up
    to float64 rounding (for gates inside [lower_bound, 0]; lower_bound None: any gate <= 0).
    """
    scratch = model_chunk_tc_prepare(query, key, value, gate, beta, lower_bound, scale, emulate_rounding, pad_value)
    return model_chunk_tc_scan(scratch, recurrent, query.shape[0], emulate_rounding)


__all__ = [
    "CHUNK", "MIN_LOWER_BOUND", "PREPARE_SMEM_BYTES", "SCAN_SMEM_BYTES", "chunk_count", "chunk_prefill_tc",
    "chunk_tc_supported", "prepare_lower_bound", "diagonal_in_range", "DIAGONAL_RANGE", "kda_chunk_tc_prepare_f32",
    "kda_chunk_tc_scan_f32", "model_chunk_tc",
    "model_chunk_tc_prepare", "model_chunk_tc_scan", "round_tf32", "round_f16", "scratch_shapes", "SCRATCH_KINDS",
    "f16_view", "new_scratch", "GateSource",
]

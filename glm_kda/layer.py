"""One KDA block on the GPU: device weights, a shared workspace, prefill / decode / decode_k.

    front end  (driven by the raw hidden rows, identical on every path)
        qkv_proj    = hidden @ [W_q; W_k; W_v]^T           one projection, weights fused at bind
        down_proj   = hidden @ [W_fa; W_ga; W_b]^T         one projection, weights fused at bind
        forget_proj = down_proj[:, :D] @ W_fb^T
        out_gate    = down_proj[:, D:2D] @ W_gb^T
        gate, beta  = gate_beta_f32(forget_proj, dt_bias, A_log, down_proj[:, 2D:])
    stateful part
        decode:  per row, conv + SiLU + L2 fused, then one recurrent step (state read once,
                 written once)
        prefill: conv + SiLU over T tokens, L2 + split, chunk prepare, chunk scan
    back end
        o_norm_out  = sigmoid-gated RMSNorm(core, out_gate)
        final_out   = o_norm_out @ W_o^T

Every decode-side projection (decode, decode_k, batched decode, prefill of <= 16 rows) uses
gemm_rows_bf16, whose per-row arithmetic does not depend on the row count or on the other rows:
this is what makes decode_k (K rows) bit-identical to K calls of decode, and a sequence's bits
independent of the batch it is decoded in. Prefill of more than 16 tokens goes to cuBLAS (BF16
in, FP32 compute), which reassociates and is never used by decode or verify.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import warnings
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from . import chunk_tc, gemm_rows, graph_copies, kernels, ops, persistent
from .checkpoint import BoundLayer, bind_layer
from .config import KdaConfig
from .device import require_gpu
from .state import KdaState, StatePool, require_device_buffers, require_one_row, require_state

GEMV_MAX_ROWS = ops.GEMV_MAX_ROWS
# The one projection kernel of every decode-side call is the tensor-core gemm_rows_bf16 (rows
# padded to its tile, one k order for every row count), and this is the row group it takes per
# launch. ops.gemv_bf16 keeps the same contract and stays as the scalar reference.
DECODE_ROW_GROUP = gemm_rows.GEMM_ROWS_MAX_ROWS
# A batched fused step runs waves of (head, sequence) blocks; each block asks L2 for the state
# and conv windows of the block this many waves later (kda_decode_fused_bf16's prefetch_ahead,
# in sequences: waves x the sequences one wave of resident blocks holds, at least 1). 0: none.
# On an H200 (benchmarks/decode_breakdown.py, one process) 0.25 took the 64-sequence graph from
# 372.5 to 338.9 us (GLM) and from 178.8 to 162.7 us (Kimi), 256 sequences from 1407 to 1284 and
# 620 to 559 us; 0.5 gained less (349, 167 us at 64), 0.75 and more little or nothing.
STEP_PREFETCH_WAVES = 0.25
STEP_RESIDENT_BLOCKS_PER_SM = 2
# Where the fused step lets the output projection (its programmatic dependent) launch:
# kda_decode_fused_bf16's dependents_after (0 at once, 1 once the first token's inputs are
# formed, 2 after its recurrent step). On an H200 (benchmarks/decode_breakdown.py, two runs) the
# three were within the rounds' spread of each other (GLM B=1 83.2 - 84.3 us, Kimi 35.6 - 36.5).
STEP_DEPENDENTS_AFTER = 0
# The same for the one-row step awaiting q|k|v (STEP_AWAITS_PROJECTION) where its o_proj awaits the
# step's count of outputs (OUT_PROJ_AWAITS_STEP); at least 1 where o_proj waits for the step's end.
# 3: once the step's blocks are past their wait for q|k|v, before they read it. On an H200
# (benchmarks/decode_breakdown.py, one process, copy bandwidth 4024 GB/s; Kimi B=1 with o_proj's
# weight staged, OUT_PROJ_STAGED_AWAITING) 29.40 us at 3 against 30.31 at 1 and 29.98 at 0: the block
# timeline (benchmarks/timeline.py) had o_proj's blocks start, and their copies go out, at 19.9 us
# instead of 21.3 (at 1, once the first token's inputs are formed, about when the outputs are), with
# the step's outputs out no later (21.4 - 22.1 us); at 0 its blocks are resident from the step's
# start and their copies queue in front of the step's inputs (outputs out at 22.2 - 22.9 us).
# AWAITING_UNSTAGED_DEPENDENTS_AFTER: the same where that o_proj does not stage its weight
# (GLM-5.3-Flash's 67 MB; the staged form's copies are what an early start is for): its blocks,
# started early, only wait. GLM B=1 (benchmarks/decode_breakdown.py, copy bandwidth 4081 GB/s)
# 78.40 us at 1 against 79.42 at 3.
AWAITING_STEP_DEPENDENTS_AFTER = 3
AWAITING_UNSTAGED_DEPENDENTS_AFTER = 1
# The fused step moves each head's state by one bulk copy each way through shared memory (sm_90
# and later; kda_decode_fused_bf16's staged), asking for STEP_STAGED_CARVEOUT percent of shared
# memory (-1: the driver's choice). The same bits as the per-thread loads, but slower on an H200
# (benchmarks/decode_breakdown.py, one process: GLM B=1 84.0 against 83.6 us, B=64 323.0 against
# 312.3; Kimi 35.7 / 35.4, 159.5 / 156.2; carveout 100 slower still), so off.
STEP_STAGED_STATE = False
STEP_STAGED_CARVEOUT = -1
# The fused step splits each head over a cluster of ops.HEAD_SPLIT blocks (sm_90 and later;
# kda_decode_fused_bf16's split) where those blocks fit in STEP_SPLIT_WAVES waves of resident
# blocks (STEP_RESIDENT_BLOCKS_PER_SM per SM; None: never): one sequence, or a few, whose state
# would otherwise come through a few SMs. The same bits as one block per head, but no faster on
# an H200 (benchmarks/decode_breakdown.py, one process, split / one block: GLM B=1 87.4 / 83.4 us,
# verify K16 2.00x / 1.40x; Kimi 35.1 / 35.1, 2.24x / 1.95x), so off.
STEP_SPLIT_WAVES: float | None = None
# The decode front end's low-rank chain (down_proj -> f_b -> g_b) beside the q|k|v projection:
# SIDE_CHAIN_FIRST issues it before q|k|v (False: after); SIDE_CHAIN_PROGRAMMATIC launches f_b
# and g_b as programmatic dependents; SIDE_STREAM_PRIORITY is its stream's priority (lower is more
# urgent, CUDA clamps it; None: the default). QKV_RESERVED_SLOTS: block slots (of
# gemm_rows.GEMM_ROWS_BLOCKS_PER_SM per SM) that a q|k|v projection of one m-tile (<= 16 rows,
# whose grid is otherwise every resident slot) leaves to that chain; 0: none. None of them changes
# a bit. The block timeline (benchmarks/timeline.py) showed why: programmatic f_b and g_b blocks
# become resident at once and wait, and with q|k|v's grid filling every slot, q|k|v started only
# when side-chain blocks left (9.7 us into GLM's B=1 step, 4.5 into Kimi's). Plain f_b and g_b
# and 64 slots left free let it start at 1.8 - 2.0 us. On an H200 (benchmarks/decode_breakdown.py,
# one process, copy bandwidth 4089 GB/s): GLM B=1 79.6 against 83.3 us (0.874 against 0.835 of
# the roofline), Kimi 33.9 against 35.8 (0.603 against 0.572); 20 / 40 / 64 / 96 slots in
# another process: GLM 81.8 / 80.6 / 80.4 / 84.1 us, Kimi 37.0 / 34.8 / 34.1 / 36.8.
SIDE_CHAIN_FIRST = True
SIDE_CHAIN_PROGRAMMATIC = False
SIDE_STREAM_PRIORITY: int | None = -64
QKV_RESERVED_SLOTS = 64
# The output projection of <= 16 rows launches gemm_rows_bf16(staged=True) (where
# gemm_rows.staged_applies: a packed weight of at most gemm_rows.STAGED_MAX_WEIGHT_BYTES on sm_90
# and later): as the fused step's programmatic dependent, each block copies its weights into
# shared memory while the step runs, and reads them from there once the step is done. No bit
# depends on it. Off: on an H200 (benchmarks/decode_breakdown.py, copy bandwidth 4168 GB/s) Kimi
# B=1 34.79 against 34.84 us (33.44 with STEP_DEPENDENTS_AFTER = 1, but verify K16 72.8 against
# 67.1 us), GLM (whose 67 MB weight does not qualify) unchanged; the block timeline showed the
# step starting and ending about 1 us later beside the copies, and the projection's blocks still
# 3.3 - 4.6 us from their wait to their end (against 4.4 - 5.7 reading the weight from memory).
OUT_PROJ_STAGED = False
# A decode call of one row (one sequence) runs q|k|v and the low-rank chain the other way round:
# q|k|v on the current stream, counting into the workspace's inputs_ready (QKV_COUNTS_INPUTS), and
# on the side stream the chain, the fused step (its last kernel's programmatic dependent, waiting on
# the workspace's inputs_ready words for q|k|v) and o_proj (see
# KdaLayer._decode_awaiting_projection). The step's node then has one incoming edge and its blocks
# are resident before q|k|v ends, where a node after the join of two streams started 2.3 - 2.5 us
# after its last input on an H200. No bit depends on it. On an H200 (benchmarks/decode_breakdown.py,
# two processes, copy bandwidth 4099 and 4153 GB/s; in the second two captures of each) GLM B=1 took
# 79.6 and 79.0 / 81.0 us against 81.2 and 82.0 / 80.5 joined; the block timeline
# (benchmarks/timeline.py) had the step's outputs out 3.8 us after q|k|v's last block instead of
# 5.3. Kimi-Linear's chain ends with its q|k|v, so there it changes nothing (32.4 and 32.8 / 32.2
# against 32.3 and 32.3 / 32.4). A walk of several tokens keeps the joined launches: its o_proj,
# launched once the first token's inputs are formed instead of at once, made GLM's 16-token verify 4
# us slower. While they wait, the step's blocks hold one block slot per head: several layers
# decoding at once on streams of their own could fill every slot with waiting steps, and would then
# stop at the wait's trap (tens of seconds); set this False there.
STEP_AWAITS_PROJECTION = True
# Where the step awaits q|k|v (STEP_AWAITS_PROJECTION), q|k|v's own blocks count their outputs out
# in the workspace's inputs_ready (gemm_rows_bf16's counted) and the step awaits their number,
# instead of a signal launched after q|k|v (ops.signal_inputs_ready), which passes on q|k|v's end
# only once the whole grid is done and its writes flushed. No bit depends on it. On an H200 the
# block timeline (benchmarks/timeline.py kimi --rows 1) had the step's outputs out 3.3 - 4.0 us after
# q|k|v's last block against 3.9 - 4.4 with the signal; the graphs (benchmarks/decode_breakdown.py,
# three processes, copy bandwidth 4081 - 4147 GB/s) are within their spread: Kimi B=1 28.88 / 29.13 /
# 29.05 us against 29.24 / 28.97 / 29.06, GLM 78.97 / 79.42 / 78.74 against 78.88 / 78.96 / 80.09.
QKV_COUNTS_INPUTS = True
# Up to 16 rows, the forget and output gate up-projections (f_b, g_b) of the low-rank chain run as one
# launch (gemm_rows.gemm_rows_pair_bf16) instead of one after the other: one launch and one wait on
# down_proj fewer on the chain that the fused step waits for. No bit depends on it.
GATE_UP_PAIR = True
# Where a decode call's output projection runs on gemm_rows' one-row-group sweep (up to 16 rows of
# one launch of the fused step), it waits for the step's blocks to count their outputs out
# (ops.kda_decode_fused_bf16's outputs_ready, gemm_rows_bf16's ready) instead of for the step's end:
# it reads its input while the step still stores its states. No bit depends on it.
# The two together, on an H200 (benchmarks/decode_breakdown.py, two processes, copy bandwidth 4136
# and 4175 GB/s; the second with two captures of each): Kimi B=1 32.19 and 31.50 / 31.54 us against
# 32.38 and 32.12 / 32.30 without them; GLM B=1 79.37 and 79.44 / 80.07 against 79.42 and 81.87 /
# 81.36 (within GLM's spread of 2 us between captures); verify and batches unchanged. The block
# timeline (benchmarks/timeline.py, Kimi): f_b and g_b end at 17.0 us against 17.9, the step's
# outputs out at 20.6 - 21.1 against 21.3 - 21.9; o_proj still passes its wait 1 - 3.5 us after the
# step's blocks stamp their outputs (their release and the poll's round trips through a busy L2, and
# o_proj's own L2 requests before it), against 3.8 us after the step's end before.
OUT_PROJ_AWAITS_STEP = True
# Where the output projection awaits the step's count of outputs (OUT_PROJ_AWAITS_STEP), it also
# stages its weight (gemm_rows_bf16(staged=True, ready=...), where gemm_rows.staged_applies(w, rows,
# awaiting=True): a packed weight of at most gemm_rows.STAGED_MAX_WEIGHT_BYTES, x's rows beside each
# block's stage): its blocks copy their weights into shared memory while the step runs with the memory
# otherwise idle, and past the wait they read x once from L2 and nothing else from memory. No bit
# depends on it. On an H200 (benchmarks/decode_breakdown.py, copy bandwidth 4158 GB/s) Kimi B=1 30.26
# us against 31.37 without (the step's dependents after its first token's inputs in both); with
# AWAITING_STEP_DEPENDENTS_AFTER = 3 (4024 GB/s) 29.40 against 31.71. GLM-5.3-Flash's 67 MB weight does
# not qualify; for one row it stages the tail of each warp's k range (gemm_rows.TAIL_STAGED_AWAITING).
OUT_PROJ_STAGED_AWAITING = True
# Where the output projection of a batch runs on the bulk-copy sweep (gemm_rows.bulk_applies), the
# fused step writes its input a second time in the sweep's tile layout (kda_decode_fused_bf16's
# x_tiles), so that the projection needs no tiling launch between the two. No bit depends on it.
# On an H200 (benchmarks/decode_breakdown.py, one process, copy bandwidth 4118 GB/s) 64 sequences
# took GLM 251.0 against 252.2 us, Kimi 128.7 against 130.7; the block timeline had put the tiling
# launch's end 4.8 us after the step's at Kimi.
STEP_WRITES_X_TILES = True
# The low-rank chain's projections (down_proj, f_b, g_b) on the bulk-copy sweep where
# gemm_rows.bulk_applies gives it (None), or never (False). No bit depends on it. Never: in the same
# run 64 sequences GLM 250.4 us, Kimi 128.7, but 256 sequences GLM 819.3 against 808.3, Kimi 400.1
# against 394.8.
SIDE_CHAIN_BULK: bool | None = None
# The output gate's up-projection (g_b) on a branch of its own beside f_b, both after down_proj (a
# third stream that forks from the chain's and joins it), where the rows exceed GATE_BRANCH_MIN_ROWS
# (None: never). At 64 sequences the chain's three projections ran one after the other and the
# fused step waited for g_b after q|k|v had ended (the block timeline: Kimi's g_b ended 31.6 us into
# the step, q|k|v 25.8; with the branch f_b and g_b end with q|k|v). No bit depends on it. On an
# H200 (benchmarks/decode_breakdown.py, one process, copy bandwidth 4181 GB/s) 64 sequences took Kimi
# 124.1 us against 128.3 without it, GLM 253.6 against 253.9; 256 sequences Kimi 388.2 against 392.6,
# GLM 803.0 against 808.9.
GATE_BRANCH_MIN_ROWS: int | None = 16
# Default of KdaLayer.persistent_decode.
PERSISTENT_DECODE = False
# Most rows one batched decode call takes (the workspace and the pool may limit it further).
MAX_DECODE_ROWS = 256
# What a decode-side call accepts as its rows, and its states' element type (compared per call;
# made once).
_ROW_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16))
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
# A graphed decode call's input and output copies as the first and last nodes of its graph,
# repointed at the call's arrays before each launch (glm_kda.graph_copies), or False: two
# separate memcpys around the launch. The same bytes either way.
GRAPH_COPIES_IN_GRAPH = True
# cudaMemcpyKind of the copies around a graph replay.
_HOST_TO_DEVICE, _DEVICE_TO_DEVICE = 1, 3


def _step_resident_blocks(device_id: int) -> int:
    """Blocks of the fused step resident at once on a device (STEP_RESIDENT_BLOCKS_PER_SM a SM)."""
    return gemm_rows._sm_count(device_id) * STEP_RESIDENT_BLOCKS_PER_SM


@functools.lru_cache(maxsize=1)
def bf16_dtype() -> Any:
    """ml_dtypes.bfloat16 where this CuPy has a BF16 dtype, else uint16 (same bytes)."""
    import cupy

    try:
        cupy.zeros(1, dtype=ml_dtypes.bfloat16)
        return np.dtype(ml_dtypes.bfloat16)
    except Exception:
        return np.dtype(np.uint16)


def to_device_bf16(array: np.ndarray) -> Any:
    import cupy

    host = np.ascontiguousarray(np.asarray(array).astype(ml_dtypes.bfloat16))
    return cupy.asarray(host.view(np.uint16)).view(bf16_dtype())


def to_device_f32(array: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(np.ascontiguousarray(np.asarray(array, dtype=np.float32)))


def to_host(array: Any) -> np.ndarray:
    """Device array -> host NumPy (BF16 buffers come back as ml_dtypes.bfloat16)."""
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    if host.dtype == np.uint16:
        host = host.view(ml_dtypes.bfloat16)
    return host


@contextlib.contextmanager
def _section(name: str):
    """CUDA events around a group of launches when timing is on; free when off."""
    if not kernels.TIMER.active:
        yield
        return
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    yield
    end.record()
    kernels.TIMER.record(f"[{name}]", start, end)


class KdaWorkspace:
    """Scratch sized once for `max_tokens` rows; one workspace serves every layer of a geometry.

    The stage buffers are public on purpose: they carry the oracle's stage names
    (glm_kda.reference.STAGE_ORDER), so `workspace.stages(T)` lines up with an oracle run.

      qkv_proj [T, 3*qkv] BF16    down_proj [T, 2D+H] BF16    forget_proj, out_gate [T, qkv] BF16
      conv_out [T, 3*qkv] BF16    query, key, value, gate, core [Tp, H, D] FP32    beta [Tp, H] FP32
      o_norm_out [T, qkv] BF16    final_out [T, hidden] BF16
      chunk scratch: q_decay, k_tail, chunk_w, chunk_u [Tp, H, D], attn [Tp/C, H, C, C],
      chunk_decay [Tp/C, H, D], all FP32
    with Tp = max_tokens rounded up to the chunk. The tensor-core path keeps q_decay, k_tail,
    w and attn as FP16 in the first half of the same bytes: q_decay_f16, k_tail_f16,
    chunk_w_f16, attn_f16 are those views, of the FP32 buffers' shapes (see glm_kda.chunk_tc).
    The bulk-copy projection sweep's scratch (glm_kda.gemm_rows.gemm_rows_bulk): x_tiles and
    x_tiles_side, x_tiles_gate (x in the tile layout, flat BF16, for the main stream, the low-rank
    chain's and the output gate's branch of it) and bulk_partial (a split sweep's FP32 k-range sums,
    flat). Graph inputs: graph_hidden, graph_slots.
    """

    _shared: dict[tuple, "KdaWorkspace"] = {}
    _serials = itertools.count()

    def __init__(self, config: KdaConfig, max_tokens: int):
        import cupy

        config.validate()
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.config = config
        self.max_tokens = max_tokens
        # Unique for the life of the process (unlike id()): part of every decode graph's key.
        self.serial = next(KdaWorkspace._serials)
        c = config
        self.padded_tokens = padded = -(-max_tokens // c.chunk) * c.chunk
        nchunks = padded // c.chunk
        bf16, f32 = bf16_dtype(), np.float32
        heads, dim = c.heads, c.head_dim
        self.qkv_proj = cupy.zeros((max_tokens, c.conv_dim), bf16)
        self.down_proj = cupy.zeros((max_tokens, c.down_dim), bf16)
        # forget_proj and out_gate have the same shape and kind: separate buffers, never aliased.
        self.forget_proj = cupy.zeros((max_tokens, c.qkv), bf16)
        self.out_gate = cupy.zeros((max_tokens, c.qkv), bf16)
        self.conv_out = cupy.zeros((max_tokens, c.conv_dim), bf16)
        self.query = cupy.zeros((padded, heads, dim), f32)
        self.key = cupy.zeros((padded, heads, dim), f32)
        self.value = cupy.zeros((padded, heads, dim), f32)
        self.gate = cupy.zeros((padded, heads, dim), f32)
        self.beta = cupy.zeros((padded, heads), f32)
        self.core = cupy.zeros((padded, heads, dim), f32)
        self.o_norm_out = cupy.zeros((max_tokens, c.qkv), bf16)
        self.final_out = cupy.zeros((max_tokens, c.hidden), bf16)
        self.q_decay = cupy.zeros((padded, heads, dim), f32)
        self.k_tail = cupy.zeros((padded, heads, dim), f32)
        self.chunk_w = cupy.zeros((padded, heads, dim), f32)
        self.chunk_u = cupy.zeros((padded, heads, dim), f32)
        self.attn = cupy.zeros((nchunks, heads, c.chunk, c.chunk), f32)
        self.chunk_decay = cupy.zeros((nchunks, heads, dim), f32)
        self.q_decay_f16, self.k_tail_f16, self.chunk_w_f16, self.attn_f16 = (
            chunk_tc.f16_view(buffer) for buffer in (self.q_decay, self.k_tail, self.chunk_w, self.attn))
        # x of a decode-side projection in the tile layout of the bulk-copy sweep (gemm_rows_bulk),
        # for one row group of DECODE_ROW_GROUP rows and the widest k (hidden, or o_proj's heads x dim).
        # The low-rank chain, which may run beside q|k|v on a second stream, has its own.
        tile_rows = min(max_tokens, gemm_rows.GEMM_ROWS_MAX_ROWS)
        self.x_tiles = cupy.zeros((gemm_rows.x_tiles_size(tile_rows, max(c.hidden, c.qkv)),), bf16)
        self.x_tiles_side = cupy.zeros((gemm_rows.x_tiles_size(tile_rows, max(c.hidden, c.head_dim)),), bf16)
        self.x_tiles_gate = cupy.zeros((gemm_rows.x_tiles_size(tile_rows, c.head_dim),), bf16)
        # The FP32 k-range sums of a split bulk-copy sweep (gemm_rows.bulk_plan): o_proj's at up to 64
        # rows, where its few column groups are split by k range (a call that finds it too small
        # runs unsplit, the same bits).
        self.bulk_partial = cupy.zeros((gemm_rows.bulk_partial_size(c.hidden, c.qkv, min(max_tokens, 64)),), f32)
        # The two words a fused step awaiting another stream's q|k|v polls (ops.kda_decode_fused_bf16's
        # inputs_ready): zero between calls.
        self.inputs_ready = cupy.zeros((2,), np.int32)
        # The two words an output projection awaiting the fused step's outputs polls
        # (ops.kda_decode_fused_bf16's outputs_ready): zero between calls.
        self.outputs_ready = cupy.zeros((2,), np.int32)
        # Fixed input buffers of the captured decode graphs.
        self.graph_hidden = cupy.zeros((max_tokens, c.hidden), bf16)
        self.graph_slots = cupy.zeros((max_tokens,), np.int32)

    @classmethod
    def shared(cls, config: KdaConfig, max_tokens: int) -> "KdaWorkspace":
        """The workspace of this geometry and size on the current device, made on first use."""
        import cupy

        key = (config.hidden, config.heads, config.head_dim, config.conv_kernel, config.chunk, max_tokens, cupy.cuda.Device().id)
        if key not in cls._shared:
            cls._shared[key] = cls(config, max_tokens)
        return cls._shared[key]

    def stages(self, rows: int) -> dict[str, np.ndarray]:
        """Host copies of the first `rows` rows of every stage buffer, by oracle stage name."""
        from .reference import STAGE_ORDER

        return {name: to_host(getattr(self, name)[:rows]) for name in STAGE_ORDER}


class KdaLayer:
    """One KDA block bound to the GPU. Calls take and return BF16 [rows, hidden] arrays
    (CuPy; NumPy is uploaded; torch tensors pass through DLPack without copies)."""

    CHUNK_IMPLS = ("auto", "fp32", "tensor")

    def __init__(self, bound: BoundLayer, max_tokens: int = 4096, workspace: KdaWorkspace | None = None,
                 chunk_impl: str = "auto", packed_decode: bool = True):
        require_gpu("KdaLayer")
        self.config = bound.config.validate()
        self.layer_idx = bound.layer_idx
        self.workspace = workspace if workspace is not None else KdaWorkspace.shared(self.config, max_tokens)
        fields = ("hidden", "heads", "head_dim", "conv_kernel", "chunk")
        differ = [f"{f} {getattr(self.workspace.config, f)} vs {getattr(self.config, f)}" for f in fields
                  if getattr(self.workspace.config, f) != getattr(self.config, f)]
        if differ:
            raise ValueError(f"the workspace was sized for another geometry: {', '.join(differ)} (workspace vs layer)")
        kernels.KernelSet.get()  # compile and resolve every entry point now, not mid-call
        self.qkv_weight = to_device_bf16(bound.qkv_weight)
        self.down_weight = to_device_bf16(bound.down_weight)
        self.f_b = to_device_bf16(bound.f_b)
        self.g_b = to_device_bf16(bound.g_b)
        self.conv_weight = to_device_bf16(bound.conv_weight)
        self.dt_bias = to_device_f32(bound.dt_bias)
        self.a_log = to_device_f32(bound.a_log.reshape(-1))
        self.o_norm = to_device_bf16(bound.o_norm)
        self.o_proj = to_device_bf16(bound.o_proj)
        self.scale = 1.0 / math.sqrt(self.config.head_dim)
        self._graphs = DecodeGraphs(self)
        self._o_proj_sums: Any = None
        self._state_shapes = (tuple(self.config.conv_state_shape), tuple(self.config.recurrent_state_shape))
        # The decode front end's extra streams and their fork / join events, by branch (see _beside).
        self._branches: dict[int, tuple] = {}
        # Rows of o_norm_out the last fused step also wrote into workspace.x_tiles (0: none).
        self._x_tiles_rows = 0
        # Blocks of the fused step the next o_proj awaits (OUT_PROJ_AWAITS_STEP; 0: none).
        self._o_proj_ready = 0
        self.chunk_impl = chunk_impl
        # Tensor-core prefill: the bounded prepare forms the forget gate and beta itself (True,
        # the default) or reads them from the gate kernel (False); the same bits either way.
        # The unbounded prepare (softplus law) always reads them from the gate kernel. On an
        # H200 at GLM T=16384 the fused prepare ran 2.12 ms against 1.99 ms for the plain one
        # plus 0.26 ms for the gate kernel (one pass over the gate fewer).
        self.fused_gate = True
        # Decode side: conv + L2, gate and beta, the recurrent step and the gated norm in one
        # launch per row group (True, the default), or as the four kernels they fuse (False);
        # the same bits either way (tests/test_gpu.py compares every stage and the states).
        self.fused_decode = True
        # One sequence's decode and verify walk (1..16 rows, no snapshots) as ONE persistent
        # launch (kernels_src/decode_persistent.cu: every projection, every head's fused step and
        # the output as tasks), bit for bit what the separate launches compute; False: those
        # launches. Needs fused_decode and an even head count.
        self.persistent_decode = PERSISTENT_DECODE
        self._packed: dict[str, gemm_rows.PackedWeight] = {}
        self.packed_decode = packed_decode

    # The weights every decode-side projection reads (the attribute names).
    DECODE_WEIGHTS = ("qkv_weight", "down_weight", "f_b", "g_b", "o_proj")

    @property
    def o_proj_sums(self) -> Any:
        """None (the default), or a CuPy float32 [max_tokens, hidden] C-contiguous array on this
        layer's GPU: every call's o_proj then also writes its FP32 sums there, rows 0..T-1, beside
        final_out, which still receives them rounded to BF16 (on the decode side the same bits as
        without). What a tensor-parallel rank hands the all-reduce, so that the ranks' partial
        outputs are added before the one rounding. On the decode side o_proj keeps its forms of up
        to 16 rows (awaiting the fused step, staged; `gemm_rows_bf16(..., sums=...)`), but above 16
        rows it takes the split-k sweep instead of the bulk sweep, and the persistent launch is off.
        Prefill's cuBLAS writes the FP32 result, rounded into final_out by `ops.round_to_bf16`.
        Setting it forgets the captured graphs."""
        return self._o_proj_sums

    @o_proj_sums.setter
    def o_proj_sums(self, sums: Any) -> None:
        import cupy

        if sums is not None:
            shape = (self.workspace.max_tokens, self.config.hidden)
            if not isinstance(sums, cupy.ndarray) or sums.dtype != _F32:
                raise TypeError(f"o_proj_sums: expected a CuPy float32 array, got "
                                f"{type(sums).__name__} {getattr(sums, 'dtype', '')}")
            if sums.shape != shape or not sums.flags.c_contiguous:
                raise ValueError(f"o_proj_sums: expected a C-contiguous [{shape[0]}, {shape[1]}] array (max_tokens, "
                                 f"hidden), got {list(sums.shape)}, C-contiguous: {sums.flags.c_contiguous}")
            if sums.device.id != self.qkv_weight.device.id:
                raise ValueError(f"o_proj_sums: on device {sums.device.id}, the layer on {self.qkv_weight.device.id}")
        self._o_proj_sums = sums
        self._graphs.clear()

    @property
    def packed_decode(self) -> bool:
        """Whether the decode-side projections read their weights in gemm_rows' packed layout
        (True, the default: a copy of each made when this is set, as many bytes again as the
        five projection weights) or the row-major arrays the prefill's cuBLAS reads (False: no
        copy). The same bits either way (tests/test_gpu.py); the packed layout streams in
        contiguous runs (benchmarks/NOTES.md has the timings). Where gemm_rows.WGMMA_MIN_GROUPS_PER_SM
        gives a weight's 17..64-row projections to the warpgroup-MMA sweep on this device, its copy
        also holds the pair layout that sweep reads (gemm_rows.pack_pairs, as many bytes again);
        where gemm_rows.BULK_MIN_GROUPS_PER_SM gives them to the bulk-copy sweep, the tile layout
        (gemm_rows.pack_tiles, likewise).
        Setting it drops the captured decode graphs."""
        return bool(self._packed)

    @packed_decode.setter
    def packed_decode(self, value: bool) -> None:
        # Which weights also get the pair layout of the warpgroup-MMA sweep, and the tile layout of
        # the bulk-copy sweep, follows gemm_rows.WGMMA_MIN_GROUPS_PER_SM and BULK_MIN_GROUPS_PER_SM
        # when this is set: setting it again after changing a rule makes the copies it now asks for.
        wanted = ({name: (gemm_rows.wgmma_takes(n), gemm_rows.bulk_takes(n))
                   for name in self.DECODE_WEIGHTS for n in (getattr(self, name).shape[0],)} if value else {})
        if wanted == {name: (packed.pairs is not None, packed.tiles is not None) for name, packed in self._packed.items()}:
            return
        self._graphs.clear()
        self._packed = {name: gemm_rows.pack_weight(getattr(self, name), pairs=pairs, tiles=tiles)
                        for name, (pairs, tiles) in wanted.items()}

    def decode_weight(self, name: str) -> Any:
        """The weight `name` (one of DECODE_WEIGHTS) as the decode-side projections read it: its
        packed copy with packed_decode, else the array itself."""
        return self._packed.get(name) or getattr(self, name)

    @property
    def chunk_impl(self) -> str:
        """Which chunked-prefill kernels run: "tensor" (TF32 tensor-core kernels, chunk 64; the
        bounded prepare for the bounded law with lower bound >= -5, the unbounded one for any
        other gate, e.g. the softplus law) or "fp32" (the FP32 reference kernels, any chunk).
        Setting "auto" (the default) picks "tensor" where chunk_tc.chunk_tc_supported allows it,
        else "fp32"; reading gives the resolved choice."""
        return self._chunk_impl

    @chunk_impl.setter
    def chunk_impl(self, value: str) -> None:
        if value not in self.CHUNK_IMPLS:
            raise ValueError(f"chunk_impl must be one of {self.CHUNK_IMPLS}, got {value!r}")
        if value == "auto":
            value = "tensor" if chunk_tc.chunk_tc_supported(self.config)[0] else "fp32"
        elif value == "tensor":
            ok, why = chunk_tc.chunk_tc_supported(self.config)
            if not ok:
                raise ValueError(f"chunk_impl='tensor' cannot run this layer: {why}")
        self._chunk_impl = value

    @property
    def use_graphs(self) -> bool:
        """Decode-side calls replay captured CUDA graphs (default True); False: eager launches."""
        return self._graphs.enabled

    @use_graphs.setter
    def use_graphs(self, value: bool) -> None:
        self._graphs.enabled = bool(value)

    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path, layer_idx: int, max_tokens: int = 4096, chunk: int = 64,
                        workspace: KdaWorkspace | None = None, *, chunk_impl: str = "auto", packed_decode: bool = True,
                        **hub_kwargs: Any) -> "KdaLayer":
        """Bind layer `layer_idx` of a checkpoint directory or hub repo (checkpoint.bind_layer; its
        `progress` and the hub's download options pass through hub_kwargs) and upload it.

        max_tokens: the most rows a call takes (the workspace's size); chunk: the chunked
        prefill's chunk length (64 for the tensor-core kernels); workspace: one to share with
        other layers of this geometry (KdaWorkspace.shared); chunk_impl and packed_decode: as
        the constructor and the properties of those names."""
        require_gpu("KdaLayer.from_pretrained")
        bound = bind_layer(path_or_repo, layer_idx, **hub_kwargs)
        if chunk != bound.config.chunk:
            import dataclasses

            bound = dataclasses.replace(bound, config=bound.config.with_chunk(chunk))
        return cls(bound, max_tokens=max_tokens, workspace=workspace, chunk_impl=chunk_impl,
                   packed_decode=packed_decode)

    def new_state(self) -> KdaState:
        """Zero state of a new sequence on this layer's GPU: conv FP32 [conv_dim, K], recurrent FP32
        [H, D, D]."""
        import cupy

        with cupy.cuda.Device(self.qkv_weight.device.id):
            return KdaState.zeros(self.config, cupy, np.float32)

    # Input checks: everything is checked before the first launch, so a call that fails leaves
    # the state untouched ---------------------------------------------------------------------
    def _rows_in(self, hidden: Any, what: str, max_rows: int) -> tuple[Any, Any]:
        """(cupy view of hidden [rows, hidden], a function mapping a cupy output back to the
        caller's kind)."""
        import cupy

        back = lambda out: out  # noqa: E731
        if type(hidden).__module__.startswith("torch"):
            import torch

            if hidden.dtype != torch.bfloat16:
                raise TypeError(f"{what}: torch tensor must be torch.bfloat16, got {hidden.dtype}")
            if not hidden.is_cuda:
                raise TypeError(f"{what}: torch tensor must be on a CUDA device, got {hidden.device}")
            hidden = cupy.from_dlpack(hidden.view(torch.int16)).view(bf16_dtype())
            back = lambda out: torch.from_dlpack(out.view(np.int16)).view(torch.bfloat16)  # noqa: E731
        elif isinstance(hidden, np.ndarray):
            if hidden.dtype != ml_dtypes.bfloat16:
                raise TypeError(f"{what}: expected a BF16 array (ml_dtypes.bfloat16), got dtype {hidden.dtype}")
            hidden = to_device_bf16(hidden)
            back = to_host
        elif not isinstance(hidden, cupy.ndarray):
            raise TypeError(f"{what}: expected a CuPy, NumPy or torch BF16 array, got {type(hidden).__name__}")
        if hidden.dtype not in _ROW_DTYPES:
            raise TypeError(f"{what}: expected BF16 (ml_dtypes.bfloat16), got dtype {hidden.dtype}")
        if hidden.ndim == 1:
            hidden = hidden.reshape(1, -1)
        if hidden.ndim != 2 or hidden.shape[1] != self.config.hidden:
            raise ValueError(f"{what}: expected [rows, {self.config.hidden}], got {list(hidden.shape)}")
        rows = hidden.shape[0]
        if not 1 <= rows <= max_rows:
            raise ValueError(f"{what}: {rows} rows; this call takes 1..{max_rows} (workspace max_tokens={self.workspace.max_tokens})")
        if not hidden.flags.c_contiguous:
            raise ValueError(f"{what}: hidden must be C-contiguous")
        if hidden.device.id != self.qkv_weight.device.id:
            raise ValueError(f"{what}: hidden is on device {hidden.device.id}, the layer on {self.qkv_weight.device.id}")
        return hidden, back

    def _check_state(self, state: KdaState, what: str, name: str = "state") -> None:
        """state.require_state for this layer's geometry and device."""
        require_state(state, self.config, self.qkv_weight.device.id, what, name, self._state_shapes)

    # Stages -------------------------------------------------------------------------------
    # The decode weights whose projections run on the low-rank chain's stream (see front_end).
    SIDE_CHAIN_WEIGHTS = ("down_weight", "f_b", "g_b")

    def _project_decode(self, x: Any, weight: Any, out: Any, after_kernel: bool = False,
                        reserved_slots: int = 0, staged: bool = False, x_tiles: Any = None,
                        partial: Any = None, bulk: bool | None = None, x_tiled: bool = False,
                        ready_target: int = 0, counted: Any = None, sums: Any = None) -> int:
        """The projection of every decode-side call (decode, decode_k, batched decode, and
        prefill of <= 16 rows). One kernel, applied to groups of DECODE_ROW_GROUP rows, whose
        per-row arithmetic does not depend on the row count: a row's bits are the same in
        every one of those calls, whatever else shares the launch.

        after_kernel: the previous operation on this stream is the kernel that writes x, so
        the projection may launch as its programmatic dependent (its blocks start and ask L2
        for their first weights while that kernel drains; the same bits). reserved_slots: block
        slots a launch of <= 16 rows leaves to kernels beside it (gemm_rows.launch_plan; no bit
        depends on it). staged: gemm_rows_bf16's staged launch where it applies (no bit depends
        on it either). x_tiles, partial: the bulk-copy sweep's scratch (gemm_rows.gemm_rows_bulk;
        without partial it never splits). bulk: gemm_rows_bf16's choice of that sweep (None: by the
        weight's width, False: never). x_tiled: x_tiles already holds x in the sweep's layout (the
        fused step wrote it; one group of rows only). ready_target: the launch awaits that many
        blocks of the fused step before it counting their outputs out in workspace.outputs_ready
        (gemm_rows_bf16's ready; one group of <= 16 rows only; 0: none). counted:
        gemm_rows_bf16's counted (one group of <= 16 rows only). sums: gemm_rows_bf16's sums (FP32
        [rows, n]). Returns the blocks of the last launch (those `counted` counts)."""
        rows = x.shape[0]
        ready = self.workspace.outputs_ready if ready_target else None
        blocks = 0
        for start in range(0, rows, DECODE_ROW_GROUP):
            stop = min(rows, start + DECODE_ROW_GROUP)
            blocks = gemm_rows.gemm_rows_bf16(x[start:stop], weight, out[start:stop], rows=stop - start,
                                              programmatic=after_kernel or start > 0, reserved_slots=reserved_slots,
                                              staged=staged, bulk=bulk, x_tiles=x_tiles, partial=partial,
                                              x_tiled=x_tiled and rows <= DECODE_ROW_GROUP, ready=ready,
                                              ready_target=ready_target, counted=counted,
                                              sums=None if sums is None else sums[start:stop])
        return blocks

    def _project(self, x: Any, weight: str, out: Any, wide: bool, after_kernel: bool = False,
                 reserved_slots: int = 0, staged: bool = False, x_tiles: Any = None, counted: Any = None,
                 sums: Any = None) -> int:
        """x @ the weight named `weight` (one of DECODE_WEIGHTS) into out. x_tiles: the bulk-copy
        sweep's tile scratch of a projection on a stream of its own (None: its stream's own). counted
        (decode side only): see _project_decode, whose count of blocks it returns (0 on cuBLAS). sums:
        FP32 [rows, n] that also receives the unrounded result (out its BF16 rounding)."""
        if wide:
            # Prefill only: cuBLAS reassociates, which no bit-exact path may see.
            if sums is None:
                ops.gemm_bf16_cublas(x, getattr(self, weight), out)
            else:
                ops.gemm_bf16_cublas(x, getattr(self, weight), sums)
                ops.round_to_bf16(sums, out)
            return 0
        else:
            ws = self.workspace
            side = weight in self.SIDE_CHAIN_WEIGHTS
            tiles, partial = (ws.x_tiles_side, None) if side else (ws.x_tiles, ws.bulk_partial)
            x_tiles = tiles if x_tiles is None else x_tiles
            x_tiled = weight == "o_proj" and self._x_tiles_rows == x.shape[0]
            ready_target = self._o_proj_ready if weight == "o_proj" else 0
            self._x_tiles_rows = self._o_proj_ready = 0
            staged = staged or bool(ready_target and OUT_PROJ_STAGED_AWAITING)
            return self._project_decode(x, self.decode_weight(weight), out, after_kernel, reserved_slots, staged,
                                        x_tiles, partial, bulk=SIDE_CHAIN_BULK if side else None, x_tiled=x_tiled,
                                        ready_target=ready_target, counted=counted, sums=sums)

    def gate_source(self, first: int = 0) -> chunk_tc.GateSource:
        """Workspace rows first.. of what the forget gate and beta are formed from."""
        ws = self.workspace
        return chunk_tc.GateSource(ws.forget_proj[first:], self.dt_bias, self.a_log,
                                   ws.down_proj[first:, 2 * self.config.head_dim :])

    def gate_beta(self, rows: int, first: int = 0) -> None:
        """Forget gate [rows, H, D] and beta [rows, H] (FP32) of workspace rows first.. from
        forget_proj and the b_proj columns of down_proj, in one pass."""
        ws, c = self.workspace, self.config
        ops.gate_beta_f32(*self.gate_source(first), ws.gate[first:], ws.beta[first:], c.heads, c.head_dim,
                          c.bounded, c.gate_lower_bound or 0.0, tokens=rows)

    def front_end(self, hidden: Any, wide: bool = False, gate: bool = True) -> None:
        """Projections, forget gate, beta and output gate of `rows` hidden rows. A prefill
        passes gate=False: its chunk_core forms the gate (see KdaLayer.fused_gate).

        On the decode side the low-rank chain (down_proj -> forget_proj -> gate, beta; and
        out_gate) runs on a second, higher-priority stream beside the q|k|v projection, which
        streams most of the weight bytes: in a captured graph the two are parallel branches
        that join before the conv. Above GATE_BRANCH_MIN_ROWS rows out_gate's projection forks
        from that chain after down_proj onto a third stream, beside forget_proj's. The same
        kernels, the same inputs: no bit changes."""
        ws, rows = self.workspace, hidden.shape[0]
        concurrent = not wide and not kernels.TIMER.active
        branched = concurrent and GATE_BRANCH_MIN_ROWS is not None and rows > GATE_BRANCH_MIN_ROWS

        def project_qkv() -> None:
            self._project(hidden, "qkv_weight", ws.qkv_proj[:rows], wide, reserved_slots=QKV_RESERVED_SLOTS)

        with self._beside(concurrent) as side:
            if not SIDE_CHAIN_FIRST:
                project_qkv()
            with side:
                self._low_rank_chain(hidden, wide, gate, branched)
            if SIDE_CHAIN_FIRST:
                project_qkv()

    def _low_rank_chain(self, hidden: Any, wide: bool, gate: bool, branched: bool) -> None:
        """down_proj, forget_proj (then the gate and beta where `gate`) and out_gate of hidden's rows on
        the current stream; `branched`: out_gate's projection forks after down_proj onto a stream of its
        own (see front_end). f_b and g_b after their inputs' kernels launch as programmatic dependents
        where SIDE_CHAIN_PROGRAMMATIC."""
        ws, rows, d = self.workspace, hidden.shape[0], self.config.head_dim
        chained = SIDE_CHAIN_PROGRAMMATIC

        def project_out_gate(after_kernel: bool, x_tiles: Any = None) -> None:
            self._project(ws.down_proj[:rows, d : 2 * d], "g_b", ws.out_gate[:rows], wide, after_kernel=after_kernel,
                          x_tiles=x_tiles)

        self._project(hidden, "down_weight", ws.down_proj[:rows], wide)
        if self._gate_up_pair(rows, wide, branched):
            gemm_rows.gemm_rows_pair_bf16(ws.down_proj[:rows, :d], self.decode_weight("f_b"), ws.forget_proj[:rows],
                                          ws.down_proj[:rows, d : 2 * d], self.decode_weight("g_b"),
                                          ws.out_gate[:rows], programmatic=chained)
            if gate:
                self.gate_beta(rows)
            return
        with self._beside(branched, branch=1) as gate_side:
            if branched:
                with gate_side:
                    project_out_gate(False, ws.x_tiles_gate)
            self._project(ws.down_proj[:rows, :d], "f_b", ws.forget_proj[:rows], wide, after_kernel=chained)
            if gate:
                self.gate_beta(rows)
            if not branched:
                project_out_gate(chained)

    def _gate_up_pair(self, rows: int, wide: bool, branched: bool) -> bool:
        """Whether the low-rank chain of `rows` rows runs f_b and g_b as one launch (GATE_UP_PAIR: up
        to 16 rows of packed weights, not branched)."""
        return (GATE_UP_PAIR and not wide and not branched and rows <= gemm_rows.M_TILE
                and all(isinstance(self.decode_weight(name), gemm_rows.PackedWeight) for name in ("f_b", "g_b")))

    def _o_proj_awaits_step(self, rows: int) -> bool:
        """Whether the output projection of a fused step of `rows` rows (one launch, workspace rows
        0..rows-1) awaits the step's count of outputs (OUT_PROJ_AWAITS_STEP): gemm_rows' sweep of one
        group of <= 16 rows of a packed weight."""
        w = self.decode_weight("o_proj")
        return OUT_PROJ_AWAITS_STEP and rows <= gemm_rows.M_TILE and isinstance(w, gemm_rows.PackedWeight)

    @contextlib.contextmanager
    def _beside(self, concurrent: bool, branch: int = 0):
        """Yields the stream for work that may run beside the current stream's next launches:
        stream number `branch` of this layer's extra streams (SIDE_STREAM_PRIORITY), which
        starts after everything issued so far on the current stream and which the current
        stream waits for on exit (fork and join), or, when not `concurrent`, the current
        stream itself. A branch must not be the current stream (nest with a higher number)."""
        import cupy

        main = cupy.cuda.get_current_stream()
        if not concurrent:
            yield main
            return
        known = self._branches.get(branch)
        if known is None or known[0] != SIDE_STREAM_PRIORITY:
            # Lower is more urgent; CUDA clamps it to the device's greatest priority.
            options = {} if SIDE_STREAM_PRIORITY is None else {"priority": SIDE_STREAM_PRIORITY}
            known = (SIDE_STREAM_PRIORITY, cupy.cuda.Stream(non_blocking=True, **options),
                     cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
            self._branches[branch] = known
        _, side, fork, join = known
        fork.record(main)
        side.wait_event(fork)
        try:
            yield side
        finally:
            join.record(side)
            main.wait_event(join)

    def stateful_rows(self, first: int, rows: int, conv_state: Any, recurrent_state: Any, slots: Any = None,
                      walk: bool = False, inputs_ready: Any = None, whole: bool = False,
                      inputs_target: int = 1) -> None:
        """Decode's stateful half for workspace rows first..first+rows-1, updating the states
        in place. Row r uses slot slots[r] of a pool, or (slots None, rows == 1) the single
        state given; walk=True: the rows are consecutive tokens of the single state given,
        walked in one launch (fused_decode only).

        With `fused_decode` (the default) one launch forms conv + SiLU + L2, the gate and beta,
        the recurrent step and the gated norm (o_norm_out), so the front end must skip the gate
        and the back end the norm (see :meth:`decode_rows`). Otherwise conv (+ SiLU + L2) then
        one recurrent step, reading the gate the front end formed; q and k arrive normalised and
        the recurrent step must not normalise them again. inputs_ready (fused_decode only): the
        step awaits q|k|v from another stream (ops.kda_decode_fused_bf16's inputs_ready and
        inputs_target). whole: these are all the rows the next back_end projects (first 0), so its
        o_proj may await the step's count of outputs (OUT_PROJ_AWAITS_STEP)."""
        ws, c = self.workspace, self.config
        sl = slice(first, first + rows)
        self._x_tiles_rows = self._o_proj_ready = 0
        if self.fused_decode:
            counted = whole and first == 0 and self._o_proj_awaits_step(rows)
            if inputs_ready is None:
                dependents_after = STEP_DEPENDENTS_AFTER
            elif not counted:
                dependents_after = max(STEP_DEPENDENTS_AFTER, 1)
            elif OUT_PROJ_STAGED_AWAITING and gemm_rows.staged_applies(self.decode_weight("o_proj"), rows,
                                                                       awaiting=True):
                dependents_after = AWAITING_STEP_DEPENDENTS_AFTER
            else:
                dependents_after = AWAITING_UNSTAGED_DEPENDENTS_AFTER
            d = c.head_dim
            # The output projection's input in its sweep's tile layout, where that sweep will read it.
            tiles = (STEP_WRITES_X_TILES and first == 0 and not walk and rows <= DECODE_ROW_GROUP
                     and self._o_proj_sums is None and gemm_rows.bulk_applies(self.decode_weight("o_proj"), rows))
            blocks = ops.kda_decode_fused_bf16(
                conv_state, recurrent_state, ws.qkv_proj[sl], self.conv_weight, ws.forget_proj[sl], self.dt_bias,
                self.a_log, ws.down_proj[sl, 2 * d :], ws.out_gate[sl], self.o_norm, ws.conv_out[sl], ws.query[sl],
                ws.key[sl], ws.value[sl], ws.gate[sl], ws.beta[sl], ws.core[sl], ws.o_norm_out[sl],
                bounded=c.bounded, lower_bound=c.gate_lower_bound or 0.0, scale=self.scale, l2_eps=c.l2_eps,
                norm_eps=c.rms_norm_eps, slots=slots, tokens=rows if walk else 1,
                prefetch_ahead=self._step_prefetch_ahead(),
                dependents_after=dependents_after,
                staged=STEP_STAGED_STATE, carveout=STEP_STAGED_CARVEOUT,
                split=self._step_split(1 if walk else rows), x_tiles=ws.x_tiles if tiles else None,
                inputs_ready=inputs_ready, inputs_target=inputs_target,
                outputs_ready=ws.outputs_ready if counted else None)
            self._x_tiles_rows = rows if tiles else 0
            self._o_proj_ready = blocks if counted else 0
            return
        if walk or inputs_ready is not None:
            raise ValueError("stateful_rows: walk=True and inputs_ready need fused_decode")
        ops.conv_decode_silu_l2_bf16(conv_state, ws.qkv_proj[sl], self.conv_weight, ws.conv_out[sl],
                                     ws.query[sl], ws.key[sl], ws.value[sl], c.heads, c.head_dim, c.l2_eps, slots=slots)
        ops.kda_recurrent_step_f32(ws.query[sl], ws.key[sl], ws.value[sl], ws.gate[sl], ws.beta[sl],
                                   recurrent_state, ws.core[sl], self.scale, slots=slots)

    def _step_split(self, sequences: int) -> bool:
        """Whether a fused step of `sequences` sequences splits its heads (STEP_SPLIT_WAVES)."""
        if STEP_SPLIT_WAVES is None:
            return False
        resident = _step_resident_blocks(self.qkv_weight.device.id)
        return sequences * self.config.heads * ops.HEAD_SPLIT <= STEP_SPLIT_WAVES * resident

    def _step_prefetch_ahead(self) -> int:
        """Sequences ahead whose state a batched fused step asks L2 for (STEP_PREFETCH_WAVES)."""
        if STEP_PREFETCH_WAVES <= 0:
            return 0
        resident = _step_resident_blocks(self.qkv_weight.device.id)
        return max(1, round(STEP_PREFETCH_WAVES * resident / self.config.heads))

    def decode_rows(self, hidden: Any, conv_state: Any, recurrent_state: Any, *, slots: Any = None,
                    sequential: bool = False, snapshots: Sequence[KdaState] = ()) -> None:
        """Every launch of a decode-side call on hidden [rows, hidden] BF16, output in
        workspace.final_out[:rows]: the front end, the stateful half, the back end.

        sequential: the rows are consecutive tokens of ONE sequence (decode_k), snapshots[i] (if
        given) receiving the state after row i. With fused_decode and no snapshots one launch
        walks them all (the states stay in registers from the first row to the last); else one
        launch per row, the snapshot copies between them. Otherwise each row is one token of
        its own sequence, row r advancing slot slots[r] of a pool."""
        rows = hidden.shape[0]
        if self._persistent_applies(rows, sequential, snapshots):
            with _section("persistent"):
                persistent.launch(self, hidden, conv_state, recurrent_state, slots)
            return
        if self._awaits_projection(rows, sequential, snapshots):
            self._decode_awaiting_projection(hidden, conv_state, recurrent_state, slots)
            return
        with _section("front_end"):
            self.front_end(hidden, gate=not self.fused_decode)
        with self._words_cleared_on_error("outputs_ready"):
            with _section("recurrence"):
                if sequential and self.fused_decode and not snapshots:
                    self.stateful_rows(0, rows, conv_state, recurrent_state, walk=True, whole=True)
                elif sequential:
                    for row in range(rows):
                        self.stateful_rows(row, 1, conv_state, recurrent_state)
                        if row < len(snapshots):
                            snapshots[row].conv[...] = conv_state
                            snapshots[row].recurrent[...] = recurrent_state
                else:
                    self.stateful_rows(0, rows, conv_state, recurrent_state, slots=slots, whole=True)
            with _section("back_end"):
                self.back_end(rows, norm=not self.fused_decode)

    @contextlib.contextmanager
    def _words_cleared_on_error(self, *names: str):
        """On an error between a kernel that counts into the workspace's words `names` (inputs_ready:
        q|k|v's signal; outputs_ready: a fused step counting its outputs out) and the kernel that
        awaits them and sets them back to zero (eager launches; a failed capture launches nothing):
        those words back to zero here, on the current stream, so that no later launch takes a count
        for its own, and no o_proj awaits a step that did not count."""
        try:
            yield
        except BaseException:
            import cupy

            self._o_proj_ready = 0
            if not cupy.cuda.get_current_stream().is_capturing():
                for name in names:
                    getattr(self.workspace, name).fill(0)
            raise

    def _awaits_projection(self, rows: int, sequential: bool, snapshots: Sequence[KdaState]) -> bool:
        """Whether a decode-side call of `rows` rows runs as _decode_awaiting_projection: one row
        without snapshots, the fused step of one block per head, concurrent launches (not while
        timing)."""
        return (STEP_AWAITS_PROJECTION and self.fused_decode and not snapshots and rows == 1
                and not self._step_split(1) and not kernels.TIMER.active)

    def _decode_awaiting_projection(self, hidden: Any, conv_state: Any, recurrent_state: Any, slots: Any) -> None:
        """decode_rows of one row with the fused step awaiting q|k|v (STEP_AWAITS_PROJECTION):
        on this stream q|k|v, its blocks counting their outputs out (QKV_COUNTS_INPUTS; else
        ops.signal_inputs_ready after it); on the side stream (the more urgent one) the low-rank
        chain, the fused step (the chain's programmatic dependent, awaiting that count) and o_proj;
        then the side stream joins this one.

        Every block of q|k|v, of the signal and of the step must be able to be resident at once
        (the step's blocks wait on their SMs): q|k|v leaves at least a slot per head and one more,
        and is issued first. The words are set back to zero by the step (and by o_proj, those it
        awaits), or here if a launch fails between the two."""
        ws = self.workspace
        # Cleared after the join: the signal may have been launched without the step that clears
        # it, or the step without the o_proj that clears its count.
        with self._words_cleared_on_error("inputs_ready", "outputs_ready"):
            with self._beside(True) as side:
                reserved = max(QKV_RESERVED_SLOTS, self.config.heads + 1)
                counts = QKV_COUNTS_INPUTS and isinstance(self.decode_weight("qkv_weight"), gemm_rows.PackedWeight)
                blocks = self._project(hidden, "qkv_weight", ws.qkv_proj[:1], False, reserved_slots=reserved,
                                       counted=ws.inputs_ready if counts else None)
                if not counts:
                    ops.signal_inputs_ready(ws.inputs_ready)
                with side:
                    self._low_rank_chain(hidden, wide=False, gate=False, branched=False)
                    self.stateful_rows(0, 1, conv_state, recurrent_state, slots=slots, inputs_ready=ws.inputs_ready,
                                       whole=True, inputs_target=blocks if counts else 1)
                    self.back_end(1, norm=False)

    def _persistent_applies(self, rows: int, sequential: bool, snapshots: Sequence[KdaState]) -> bool:
        """Whether a decode-side call of `rows` rows runs as the one persistent launch: one
        sequence (rows consecutive tokens, or one row of a pool), no snapshots, 1..16 rows."""
        if not (self.persistent_decode and self.fused_decode) or snapshots or self._o_proj_sums is not None:
            return False
        if not (sequential or rows == 1) or rows > persistent.MAX_ROWS:
            return False
        return self.config.heads % 2 == 0

    def back_end(self, rows: int, wide: bool = False, norm: bool = True) -> None:
        """Gated RMSNorm of core into o_norm_out (skipped with norm=False: the fused decode
        step wrote it), then o_proj into final_out (and its FP32 sums into o_proj_sums, where set)."""
        ws, c = self.workspace, self.config
        if norm:
            ops.gated_rmsnorm_sigmoid_bf16(ws.core, ws.out_gate, self.o_norm, ws.o_norm_out, c.heads, c.head_dim,
                                           c.rms_norm_eps, tokens=rows)
        sums = self._o_proj_sums
        self._project(ws.o_norm_out[:rows], "o_proj", ws.final_out[:rows], wide, after_kernel=True,
                      staged=OUT_PROJ_STAGED, sums=None if sums is None else sums[:rows])

    def prefill_core(self, tokens: int, conv_state: Any, recurrent_state: Any, pad_value: float | None = 0.0,
                     first: int = 0) -> None:
        """The stateful middle of a prefill for workspace rows first..first+T-1: from qkv_proj
        [T, 3*qkv] BF16, forget_proj [T, qkv] and the beta logits (down_proj) to conv_out, query,
        key, value, gate, beta and core [T, H, D] FP32. conv + SiLU + L2 + split in one pass
        (conv_state [3*qkv, K] FP32 in place), then :meth:`chunk_core` (gate, beta and the
        chunked delta rule from the carried recurrent_state [H, D, D] FP32, in place). The chunk
        kernels never read past row T-1 of their sequence: the padded tail of the last chunk is
        filled with `pad_value` (tests poison it) or, with None, left as it is (packed prefill,
        where those rows belong to the next sequence). The chunk scratch is per call, from its
        row 0."""
        ws, c = self.workspace, self.config
        rows = slice(first, None)
        query, key, value, gate, beta, core = (buf[rows] for buf in (ws.query, ws.key, ws.value, ws.gate,
                                                                      ws.beta, ws.core))
        ops.conv_prefill_silu_l2_bf16(conv_state, ws.qkv_proj[rows], self.conv_weight, ws.conv_out[rows], query,
                                      key, value, c.heads, c.head_dim, c.l2_eps, tokens=tokens)
        padded = ops.chunk_count(tokens, c.chunk) * c.chunk
        if pad_value is not None and padded > tokens:
            for buf in (query, key, value, gate, beta):
                buf[tokens:padded].fill(pad_value)
        self.chunk_core(tokens, recurrent_state, first)

    def chunk_core(self, tokens: int, recurrent_state: Any, first: int = 0) -> None:
        """Conv output to core output for workspace rows first..first+T-1: the forget gate
        and beta (gate [T, H, D], beta [T, H] FP32, from forget_proj and down_proj), then the
        chunked delta rule from query, key, value to core [T, H, D] FP32, the recurrent_state
        [H, D, D] FP32 carried in place, on the chunk implementation of `chunk_impl`. The gate
        kernel runs first, unless `fused_gate` has the tensor-core prepare form the gate itself
        (the same bits)."""
        ws, c = self.workspace, self.config
        rows = slice(first, None)
        query, key, value, gate, beta, core = (buf[rows] for buf in (ws.query, ws.key, ws.value, ws.gate,
                                                                      ws.beta, ws.core))
        if self._chunk_impl == "tensor":
            lower_bound = chunk_tc.prepare_lower_bound(c)
            fused = self.fused_gate and lower_bound is not None
            if not fused:
                self.gate_beta(tokens, first)
            chunk_tc.chunk_prefill_tc(query, key, value, gate, beta, recurrent_state, core, tokens,
                                      lower_bound, ws.q_decay_f16, ws.k_tail_f16, ws.chunk_w_f16,
                                      ws.chunk_u, ws.attn_f16, ws.chunk_decay, scale=self.scale,
                                      gate_source=self.gate_source(first) if fused else None)
        else:
            self.gate_beta(tokens, first)
            ops.kda_chunk_prepare_f32(query, key, value, gate, beta, ws.q_decay, ws.k_tail, ws.chunk_w, ws.chunk_u,
                                      ws.attn, ws.chunk_decay, tokens, c.chunk, self.scale)
            ops.kda_chunk_scan_f32(ws.q_decay, ws.k_tail, ws.chunk_w, ws.chunk_u, ws.attn, ws.chunk_decay,
                                   recurrent_state, core, tokens, c.chunk)

    # Calls ----------------------------------------------------------------------------------
    def prefill(self, hidden: Any, state: KdaState | StatePool, pad_value: float = 0.0, *, slots: Any = None,
                cu_seqlens: Sequence[int] | None = None) -> Any:
        """Chunked prefill of hidden [T, hidden] BF16 from the carried `state` (updated in place).

        Returns the block output [T, hidden] BF16 (a new array). `pad_value` fills the padded
        tail of the last chunk in the q/k/v/gate/beta buffers; the chunk kernels must ignore it
        (tests poison it with NaN and 1e30). A packed prefill leaves those rows as they are (they
        hold the next sequence's rows) and ignores pad_value.

        Packed sequences: prefill(hidden [sum T_i, hidden], pool, slots=[N], cu_seqlens=[N+1])
        prefills N sequences of a StatePool at once, sequence i being rows
        cu_seqlens[i]..cu_seqlens[i+1]-1 (host ints, 0 first, strictly increasing) and
        advancing slot slots[i] (distinct). The projections and the back end run once over
        all rows; the conv and the chunked delta rule run per sequence, so no state or chunk
        crosses a sequence boundary. Each sequence equals its own prefill within the oracle
        bounds (not bit for bit: the projections of a short sequence alone take the
        decode-side kernel).
        """
        if isinstance(state, StatePool):
            return self._prefill_packed(hidden, state, slots, cu_seqlens)
        if slots is not None or cu_seqlens is not None:
            raise TypeError("prefill: slots and cu_seqlens only apply to a StatePool")
        hidden, back = self._rows_in(hidden, "prefill", self.workspace.max_tokens)
        self._check_state(state, "prefill")
        ws, tokens = self.workspace, hidden.shape[0]
        wide = tokens > GEMV_MAX_ROWS
        with _section("front_end"):
            self.front_end(hidden, wide, gate=False)
        with _section("recurrence"):
            self.prefill_core(tokens, state.conv, state.recurrent, pad_value)
        with _section("back_end"):
            self.back_end(tokens, wide)
        return back(copy_of(ws.final_out[:tokens]))

    def _prefill_packed(self, hidden: Any, pool: StatePool, slots: Any, cu_seqlens: Sequence[int] | None) -> Any:
        hidden, back = self._rows_in(hidden, "prefill", self.workspace.max_tokens)
        self._check_pool(pool, "prefill")
        rows = hidden.shape[0]
        if cu_seqlens is None:
            raise ValueError("prefill with a StatePool needs cu_seqlens ([N+1] cumulative lengths) and slots ([N])")
        bounds = np.asarray(cu_seqlens.get() if hasattr(cu_seqlens, "get") else cu_seqlens)
        if bounds.ndim != 1 or bounds.size < 2 or not np.issubdtype(bounds.dtype, np.integer):
            raise ValueError(f"cu_seqlens: expected [N+1] integers (N >= 1), got {bounds.dtype} {list(bounds.shape)}")
        bounds = bounds.astype(np.int64)  # (the differences of unsigned bounds would wrap, not go negative)
        lengths = np.diff(bounds)
        if bounds[0] != 0 or bounds[-1] != rows or (lengths < 1).any():
            raise ValueError(f"cu_seqlens: must start at 0, end at the {rows} rows of hidden and strictly increase; "
                             f"got {bounds.tolist()}")
        host_slots = self._host_slots(slots, len(lengths), pool, "prefill")
        ws, wide = self.workspace, rows > GEMV_MAX_ROWS
        with _section("front_end"):
            self.front_end(hidden, wide, gate=False)
        with _section("recurrence"):
            for first, tokens, slot in zip(bounds[:-1].tolist(), lengths.tolist(), host_slots.tolist()):
                self.prefill_core(tokens, pool.conv[slot], pool.recurrent[slot], pad_value=None, first=first)
        with _section("back_end"):
            self.back_end(rows, wide)
        return back(copy_of(ws.final_out[:rows]))

    def _check_pool(self, pool: StatePool, what: str) -> None:
        conv, recurrent = pool.conv, pool.recurrent
        if conv.shape[1:] != self._state_shapes[0] or recurrent.shape[1:] != self._state_shapes[1]:
            raise ValueError(f"{what}: the pool's states [{list(conv.shape[1:])}, {list(recurrent.shape[1:])}] "
                             f"do not fit {self.config.describe()}")
        require_device_buffers(what, "pool", conv, recurrent, self.qkv_weight.device.id)

    @staticmethod
    def _host_slots(slots: Any, count: int, pool: StatePool, what: str) -> np.ndarray:
        """Host int slots [count], checked: in the pool, no slot twice."""
        if slots is None:
            raise ValueError(f"{what} with a StatePool needs slots (one per sequence)")
        host = np.asarray(slots.get() if hasattr(slots, "get") else slots)
        if host.shape != (count,) or not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slots: expected {count} integer slots, got {host.dtype} {list(host.shape)}")
        if host.min() < 0 or host.max() >= len(pool):
            raise ValueError(f"slots: {host.tolist()} outside this pool of {len(pool)} slots")
        if len(set(host.tolist())) != count:
            raise ValueError(f"slots: {host.tolist()} repeats a slot; each sequence must advance its own state")
        return host

    def graph_variant(self) -> tuple:
        """What a graph captured of this layer's decode-side calls depends on besides the pointers
        of its states: the step's form (fused_decode, persistent_decode), the weights and settings
        its launches baked in (the generation of this layer's graphs, advanced wherever those
        change: packed_decode, o_proj_sums) and the workspace. A driver holding graphs of its own
        that replay this layer's launches (a tensor-parallel rank group) keys them on it too."""
        return (self.fused_decode, self.persistent_decode, self._graphs.generation, self.workspace.serial)

    def decode(self, hidden: Any, state: KdaState | StatePool, slots: Any = None) -> Any:
        """One token per sequence.

        decode(hidden_row [1, hidden] or [hidden], state): one sequence, state in place.
        decode(hidden [B, hidden], pool, slots): B sequences of a StatePool advance one token
        each, weights read once for all B; slots [B] (host ints or a device int32 array,
        distinct) names each row's slot. A sequence's bits do not depend on B or on the other
        rows. Returns [rows, hidden] BF16.
        """
        if isinstance(state, StatePool):
            return self._decode_pool(hidden, state, slots)
        if slots is not None:
            raise TypeError("decode: slots only apply to a StatePool")
        require_one_row("decode", hidden)
        return self.decode_k(hidden, state)

    def decode_k(self, hidden_rows: Any, state: KdaState, snapshots: Sequence[KdaState] | None = None) -> Any:
        """K rows (1..16) of ONE sequence: projections in one weight sweep, the recurrence
        walked row by row. Bit-identical to K calls of decode.

        `snapshots`, if given, holds up to K states (layer.new_state()); snapshots[i] receives
        the state after row i, what a partial accept rolls back to.
        """
        hidden_rows, back = self._rows_in(hidden_rows, "decode_k", min(GEMV_MAX_ROWS, self.workspace.max_tokens))
        self._check_state(state, "decode_k")
        rows = hidden_rows.shape[0]
        snapshots = list(snapshots or [])
        if len(snapshots) > rows:
            raise ValueError(f"decode_k: {len(snapshots)} snapshots for {rows} rows")
        for i, snap in enumerate(snapshots):
            self._check_state(snap, "decode_k", f"snapshots[{i}]")

        def body(hidden: Any, _slots: Any) -> None:
            self.decode_rows(hidden, state.conv, state.recurrent, sequential=True, snapshots=snapshots)

        key = ("k", rows, *self.graph_variant(), state.conv.data.ptr, state.recurrent.data.ptr,
               tuple([(s.conv.data.ptr, s.recurrent.data.ptr) for s in snapshots]) if snapshots else ())
        return back(self._graphs.run(key, hidden_rows, None, body))

    def _decode_pool(self, hidden: Any, pool: StatePool, slots: Any) -> Any:
        import cupy

        max_rows = min(MAX_DECODE_ROWS, self.workspace.max_tokens, len(pool))
        hidden, back = self._rows_in(hidden, "decode", max_rows)
        rows = hidden.shape[0]
        self._check_pool(pool, "decode")
        if isinstance(slots, cupy.ndarray):
            # Device slots are not read back (that would synchronise every step): their range
            # and uniqueness are the caller's promise.
            if slots.dtype != _I32 or slots.shape != (rows,):
                raise ValueError(f"slots: expected a device int32 array of {rows} entries, got {slots.dtype} {list(slots.shape)}")
        else:
            # Checked here, then uploaded straight into the graph's slot buffer (DecodeGraphs.run).
            slots = np.ascontiguousarray(self._host_slots(slots, rows, pool, "decode"), np.int32)

        def body(hidden: Any, device_slots: Any) -> None:
            self.decode_rows(hidden, pool.conv, pool.recurrent, slots=device_slots)

        key = ("pool", rows, *self.graph_variant(), pool.conv.data.ptr, pool.recurrent.data.ptr)
        return back(self._graphs.run(key, hidden, slots, body))


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src for two CuPy arrays of one shape and dtype, on the current stream: one
    asynchronous device-to-device memcpy where both are C-contiguous (a decode call's input
    rows and slots), else an element-wise copy kernel. The memcpy is an API call, not a kernel
    launch through CuPy's element-wise machinery: a few us less host time per decode call."""
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


class GraphIO:
    """The workspace's fixed buffers that a graphed call of `rows` rows reads and writes, sliced
    once: its input rows (graph_hidden), slots (graph_slots) and output rows (final_out), with
    their device pointers and sizes."""

    __slots__ = ("hidden", "slots", "out", "hidden_ptr", "slots_ptr", "out_ptr", "hidden_bytes", "slots_bytes",
                 "out_bytes")

    def __init__(self, ws: KdaWorkspace, rows: int):
        self.hidden, self.slots, self.out = ws.graph_hidden[:rows], ws.graph_slots[:rows], ws.final_out[:rows]
        self.hidden_ptr, self.slots_ptr, self.out_ptr = (a.data.ptr for a in (self.hidden, self.slots, self.out))
        self.hidden_bytes, self.slots_bytes, self.out_bytes = (a.nbytes for a in (self.hidden, self.slots, self.out))


class PinnedUploads:
    """Small host-to-device copies issued without synchronising: a few pinned host buffers used
    in turn, each reused only once the copy that last read it has run. (A copy from pageable
    memory may wait for the stream; one from a freed pinned buffer may read what the next
    call wrote there.)"""

    def __init__(self, nbytes: int, count: int = 4):
        import cupy

        self.nbytes = nbytes
        self.buffers = [cupy.cuda.alloc_pinned_memory(nbytes) for _ in range(count)]
        self.events = [cupy.cuda.Event(disable_timing=True) for _ in range(count)]
        self.pending = [False] * count
        self.turn = 0

    def upload(self, dst_ptr: int, host: np.ndarray, stream: Any) -> None:
        """Copy C-contiguous `host` (at most nbytes) to device address dst_ptr on `stream`."""
        import cupy

        if host.nbytes > self.nbytes:
            raise ValueError(f"PinnedUploads: {host.nbytes} bytes over the {self.nbytes} of a buffer")
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        if self.pending[i]:
            self.events[i].synchronize()
        buffer = self.buffers[i]
        np.frombuffer(buffer, np.uint8, host.nbytes)[:] = host.view(np.uint8).reshape(-1)
        cupy.cuda.runtime.memcpyAsync(dst_ptr, buffer.ptr, host.nbytes, _HOST_TO_DEVICE, stream.ptr)
        self.events[i].record(stream)
        self.pending[i] = True

    def drain(self) -> None:
        """Wait for every copy still reading a buffer (before the buffers are let go)."""
        for event, pending in zip(self.events, self.pending):
            if pending:
                event.synchronize()
        self.pending = [False] * len(self.buffers)


class CapturedGraph:
    """One captured decode call: its CUDA graph and, where the call's copies are nodes of it,
    their GraphCopies (which keep the last call's arrays referenced). launch() replays it with
    the addresses its last call set: what the benchmarks time alone."""

    __slots__ = ("graph", "copies")

    def __init__(self, graph: Any, copies: graph_copies.GraphCopies | None):
        self.graph = graph
        self.copies = copies

    def launch(self, stream: Any) -> None:
        self.graph.launch(stream)


class DecodeGraphs:
    """CUDA graphs of the decode-side calls, captured once per shape and state, replayed after.

    A call's key holds its kind, its row count and the device pointers it touches besides the
    workspace (state, snapshots, pool). The first call of a key runs eagerly (so every kernel
    is compiled and every wrapper check has passed), the second captures the call on a side
    stream, and from then on each call is one graph launch between two copies: its input rows
    (and slots) into the workspace's fixed input buffers, and the output rows into a new array.
    A new state object, pool or workspace has new pointers and so a new key: it is captured
    afresh; the oldest graphs are dropped past `capacity`. Slots live in a device buffer, so
    sequences entering and leaving a pool never cause a recapture. Set `enabled = False` for
    eager launches; timing (glm_kda.kernels.timing) also runs eagerly.

    The host's work per replayed call is kept to those copies and the launch (the buffers of
    each row count are sliced once, see GraphIO), so that a decode loop that does not
    synchronise each token is bound by the GPU's time, not by Python's
    (benchmarks/host_cost.py measures both).
    """

    def __init__(self, layer: "KdaLayer", capacity: int = 64):
        self.layer = layer
        self.enabled = True
        self.capacity = capacity
        self.graphs: dict[tuple, CapturedGraph] = {}
        self.seen: set[tuple] = set()
        self.captures = 0
        self.last_graph: CapturedGraph | None = None  # the latest replayed call's (benchmarks time it alone)
        self._io: dict[int, GraphIO] = {}
        self._io_serial = -1
        self._uploads: PinnedUploads | None = None
        # The input and output copies as nodes of each graph (glm_kda.graph_copies), else beside it.
        self.copies_in_graph = GRAPH_COPIES_IN_GRAPH
        self.generation = 0  # advanced by clear(): graphs of other drivers holding this layer's launches key on it

    def io(self, rows: int) -> GraphIO:
        """The current workspace's GraphIO of `rows` rows."""
        ws = self.layer.workspace
        if ws.serial != self._io_serial:
            self._io, self._io_serial = {}, ws.serial
            if self._uploads is not None and self._uploads.nbytes < ws.graph_slots.nbytes:
                self._uploads.drain()  # its pinned buffers go back to the pool: no copy may still read them
                self._uploads = None
        io = self._io.get(rows)
        if io is None:
            io = self._io[rows] = GraphIO(ws, rows)
        return io

    def _slots_in(self, io: GraphIO, slots: Any, stream: Any) -> None:
        """slots (device int32 [rows], or checked host int32 [rows]) into io.slots."""
        import cupy

        if isinstance(slots, np.ndarray):
            if self._uploads is None:
                self._uploads = PinnedUploads(self.layer.workspace.graph_slots.nbytes)
            self._uploads.upload(io.slots_ptr, slots, stream)
        elif slots.flags.c_contiguous:
            cupy.cuda.runtime.memcpyAsync(io.slots_ptr, slots.data.ptr, io.slots_bytes, _DEVICE_TO_DEVICE, stream.ptr)
        else:
            copy_into(io.slots, slots)

    def run(self, key: tuple, hidden: Any, slots: Any, body) -> Any:
        """Run body(hidden_rows, device_slots) for the C-contiguous BF16 rows `hidden` [rows,
        hidden] (as KdaLayer._rows_in returns them) and slots (None; device int32 [rows]; or host
        int32 [rows], already checked), replaying its graph where there is one. Returns a new
        CuPy array [rows, hidden] holding final_out's rows."""
        import cupy

        rows = hidden.shape[0]
        io = self.io(rows)
        stream = cupy.cuda.get_current_stream()
        graphed = self.enabled and not kernels.TIMER.active
        if slots is not None and (graphed or isinstance(slots, np.ndarray)):
            self._slots_in(io, slots, stream)
            slots = io.slots
        if not graphed:
            body(hidden, slots)
            return self._copy_out(io, stream)
        key = key + (self._io_serial,)
        entry = self.graphs.get(key)
        if entry is None:
            if key not in self.seen:
                # The first call of a key runs eagerly.
                self.seen.add(key)
                self._copy_in(io, hidden, stream)
                body(io.hidden, slots)
                return self._copy_out(io, stream)
            entry = self._capture(key, io, hidden, slots, body)
        self.last_graph = entry
        if entry.copies is not None:
            out = cupy.empty(io.out.shape, io.out.dtype)
            if entry.copies.point(hidden, out):
                entry.launch(stream)
                return out
            # The driver refused to repoint a copy (memory of another kind than at capture, say):
            # from now on the copies run beside the graphs.
            warnings.warn("decode graphs: their copy nodes could not be repointed; the input and output "
                          "copies run as separate operations from now on", RuntimeWarning, stacklevel=3)
            self.copies_in_graph = False
            self.graphs.clear()
            entry = self.last_graph = self._capture(key, io, hidden, slots, body)
        self._copy_in(io, hidden, stream)
        entry.launch(stream)
        return self._copy_out(io, stream)

    @staticmethod
    def _copy_in(io: GraphIO, hidden: Any, stream: Any) -> None:
        import cupy

        cupy.cuda.runtime.memcpyAsync(io.hidden_ptr, hidden.data.ptr, io.hidden_bytes, _DEVICE_TO_DEVICE, stream.ptr)

    @staticmethod
    def _copy_out(io: GraphIO, stream: Any, out: Any = None) -> Any:
        """final_out's rows into `out` (None: a new array), issued on `stream`; returns it."""
        import cupy

        if out is None:
            out = cupy.empty(io.out.shape, io.out.dtype)
        cupy.cuda.runtime.memcpyAsync(out.data.ptr, io.out_ptr, io.out_bytes, _DEVICE_TO_DEVICE, stream.ptr)
        return out

    def _capture(self, key: tuple, io: GraphIO, hidden: Any, slots: Any, body) -> CapturedGraph:
        """Capture body on a side stream and keep it under `key`. With copies_in_graph the
        graph begins with the input copy and ends with the output copy (capture-time addresses:
        hidden's and a scratch array's; each launch repoints them first), else it holds the
        body alone."""
        import cupy

        copies_in_graph = self.copies_in_graph and graph_copies.driver() is not None
        scratch = cupy.empty(io.out.shape, io.out.dtype) if copies_in_graph else None
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            side.begin_capture()
            try:
                if copies_in_graph:
                    self._copy_in(io, hidden, side)
                body(io.hidden, slots)
                if copies_in_graph:
                    self._copy_out(io, side, scratch)
            finally:
                graph = side.end_capture()
        copies = None
        if copies_in_graph:
            copies = graph_copies.GraphCopies.find(graph, io.hidden_ptr, io.out_ptr, (io.hidden_bytes, io.out_bytes))
            if copies is None:
                # Not found or not reachable: this graph's copies would keep their capture-time
                # addresses. Capture again without them, and do so from now on.
                self.copies_in_graph = False
                return self._capture(key, io, hidden, slots, body)
        self.captures += 1
        if len(self.graphs) >= self.capacity:
            self.graphs.pop(next(iter(self.graphs)))
        entry = self.graphs[key] = CapturedGraph(graph, copies)
        return entry

    def clear(self) -> None:
        """Forget every captured graph (the next calls run eagerly once, then recapture with
        the copies as GRAPH_COPIES_IN_GRAPH now says)."""
        self.graphs.clear()
        self.seen.clear()
        self.copies_in_graph = GRAPH_COPIES_IN_GRAPH
        self.generation += 1


def run_demo_on_gpu(path: Path, hidden: np.ndarray, prompt: int, steps: int) -> dict:
    """The demo's GPU half: prefill, then a decode loop; stage buffers gathered per call."""
    import cupy
    from tqdm.auto import tqdm

    layer = KdaLayer.from_pretrained(path, 0, max_tokens=max(prompt, 16))
    state = layer.new_state()
    device_hidden = to_device_bf16(hidden)
    # Warm-up on a scratch state so compile and cuBLAS set-up stay out of the timings.
    scratch = layer.new_state()
    layer.prefill(device_hidden[:prompt], scratch)
    layer.decode(device_hidden[prompt : prompt + 1], scratch)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    layer.prefill(device_hidden[:prompt], state)
    end.record()
    end.synchronize()
    prefill_ms = cupy.cuda.get_elapsed_time(start, end)
    stages = layer.workspace.stages(prompt)
    decoded, total_ms = [], 0.0
    for i in tqdm(range(steps), desc="decode", leave=False):
        start.record()
        layer.decode(device_hidden[prompt + i : prompt + i + 1], state)
        end.record()
        end.synchronize()
        total_ms += cupy.cuda.get_elapsed_time(start, end)
        decoded.append(layer.workspace.stages(1))
    merged = {k: np.concatenate([stages[k]] + [d[k] for d in decoded]) for k in stages}
    return {"path": "cuda", "stages": merged, "prefill_ms": prefill_ms, "decode_ms_per_token": total_ms / max(steps, 1)}

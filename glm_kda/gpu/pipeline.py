"""The stages of one KdaLayer call, in the block's order: the private half of KdaLayer.

Front end (projections), stateful part (the fused decode step, or prefill's conv pass and chunked delta rule)
and back end (prefill's gated RMSNorm, o_proj); how each is scheduled and why decode-side projections never
use cuBLAS: docs/design.md. Each method takes the call's workspace (its stream picks it) explicitly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from . import build, ops, projection
from .arrays import copy_into
from .ops import chunk_tc
from .workspace import KdaWorkspace
from ..chunk_model import prepare_lower_bound
from ..state import KdaState

# Most rows of a decode-side call and of a prefill whose projections run on gemm_rows_bf16.
DECODE_MAX_ROWS = 16
_ROW_GROUP = projection.GEMM_ROWS_MAX_ROWS
# Block slots a q|k|v projection of <= 16 rows leaves free, so the low-rank chain beside it starts at once.
_QKV_RESERVED_SLOTS = 64
# Above this many rows out_gate's projection forks onto a third stream beside forget_proj's.
_GATE_BRANCH_MIN_ROWS = 16
# A batched fused step asks L2 for the states of the blocks this many waves of resident blocks ahead.
_STEP_PREFETCH_WAVES = 0.25
# Blocks of the fused step resident per SM (its __launch_bounds__).
_STEP_RESIDENT_BLOCKS_PER_SM = 2
# The weights the low-rank chain's projections read (they run on its stream, with its scratch).
_SIDE_CHAIN_WEIGHTS = ("down_weight", "f_b", "g_b")


@contextlib.contextmanager
def _section(name: str):
    """CUDA events around a group of launches while timing; free otherwise."""
    timer = build.current_context().timer
    with contextlib.nullcontext() if timer is None else timer.span(f"[{name}]"):
        yield


class Stages:
    """The stage methods of KdaLayer. Expects the layer's weights
    (qkv_weight, down_weight, f_b, g_b, conv_weight, dt_bias, a_log, o_norm, o_proj), config,
    scale, _packed, _o_proj_sums and _chunk_impl."""

    # Projections ----------------------------------------------------------------------------
    def _decode_weight(self, name: str) -> Any:
        """The weight `name` as the decode-side projections read it: its packed copy, else the array."""
        return self._packed.get(name) or getattr(self, name)

    def _project(self, ws: KdaWorkspace, x: Any, weight: str, out: Any, wide: bool, *, after_kernel: bool = False,
                 reserved_slots: int = 0, x_tiles: Any = None, x_tiled: bool = False, ready_target: int = 0,
                 sums: Any = None) -> None:
        """out = x @ the weight named `weight`: cuBLAS where wide, else gemm_rows_bf16 by row groups.
        after_kernel: a programmatic dependent of the kernel writing x; x_tiled, ready_target and sums as
        gemm_rows_bf16's x_tiled, ready (ws.outputs_ready) and sums."""
        if wide:
            ops.gemm_bf16_cublas(x, getattr(self, weight), out if sums is None else sums)
            if sums is not None:
                ops.round_to_bf16(sums, out)
            return
        side = weight in _SIDE_CHAIN_WEIGHTS
        if x_tiles is None:
            x_tiles = ws.x_tiles_side if side else ws.x_tiles
        partial = None if side else ws.bulk_partial
        w = self._decode_weight(weight)
        rows = x.shape[0]
        ready = ws.outputs_ready if ready_target else None
        for start in range(0, rows, _ROW_GROUP):
            stop = min(rows, start + _ROW_GROUP)
            projection.gemm_rows_bf16(x[start:stop], w, out[start:stop], rows=stop - start,
                                      programmatic=after_kernel or start > 0, reserved_slots=reserved_slots,
                                      staged=bool(ready_target), x_tiles=x_tiles, partial=partial,
                                      x_tiled=x_tiled and rows <= _ROW_GROUP, ready=ready, ready_target=ready_target,
                                      sums=None if sums is None else sums[start:stop])

    def _gate_source(self, ws: KdaWorkspace, first: int = 0) -> chunk_tc.GateSource:
        """Workspace rows first.. of what the forget gate and beta are formed from."""
        return chunk_tc.GateSource(ws.forget_proj[first:], self.dt_bias, self.a_log,
                                   ws.down_proj[first:, 2 * self.config.head_dim :])

    def _gate_beta(self, ws: KdaWorkspace, rows: int, first: int = 0, middle_first: int = 0) -> None:
        """Forget gate [rows, H, D] and beta [rows, H] (FP32) of workspace rows first.., into the middle's
        rows middle_first.."""
        c = self.config
        ops.kda_gate_beta_f32(*self._gate_source(ws, first), ws.gate[middle_first:], ws.beta[middle_first:], c.heads,
                              c.head_dim, c.bounded, c.gate_lower_bound or 0.0, tokens=rows)

    def _front_end(self, ws: KdaWorkspace, hidden: Any, wide: bool) -> None:
        """q|k|v, down_proj, forget_proj and out_gate of hidden's rows; on the decode side the low-rank
        chain runs on a side stream (docs/design.md, "Decode front end"). No bit depends on the streams."""
        rows = hidden.shape[0]
        concurrent = not wide and build.current_context().timer is None
        with ws.beside(concurrent) as side:
            with side:
                self._low_rank_chain(ws, hidden, wide, branched=concurrent and rows > _GATE_BRANCH_MIN_ROWS)
            self._project(ws, hidden, "qkv_weight", ws.qkv_proj[:rows], wide, reserved_slots=_QKV_RESERVED_SLOTS)

    def _low_rank_chain(self, ws: KdaWorkspace, hidden: Any, wide: bool, branched: bool) -> None:
        """down_proj, then forget_proj and out_gate: up to 16 rows of packed weights as one paired
        launch; `branched`: out_gate's projection on a stream of its own beside forget_proj's."""
        rows, d = hidden.shape[0], self.config.head_dim
        self._project(ws, hidden, "down_weight", ws.down_proj[:rows], wide)
        f_b, g_b = self._decode_weight("f_b"), self._decode_weight("g_b")
        if (not wide and not branched and rows <= projection.M_TILE
                and isinstance(f_b, projection.PackedWeight) and isinstance(g_b, projection.PackedWeight)):
            projection.gemm_rows_pair_bf16(ws.down_proj[:rows, :d], f_b, ws.forget_proj[:rows],
                                           ws.down_proj[:rows, d : 2 * d], g_b, ws.out_gate[:rows])
            return
        with ws.beside(branched, branch=1) as gate_side:
            if branched:
                with gate_side:
                    self._project(ws, ws.down_proj[:rows, d : 2 * d], "g_b", ws.out_gate[:rows], wide,
                                  x_tiles=ws.x_tiles_gate)
            self._project(ws, ws.down_proj[:rows, :d], "f_b", ws.forget_proj[:rows], wide)
            if not branched:
                self._project(ws, ws.down_proj[:rows, d : 2 * d], "g_b", ws.out_gate[:rows], wide)

    # Decode ---------------------------------------------------------------------------------
    def _step(self, ws: KdaWorkspace, first: int, rows: int, conv_state: Any, recurrent_state: Any, *,
              slots: Any = None, walk: bool = False, whole: bool = False) -> tuple[int, bool]:
        """The fused decode step for workspace rows first..first+rows-1, states in place: row r
        advances slot slots[r] of a pool, or (slots None) the single state given; walk: the rows
        are consecutive tokens of that state, walked in one launch. whole: these are all the rows
        the back end projects next. Returns (blocks o_proj should await, 0 for none; whether the
        step also wrote o_norm_out into ws.x_tiles)."""
        c, d = self.config, self.config.head_dim
        sl = slice(first, first + rows)
        o_proj = self._decode_weight("o_proj")
        # o_proj of one group of <= 16 rows of a packed weight awaits the step's count of outputs, not its end.
        counted = whole and first == 0 and rows <= projection.M_TILE and isinstance(o_proj, projection.PackedWeight)
        tiles = (first == 0 and not walk and rows <= _ROW_GROUP and self._o_proj_sums is None
                 and projection.bulk_applies(o_proj, rows))
        # The sequences ahead whose states a batched step asks L2 for.
        resident = projection.sm_count(ws.device_id) * _STEP_RESIDENT_BLOCKS_PER_SM
        prefetch_ahead = max(1, round(_STEP_PREFETCH_WAVES * resident / c.heads))
        blocks = ops.kda_decode_fused_bf16(
            conv_state, recurrent_state, ws.qkv_proj[sl], self.conv_weight, ws.forget_proj[sl], self.dt_bias,
            self.a_log, ws.down_proj[sl, 2 * d :], ws.out_gate[sl], self.o_norm, ws.conv_out[sl], ws.query[sl],
            ws.key[sl], ws.value[sl], ws.gate[sl], ws.beta[sl], ws.core[sl], ws.o_norm_out[sl],
            bounded=c.bounded, lower_bound=c.gate_lower_bound or 0.0, scale=self.scale, l2_eps=c.l2_eps,
            norm_eps=c.rms_norm_eps, slots=slots, tokens=rows if walk else 1,
            prefetch_ahead=prefetch_ahead, dependents_after=0,
            x_tiles=ws.x_tiles if tiles else None, outputs_ready=ws.outputs_ready if counted else None)
        return (blocks if counted else 0), tiles

    def _decode_rows(self, ws: KdaWorkspace, hidden: Any, conv_state: Any, recurrent_state: Any, *,
                     slots: Any = None, sequential: bool = False, snapshots: Sequence[KdaState] = ()) -> None:
        """Every launch of a decode-side call on hidden [rows, hidden] BF16, output in ws.final_out[:rows].
        sequential: the rows are consecutive tokens of ONE sequence (decode_k), snapshots[i] receiving the
        state after row i; otherwise row r is one token of the sequence in slot slots[r] of a pool."""
        rows = hidden.shape[0]
        with _section("front_end"):
            self._front_end(ws, hidden, wide=False)
        ready, tiled = 0, False
        try:
            with _section("recurrence"):
                if sequential and not snapshots:
                    ready, tiled = self._step(ws, 0, rows, conv_state, recurrent_state, walk=True, whole=True)
                elif sequential:
                    for row in range(rows):
                        self._step(ws, row, 1, conv_state, recurrent_state)
                        if row < len(snapshots):
                            snapshots[row].conv[...] = conv_state
                            snapshots[row].recurrent[...] = recurrent_state
                else:
                    ready, tiled = self._step(ws, 0, rows, conv_state, recurrent_state, slots=slots, whole=True)
            with _section("back_end"):
                self._back_end(ws, rows, wide=False, ready_target=ready, x_tiled=tiled)
        except BaseException:
            import cupy

            # A step that counted its outputs without the o_proj that clears the count: clear it
            # here, so that no later o_proj takes it for its own (a failed capture launched nothing).
            if ready and not cupy.cuda.get_current_stream().is_capturing():
                ws.outputs_ready.fill(0)
            raise

    # Back end and prefill ---------------------------------------------------------------------
    def _back_end(self, ws: KdaWorkspace, rows: int, wide: bool, ready_target: int = 0, x_tiled: bool = False,
                  first: int = 0, out: Any = None) -> None:
        """o_proj of o_norm_out's first `rows` rows into `out` [rows, hidden] BF16 (None: final_out's rows),
        and its FP32 sums into o_proj_sums rows first.., where set."""
        sums = None if self._o_proj_sums is None else self._o_proj_sums[first : first + rows]
        out = ws.final_out[:rows] if out is None else out
        self._project(ws, ws.o_norm_out[:rows], "o_proj", out, wide, after_kernel=True,
                      x_tiled=x_tiled, ready_target=ready_target, sums=sums)

    def _norm(self, ws: KdaWorkspace, rows: int, first: int) -> None:
        """Gated RMSNorm of core's first `rows` rows (one window of a prefill's middle) into o_norm_out
        rows first.."""
        c = self.config
        ops.kda_gated_rmsnorm_sigmoid_bf16(ws.core, ws.out_gate[first:], self.o_norm, ws.o_norm_out[first:], c.heads,
                                           c.head_dim, c.rms_norm_eps, tokens=rows)

    def _prefill_core(self, ws: KdaWorkspace, tokens: int, conv_state: Any, recurrent_state: Any,
                      pad_value: float | None, first: int, middle_first: int) -> None:
        """The stateful middle of a prefill of T = `tokens` projection rows first.. of the workspace, into the
        middle's rows middle_first..: the conv pass, gate, beta and chunked delta rule, conv_state
        [3*qkv, K] and recurrent_state [H, D, D] FP32 in place. The padded tail is filled with `pad_value`,
        or with None left as it is (packed prefill: the next sequence's rows). conv_out, and the gate the
        tensor-core prepare forms, only with options.stage_buffers."""
        c = self.config
        rows, middle = slice(first, None), slice(middle_first, None)
        record = self._options.stage_buffers
        query, key, value, gate, beta = (buf[middle] for buf in (ws.query, ws.key, ws.value, ws.gate, ws.beta))
        ops.kda_conv_prefill_silu_l2_bf16(conv_state, ws.qkv_proj[rows], self.conv_weight,
                                          ws.conv_out[middle] if record else None, query, key, value, c.heads,
                                          c.head_dim, c.l2_eps, tokens=tokens)
        padded = ops.chunk_count(tokens, c.chunk) * c.chunk
        if pad_value is not None and padded > tokens:
            for buf in (query, key, value, gate, beta):
                buf[tokens:padded].fill(pad_value)
        core = ws.core[middle]
        if self._chunk_impl == "tensor":
            # The prepare forms the gate and beta itself, but for a bounded law whose bound the bounded
            # prepare does not take: the unbounded prepare then reads the gate kernel's.
            lower_bound = prepare_lower_bound(c)
            fused = lower_bound is not None or not c.bounded
            if not fused:
                self._gate_beta(ws, tokens, first, middle_first)
            chunk_tc.chunk_prefill_tc(query, key, value, gate if record or not fused else None, beta,
                                      recurrent_state, core, tokens, lower_bound, ws.q_decay_f16, ws.k_tail_f16,
                                      ws.chunk_w_f16, ws.chunk_u, ws.attn_f16, ws.chunk_decay, scale=self.scale,
                                      gate_source=self._gate_source(ws, first) if fused else None)
        else:
            self._gate_beta(ws, tokens, first, middle_first)
            ops.kda_chunk_prepare_f32(query, key, value, gate, beta, ws.q_decay, ws.k_tail, ws.chunk_w, ws.chunk_u,
                                      ws.attn, ws.chunk_decay, tokens, c.chunk, self.scale)
            ops.kda_chunk_scan_f32(ws.q_decay, ws.k_tail, ws.chunk_w, ws.chunk_u, ws.attn, ws.chunk_decay,
                                   recurrent_state, core, tokens, c.chunk)

    def _prefill_rows(self, ws: KdaWorkspace, hidden: Any, runs: Sequence[tuple[int, int, Any, Any]],
                      pad_value: float | None) -> Any:
        """Every launch of a prefill of hidden [T, hidden] BF16; returns the output [T, hidden] BF16 (a new
        array). The rows go through in segments of the workspace's rows (one where T fits), each through
        the projections, then its middle in windows of ws.middle_rows rows (the stateful part of each run's
        rows in the window, then the window's gated RMSNorm), then o_proj. A run (first row, tokens,
        conv_state, recurrent_state) across segments or windows carries its state to the next. Segments
        and windows are whole chunks: a sequence prefilled alone is chunked as in one pass (docs/design.md,
        "The middle in windows", "Prefill in segments")."""
        import cupy

        total = hidden.shape[0]
        wide = total > DECODE_MAX_ROWS
        # (A workspace that does not hold T holds at least MAX_DECODE_ROWS rows: whole chunks remain.)
        segment = total if total <= ws.max_tokens else ws.max_tokens // self.config.chunk * self.config.chunk
        window = ws.middle_rows
        if segment < total:
            ws.unrecorded = f"the last prefill ran in segments of {segment} rows"
        elif not self._options.stage_buffers:
            ws.unrecorded = "the last prefill wrote only what its kernels read (KdaOptions.stage_buffers=False)"
        elif window < total:
            ws.unrecorded = (f"the last prefill ran its middle in windows of {window} rows (a workspace made with "
                             f"stage_buffers=False)")
        else:
            ws.unrecorded = None
        # The output goes through final_out only where the stage buffers record the call.
        recorded = ws.unrecorded is None
        out = cupy.empty((total, self.config.hidden), hidden.dtype)
        for start in range(0, total, segment):
            stop = min(total, start + segment)
            with _section("front_end"):
                self._front_end(ws, hidden[start:stop], wide)
            for low in range(start, stop, window):
                high = min(stop, low + window)
                with _section("recurrence"):
                    for first, tokens, conv_state, recurrent_state in runs:
                        begin, end = max(first, low), min(first + tokens, high)
                        if begin < end:
                            self._prefill_core(ws, end - begin, conv_state, recurrent_state, pad_value,
                                               begin - start, begin - low)
                with _section("back_end"):
                    self._norm(ws, high - low, low - start)
            with _section("back_end"):
                self._back_end(ws, stop - start, wide, first=start, out=None if recorded else out[start:stop])
                if recorded:
                    copy_into(out[start:stop], ws.final_out[: stop - start])
        return out

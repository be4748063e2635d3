"""KdaWorkspace: the stage buffers and scratch of the calls of one CUDA stream; why one a stream, shared by the
layers of a geometry: docs/design.md, "Workspaces".
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from ..config import KdaConfig
from ..chunk_model import f16_view
from . import projection
from .arrays import bf16_dtype, to_host

# Most rows of a decode-side call (a pool decode's sequences): the rows the decode graphs' input and
# output buffers hold.
MAX_DECODE_ROWS = 256

# Priority of the low-rank chain's stream (lower is more urgent; CUDA clamps it to the device's
# range): the chain is short and the fused step waits for it, while q|k|v streams most bytes.
_SIDE_STREAM_PRIORITY = -64
# The null, legacy and per-thread default streams (cudaStreamLegacy, cudaStreamPerThread): they
# live as long as the process, whatever Python object names them.
_PROCESS_STREAMS = (0, 1, 2)
# cudaMemcpyKind of a host-to-device copy.
_HOST_TO_DEVICE = 1
# Elements of a lean workspace's per-token FP32 buffers [M, H, D] (and, alike, its conv_out and chunk
# scratch): M = this over H * D, whole chunks, 4096 rows at GLM-5.3-Flash geometry and 8192 at
# Kimi-Linear's; a longer prefill runs its middle in windows of M rows. Enough rows for the middle's
# kernels to fill the GPU, and fewer windows where heads are fewer; few enough that the workspace of a
# GLM-5.3-Flash layer of 16384 rows is under half the size of one whose every buffer holds every row
# (docs/design.md, "The middle in windows").
MIDDLE_ELEMENTS = 4096 * 64 * 128


class PinnedUploads:
    """Small host-to-device copies issued without synchronising: a few pinned host buffers used
    in turn, each reused only once the copy that last read it has run. (A copy from pageable
    memory may wait for the stream; one from a freed pinned buffer may read what the next call
    wrote there.)"""

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


class KdaWorkspace:
    """Scratch sized once for `max_tokens` rows of one geometry, on the current device.

    The stage buffers are public on purpose: they carry the oracle's stage names
    (glm_kda.reference.STAGE_ORDER), so ``workspace.stages(T)`` lines up with an oracle run.

      qkv_proj [T, 3*qkv] BF16    down_proj [T, 2D+H] BF16    forget_proj, out_gate [T, qkv] BF16
      conv_out [M, 3*qkv] BF16    query, key, value, gate, core [M, H, D] FP32    beta [M, H] FP32
      o_norm_out [T, qkv] BF16    final_out [min(T, max(M, MAX_DECODE_ROWS)), hidden] BF16
      chunk scratch: q_decay, k_tail, chunk_w, chunk_u [M, H, D], attn [M/C, H, C, C],
      chunk_decay [M/C, H, D], all FP32
    with T = max_tokens and M = ``middle_rows``: T rounded up to the chunk where `stage_buffers`,
    else at most MIDDLE_ELEMENTS / (H * D) (whole chunks). A prefill of more than M rows runs its
    middle (conv pass, chunked delta rule, gated RMSNorm) in windows of M rows, the state carried from
    one to the next, with the bits of one pass; its stage buffers then hold the last window only. So a
    layer under KdaOptions(stage_buffers=True) takes a workspace made with stage_buffers=True, whose
    buffers hold every row (2.3x the bytes at GLM-5.3-Flash geometry and 16384 rows). The tensor-core chunk
    kernels keep q_decay, k_tail, w and attn as FP16 in the first half of the same bytes
    (q_decay_f16, k_tail_f16, chunk_w_f16, attn_f16). The rest (docs/design.md, "Workspaces"): the
    bulk sweep's x_tiles, x_tiles_side, x_tiles_gate and bulk_partial, the outputs_ready count (zero
    between calls), graph_hidden and graph_slots.
    """

    _serials = itertools.count()
    _by_stream: dict[tuple, "KdaWorkspace"] = {}
    _by_stream_lock = threading.Lock()

    def __init__(self, config: KdaConfig, max_tokens: int, stage_buffers: bool = False):
        import cupy

        config.validate()
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if not isinstance(stage_buffers, bool):
            raise TypeError(f"stage_buffers must be a bool, got {type(stage_buffers).__name__} {stage_buffers!r}")
        self.config = config
        self.max_tokens = max_tokens
        self.stage_buffers = stage_buffers
        self.device_id = cupy.cuda.Device().id
        # Unique for the life of the process (unlike id()): part of every decode graph's key.
        self.serial = next(KdaWorkspace._serials)
        c = config
        self.padded_tokens = padded = -(-max_tokens // c.chunk) * c.chunk
        window = max(c.chunk, MIDDLE_ELEMENTS // c.qkv // c.chunk * c.chunk)
        self.middle_rows = middle = padded if stage_buffers else min(padded, window)
        nchunks = middle // c.chunk
        bf16, f32 = bf16_dtype(), np.float32
        heads, dim = c.heads, c.head_dim
        self.qkv_proj = cupy.zeros((max_tokens, c.conv_dim), bf16)
        self.down_proj = cupy.zeros((max_tokens, c.down_dim), bf16)
        # forget_proj and out_gate have the same shape and kind: separate buffers, never aliased.
        self.forget_proj, self.out_gate, self.o_norm_out = (cupy.zeros((max_tokens, c.qkv), bf16) for _ in range(3))
        self.conv_out = cupy.zeros((min(max_tokens, middle), c.conv_dim), bf16)
        # A prefill writes its output here only where the stage buffers record the whole call (its rows
        # fit the middle), else straight into the array it returns.
        decode_rows = min(max_tokens, MAX_DECODE_ROWS)
        self.final_out = cupy.zeros((min(max_tokens, max(middle, MAX_DECODE_ROWS)), c.hidden), bf16)
        per_head = (middle, heads, dim)
        self.query, self.key, self.value, self.gate, self.core = (cupy.zeros(per_head, f32) for _ in range(5))
        self.beta = cupy.zeros((middle, heads), f32)
        self.q_decay, self.k_tail, self.chunk_w, self.chunk_u = (cupy.zeros(per_head, f32) for _ in range(4))
        self.attn = cupy.zeros((nchunks, heads, c.chunk, c.chunk), f32)
        self.chunk_decay = cupy.zeros((nchunks, heads, dim), f32)
        self.q_decay_f16, self.k_tail_f16, self.chunk_w_f16, self.attn_f16 = (
            f16_view(buffer) for buffer in (self.q_decay, self.k_tail, self.chunk_w, self.attn))
        # One row group of the decode-side projection and the widest k it reads.
        tile_rows = min(max_tokens, projection.GEMM_ROWS_MAX_ROWS)
        self.x_tiles = cupy.zeros((projection.x_tiles_size(tile_rows, max(c.hidden, c.qkv)),), bf16)
        self.x_tiles_side = cupy.zeros((projection.x_tiles_size(tile_rows, max(c.hidden, c.head_dim)),), bf16)
        self.x_tiles_gate = cupy.zeros((projection.x_tiles_size(tile_rows, c.head_dim),), bf16)
        # o_proj's k-range sums where its bulk sweep splits (up to 64 rows).
        self.bulk_partial = cupy.zeros((projection.bulk_partial_size(c.hidden, c.qkv, min(max_tokens, 64)),), f32)
        self.outputs_ready = cupy.zeros((2,), np.int32)
        self.graph_hidden = cupy.zeros((decode_rows, c.hidden), bf16)
        self.graph_slots = cupy.zeros((decode_rows,), np.int32)
        self.uploads: PinnedUploads | None = None
        # Why the stage buffers do not hold the last call's stages (None: they do).
        self.unrecorded: str | None = None
        # The extra streams of the decode front end and their fork / join events, by branch.
        self._branches: dict[int, tuple] = {}
        # Host-side use: one call at a time; calls from another stream wait for the last one.
        self._lock = threading.RLock()
        self._home_stream: int | None = None  # the stream of a for_stream workspace
        self._last_stream: int | None = None
        self._last_event: Any = None

    @property
    def nbytes(self) -> int:
        """Device bytes of this workspace's buffers (a view counted with the buffer it views)."""
        import cupy

        owned = {}
        for value in vars(self).values():
            if isinstance(value, cupy.ndarray):
                base = value if value.base is None else value.base
                owned[base.data.ptr] = base.nbytes
        return sum(owned.values())

    @classmethod
    def for_stream(cls, config: KdaConfig, max_tokens: int, stream: Any = None,
                   stage_buffers: bool = False) -> "KdaWorkspace":
        """The workspace of this geometry, size and kind (`stage_buffers`, as the constructor) for
        `stream` (default: the current stream) on the current device, made on its first use and let
        go when the stream object is (the null stream's lives as long as the process): a loop that
        makes a stream per request holds one workspace, not one per stream it ever made."""
        import cupy

        stream = cupy.cuda.get_current_stream() if stream is None else stream
        key = (config.hidden, config.heads, config.head_dim, config.conv_kernel, config.chunk, max_tokens,
               stage_buffers, cupy.cuda.Device().id, stream.ptr)
        with cls._by_stream_lock:
            workspace = cls._by_stream.get(key)
            if workspace is None:
                workspace = cls._by_stream[key] = cls(config, max_tokens, stage_buffers)
                workspace._home_stream = stream.ptr
                if stream.ptr not in _PROCESS_STREAMS:
                    weakref.finalize(stream, cls._forget, key, workspace.serial)
        return workspace

    @classmethod
    def _forget(cls, key: tuple, serial: int) -> None:
        """Drop the workspace of a stream that is gone (unless another took its place since)."""
        with cls._by_stream_lock:
            if key in cls._by_stream and cls._by_stream[key].serial == serial:
                del cls._by_stream[key]

    def acquire(self, stream: Any) -> bool:
        """Hold this workspace for one call on `stream` (until :meth:`release`): one host thread at a
        time, and on the GPU after the last call made on another stream. Returns whether the call is
        ordered against other streams (what release is to be told)."""
        self._lock.acquire()
        # Its own stream orders its calls (the common case: no event to record); a capture (a driver
        # capturing this call into a graph of its own) orders it in that graph.
        if stream.ptr == self._home_stream or stream.is_capturing():
            return False
        if self._last_stream is not None and self._last_stream != stream.ptr:
            stream.wait_event(self._last_event)
        return True

    def release(self, stream: Any, ordered: bool) -> None:
        """End the hold of :meth:`acquire` (`ordered`: what it returned)."""
        import cupy

        try:
            if ordered:
                if self._last_event is None:
                    self._last_event = cupy.cuda.Event(disable_timing=True)
                self._last_event.record(stream)
                self._last_stream = stream.ptr
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def beside(self, concurrent: bool, branch: int = 0) -> Iterator[Any]:
        """Yields the stream for work that may run beside the current stream's next launches:
        extra stream number `branch`, which starts after everything issued so far on the current
        stream and which the current stream waits for on exit (fork and join), or, when not
        `concurrent`, the current stream itself. Nest branches with a higher number."""
        import cupy

        main = cupy.cuda.get_current_stream()
        if not concurrent:
            yield main
            return
        known = self._branches.get(branch)
        if known is None:
            known = self._branches[branch] = (cupy.cuda.Stream(non_blocking=True, priority=_SIDE_STREAM_PRIORITY),
                                              cupy.cuda.Event(disable_timing=True),
                                              cupy.cuda.Event(disable_timing=True))
        side, fork, join = known
        fork.record(main)
        side.wait_event(fork)
        try:
            yield side
        finally:
            join.record(side)
            main.wait_event(join)

    def stages(self, rows: int) -> dict[str, np.ndarray]:
        """Host copies of the first `rows` rows of every stage buffer, by oracle stage name: the
        stages of the last call on this workspace ([rows, ...] as each buffer, BF16 or FP32).
        Raises ValueError where the buffers do not hold them: a prefill under
        KdaOptions(stage_buffers=False), one longer than this workspace (run in segments), or one
        longer than its middle_rows (its middle run in windows)."""
        from ..reference import STAGE_ORDER

        if self.unrecorded is not None:
            raise ValueError(f"stages: {self.unrecorded}; a layer under KdaOptions(stage_buffers=True), on a "
                             f"workspace made with stage_buffers=True of the call's rows, records every stage")
        held = min(self.max_tokens, self.middle_rows)
        if not 1 <= rows <= held:
            raise ValueError(f"stages: rows {rows} outside 1..{held} (the rows every stage buffer holds)")
        return {name: to_host(getattr(self, name)[:rows]) for name in STAGE_ORDER}

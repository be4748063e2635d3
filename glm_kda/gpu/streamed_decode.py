"""A KdaStack's one-sequence decode as one persistent launch (kernels_src/decode/stack_stream.cu): where it
applies, the table of device addresses it reads and the launch (docs/design.md, "Stack decode in one launch").

The launch has the bits of the layers' own launches; it streams every layer's weights a shared-memory
ring ahead of the data's dependencies, where separate launches stop the stream at each of them.
"""

from __future__ import annotations

from typing import Any, Sequence

from . import build
from .ops import stack_stream
from .projection import PackedWeight, shared_memory, sm_count
from .workspace import KdaWorkspace


class StreamedDecode:
    """The persistent launch of one stack: its ring plan (None where it does not apply), its counters and
    the table of the last (workspace, layers, states) it ran with."""

    def __init__(self, layers: Sequence[Any]):
        self.layers = list(layers)
        first = self.layers[0]
        c = first.config
        self.plan = None
        if (c.heads % 2 == 0 and c.head_dim == stack_stream.HEAD_DIM and build.cooperative_available(first.device_id)
                and c.heads // 2 <= sm_count(first.device_id)):
            self.plan = stack_stream.plan(c.hidden, c.heads, c.down_dim, shared_memory(first.device_id)[1])
        self._counters: Any = None
        self._table: tuple[tuple, Any] = ((), None)
        # The layers' generations when they were last found to fit (they change with options and sums).
        self._fitting: tuple = ()

    def applies(self) -> bool:
        """Whether the next one-sequence decode of the stack may take the one launch: a plan, every layer on
        the Hopper path with packed weights and no FP32 sums of o_proj, and no timer (timing wants the
        layers' own launches)."""
        if self.plan is None or build.current_context().timer is not None:
            return False
        generations = tuple(layer._generation for layer in self.layers)
        if generations != self._fitting:
            if not all(layer.options.hopper and layer._o_proj_sums is None
                       and all(isinstance(layer._packed.get(name), PackedWeight) for name in stack_stream.PROJECTIONS)
                       for layer in self.layers):
                return False
            self._fitting = generations
        return True

    def run(self, ws: KdaWorkspace, x: Any, states: Sequence[Any]) -> None:
        """One token: x [1, hidden] BF16 through every layer, states (one KdaState a layer) in place, the
        output in ws.final_out[:1] and the last layer's stage rows in ws."""
        import cupy

        first = self.layers[0]
        c = first.config
        if self._counters is None:
            self._counters = cupy.zeros(len(self.layers) * stack_stream.PHASES + 1, cupy.int32)
        row = x[0]
        if not row.flags.c_contiguous or row.data.ptr % 16:
            row = cupy.ascontiguousarray(row)  # (a fresh allocation is aligned)
        stack_stream.kda_stack_stream_bf16(
            row, self._table_for(ws, states), len(self.layers), self._counters, self.plan, hidden=c.hidden,
            heads=c.heads, down_dim=c.down_dim, kernel_size=c.conv_kernel, bounded=c.bounded,
            lower_bound=c.gate_lower_bound or 0.0, scale=first.scale, l2_eps=c.l2_eps, norm_eps=c.rms_norm_eps,
            sm_count=sm_count(first.device_id))

    def _table_for(self, ws: KdaWorkspace, states: Sequence[Any]) -> Any:
        """The device table of ws's rows and each layer's weights and state, built again only when one of
        them changed (the weights change with the layers' generations, which applies() kept)."""
        import cupy

        key = (ws.serial, self._fitting, tuple((state.conv.data.ptr, state.recurrent.data.ptr) for state in states))
        if self._table[0] != key:
            rows = {name: getattr(ws, name)[:1] for name in stack_stream.ROW_NAMES}
            layers = [{**{name: layer._packed[name] for name in stack_stream.PROJECTIONS},
                       "conv_w": layer.conv_weight, "dt_bias": layer.dt_bias, "a_log": layer.a_log,
                       "norm_w": layer.o_norm, "conv_state": state.conv, "state": state.recurrent}
                      for layer, state in zip(self.layers, states)]
            self._table = (key, cupy.asarray(stack_stream.call_table(rows, layers)))
        return self._table[1]

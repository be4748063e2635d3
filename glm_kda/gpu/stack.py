"""KdaStack: the KDA layers of a checkpoint on one GPU, sharing one workspace (README, "API").

Without ``between``, a decode or decode_k through the stack is one CUDA graph a call: no host work between
layers. The bits are those of calling ``stack.layers[i]`` one after the other by hand.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from ..config import KdaConfig
from ..device import require_gpu
from ..options import KdaOptions
from ..state import KdaState, StatePool, require_one_row
from .graphs import DecodeGraphs
from .layer import MAX_DECODE_ROWS, KdaLayer
from .pipeline import DECODE_MAX_ROWS
from .workspace import KdaWorkspace

Between = Callable[[int, Any], Any]


def state_signature(states: Sequence[Any]) -> tuple | None:
    """Everything the checks of a state list read, per state: its type and, for its conv and
    recurrent buffers, type, device, address, shape, strides and dtype. None where a state lacks
    those buffers (the full checks then name what is wrong). Equal signatures pass or fail the same
    checks."""
    try:
        signature = []
        for state in states:
            conv, recurrent = state.conv, state.recurrent
            signature.append((type(state), type(conv), conv.data.device_id, conv.data.ptr, conv.shape, conv.strides,
                              conv.dtype, type(recurrent), recurrent.data.device_id, recurrent.data.ptr,
                              recurrent.shape, recurrent.strides, recurrent.dtype))
        return tuple(signature)
    except AttributeError:
        return None


def chosen_layers(config: KdaConfig, layers: str | Sequence[int]) -> tuple[int, ...]:
    """The checkpoint layer indices `layers` names: "all" (every KDA layer, in order) or a list of
    KDA layer indices, each once."""
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be 'all' or a list of KDA layer indices, got {layers!r}")
        return tuple(config.kda_layers)
    chosen = tuple(layers)
    if not chosen or not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
        raise TypeError(f"layers must be 'all' or a non-empty list of int layer indices, got {layers!r}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers {list(chosen)} names a layer twice")
    other = [i for i in chosen if i not in config.kda_layers]
    if other:
        raise ValueError(f"layers {other} are not KDA layers of this checkpoint; its KDA layers: "
                         f"{', '.join(map(str, config.kda_layers))}")
    return chosen


class KdaStack:
    """KDA layers of one geometry run one after the other, sharing one workspace. layers: the KdaLayer
    objects, in order; build with :meth:`from_pretrained`.

    Each layer's output is the next layer's input, or what ``between(i, out)`` returns for it (i the position
    in the stack, out a CuPy BF16 [rows, hidden] array; return the same shape and dtype; not called after the
    last layer; an array the next layer refuses fails that layer's call, the earlier layers advanced).
    """

    def __init__(self, layers: Sequence[KdaLayer]):
        self.layers = list(layers)
        if not self.layers or not all(isinstance(layer, KdaLayer) for layer in self.layers):
            raise TypeError("KdaStack: layers must be a non-empty list of KdaLayer")
        first = self.layers[0]
        for i, layer in enumerate(self.layers[1:], 1):
            if layer.config.describe() != first.config.describe() or layer.device_id != first.device_id:
                raise ValueError(f"KdaStack: layer {i} ({layer.config.describe()}, device {layer.device_id}) is not "
                                 f"of layer 0's geometry and device ({first.config.describe()}, device {first.device_id})")
        self.config = first.config
        self.layer_indices = tuple(layer.layer_idx for layer in self.layers)
        # One graph a token through every layer, where the layers share one workspace.
        self.graphs = DecodeGraphs()
        shared = first._workspace
        self._one_graph = shared is not None and all(layer._workspace is shared for layer in self.layers)
        # The state_signature of the last state list that passed every check: a decode loop passes the
        # same states each token, and checking each layer's again was most of the host's part of a call.
        self._checked: tuple | None = None

    @classmethod
    def from_pretrained(cls, path_or_repo: str | Path, layers: str | Sequence[int] = "all", max_tokens: int = 4096,
                        chunk: int = 64, options: KdaOptions | None = None, progress: bool = True,
                        **hub_kwargs: Any) -> "KdaStack":
        """Bind the KDA layers `layers` ("all", or a list of KDA layer indices) of a checkpoint
        directory or hub repo, with one workspace for max_tokens rows (of every stage buffer where
        options.stage_buffers). chunk and options as KdaLayer.from_pretrained; hub_kwargs pass to
        glm_kda.bind_layer."""
        require_gpu("KdaStack.from_pretrained")
        config = KdaConfig.from_pretrained(path_or_repo, chunk=chunk, **hub_kwargs)
        indices = chosen_layers(config, layers)
        workspace = KdaWorkspace(config, max_tokens, stage_buffers=options is not None and options.stage_buffers)
        return cls([KdaLayer.from_pretrained(path_or_repo, idx, chunk=chunk, workspace=workspace, options=options,
                                             progress=False, **hub_kwargs)
                    for idx in tqdm(indices, desc="KDA layers", unit="layer", disable=not progress)])

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[KdaLayer]:
        return iter(self.layers)

    @property
    def options(self) -> KdaOptions:
        """The layers' KdaOptions; setting it sets every layer's."""
        return self.layers[0].options

    @options.setter
    def options(self, options: KdaOptions) -> None:
        for layer in self.layers:
            layer.options = options

    @contextlib.contextmanager
    def timing(self) -> Iterator[Any]:
        """Time every launch of the calls inside the block, all layers together (they run eagerly):
        ``with stack.timing() as timer: ...`` then ``timer.table()`` (as KdaLayer.timing)."""
        with self.layers[0].timing() as timer:
            yield timer

    def new_states(self) -> list[KdaState]:
        """One zero KdaState per layer, on the stack's device."""
        return [layer.new_state() for layer in self.layers]

    def new_pools(self, slots: int) -> list[StatePool]:
        """One StatePool of `slots` zero states per layer, on the stack's device."""
        import cupy

        with cupy.cuda.Device(self.layers[0].device_id):
            return [StatePool(self.config, slots) for _ in self.layers]

    # Calls ---------------------------------------------------------------------------------------
    def prefill(self, hidden: Any, states: Sequence[KdaState] | Sequence[StatePool], pad_value: float = 0.0, *,
                slots: Any = None, cu_seqlens: Sequence[int] | None = None, between: Between | None = None) -> Any:
        """KdaLayer.prefill through every layer: hidden [T, hidden] BF16 with one KdaState per layer,
        or packed sequences with one StatePool per layer (slots, cu_seqlens as KdaLayer.prefill).
        Returns [T, hidden] BF16."""
        self._check_states(states, "prefill")
        return self._run(hidden, "prefill", self.layers[0].max_tokens, between,
                         lambda layer, x, state: layer.prefill(x, state, pad_value, slots=slots, cu_seqlens=cu_seqlens),
                         states)

    def decode(self, hidden: Any, states: Sequence[KdaState] | Sequence[StatePool], slots: Any = None, *,
               check_slots: bool = True, between: Between | None = None) -> Any:
        """KdaLayer.decode through every layer: one row with one KdaState per layer, or B rows with
        one StatePool per layer and their slots [B] (checked once, before the first layer).
        Returns [rows, hidden] BF16."""
        pooled = self._check_states(states, "decode")
        if not pooled:
            require_one_row("decode", hidden)
        max_rows = min(MAX_DECODE_ROWS, len(states[0]), self.layers[0].max_tokens) if pooled else 1
        if between is None and self._one_graph:
            return self._through_one_graph(hidden, "decode", max_rows, states, slots if pooled else None, pooled,
                                           check_slots)
        if pooled and slots is not None and check_slots:  # once here: the layers below are told not to
            self.layers[0]._host_slots(slots, len(slots), states[0], "decode")
        return self._run(hidden, "decode", max_rows, between,
                         lambda layer, x, state: layer.decode(x, state, slots, check_slots=False) if pooled
                         else layer.decode(x, state), states)

    def decode_k(self, hidden_rows: Any, states: Sequence[KdaState],
                 snapshots: Sequence[Sequence[KdaState]] | None = None, *, between: Between | None = None) -> Any:
        """KdaLayer.decode_k through every layer: K rows (1..16) of one sequence, one KdaState per
        layer; snapshots, if given, one list per layer (as KdaLayer.decode_k). Returns [K, hidden]."""
        if self._check_states(states, "decode_k"):
            raise TypeError("decode_k: states must be KdaStates (one sequence), not StatePools")
        if snapshots is not None:
            if len(snapshots) != len(self.layers):
                raise ValueError(f"decode_k: {len(snapshots)} snapshot lists for {len(self.layers)} layers")
            rows = hidden_rows.shape[0] if len(getattr(hidden_rows, "shape", ())) == 2 else 1
            for i, (layer, taken) in enumerate(zip(self.layers, snapshots)):
                if len(taken) > rows:
                    raise ValueError(f"decode_k: snapshots[{i}] holds {len(taken)} states for {rows} rows")
                for j, snap in enumerate(taken):
                    layer._check_state(snap, "decode_k", f"snapshots[{i}][{j}]")
        max_rows = min(DECODE_MAX_ROWS, self.layers[0].max_tokens)
        if between is None and snapshots is None and self._one_graph:
            return self._through_one_graph(hidden_rows, "decode_k", max_rows, states, None, False, False)
        per_layer = iter(snapshots if snapshots is not None else [None] * len(self.layers))
        return self._run(hidden_rows, "decode_k", max_rows, between,
                         lambda layer, x, state: layer.decode_k(x, state, next(per_layer)), states)

    # ----------------------------------------------------------------------------------------------
    def _check_states(self, states: Sequence[Any], what: str) -> bool:
        """Every layer's state (or pool) checked before the first layer runs (at once where its
        state_signature is that of the last list to pass); True for pools."""
        if isinstance(states, (KdaState, StatePool)) or len(states) != len(self.layers):
            count = "one" if isinstance(states, (KdaState, StatePool)) else len(states)
            raise ValueError(f"{what}: expected one state (or one StatePool) per layer ({len(self.layers)}), "
                             f"got {count}")
        pools = isinstance(states[0], StatePool)
        signature = state_signature(states)
        if signature is not None and signature == self._checked:
            return pools
        for i, (layer, state) in enumerate(zip(self.layers, states)):
            if pools:
                if not isinstance(state, StatePool):
                    raise TypeError(f"{what}: states[{i}] must be a StatePool, got {type(state).__name__}")
                layer._check_pool(state, what)
            else:
                layer._check_state(state, what, f"states[{i}]")
        self._checked = signature
        return pools

    def _through_one_graph(self, hidden: Any, what: str, max_rows: int, states: Sequence[Any], slots: Any,
                           pooled: bool, check_slots: bool) -> Any:
        """A decode-side call through every layer as one graph (replayed from the second call of a
        key, as a layer's own calls are): each layer's launches, reading the previous layer's output
        rows in place. The bits are the layers' own: the same launches on the same values."""
        first = self.layers[0]
        x, back = first._rows_in(hidden, what, max_rows)
        rows = x.shape[0]
        if pooled:
            slots = first._slots_in(slots, rows, states[0], what, check_slots)
        first._check_finite(x, what)

        def body(ws: KdaWorkspace, rows_in: Any, device_slots: Any) -> None:
            for layer, state in zip(self.layers, states):
                if pooled:
                    layer._decode_rows(ws, rows_in, state.conv, state.recurrent, slots=device_slots)
                else:
                    layer._decode_rows(ws, rows_in, state.conv, state.recurrent, sequential=True)
                # The next layer reads this one's output in place (safe: docs/design.md, "Python modules").
                rows_in = ws.final_out[:rows]

        key = ("stack", pooled, rows, tuple(layer._generation for layer in self.layers),
               tuple((state.conv.data.ptr, state.recurrent.data.ptr) for state in states))
        return back(first._replay(self.graphs, key, x, slots, what, body))

    def _run(self, hidden: Any, what: str, max_rows: int, between: Between | None,
             call: Callable[[KdaLayer, Any, Any], Any], states: Sequence[Any]) -> Any:
        x, back = self.layers[0]._rows_in(hidden, what, max_rows)
        last = len(self.layers) - 1
        for i, (layer, state) in enumerate(zip(self.layers, states)):
            x = call(layer, x, state)
            if between is not None and i < last:
                x = between(i, x)
        return back(x)

"""Run the KDA blocks of a transformers GLM-5.3-Flash or Kimi-Linear model on glm_kda (README, "API").

A model on a CUDA device runs the CUDA kernels, one on the CPU the BF16-faithful NumPy oracle; the states stay
in the model's own cache (docs/design.md, "The transformers integration"). Needs torch and transformers >= 5.17
(`pip install glm-kda[transformers]`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from ..checkpoint import LAYOUT_TRANSFORMERS, BoundLayer
from ..config import KdaConfig
from ..reference import KdaOracle
from ..state import KdaState

# The transformers classes of a KDA block (self_attn of a linear-attention layer).
KDA_CLASSES = ("KimiLinearDeltaAttention", "Glm5NextTextLinearAttention")


def _bf16_array(tensor: Any) -> np.ndarray:
    import torch

    return tensor.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def _f32_array(tensor: Any) -> np.ndarray:
    import torch

    return tensor.detach().to(torch.float32).cpu().numpy()


def bound_from_module(module: Any, config: KdaConfig, layer_idx: int) -> BoundLayer:
    """The BoundLayer of a transformers KDA block's weights (BF16 rounding where the block holds
    FP32: the conv taps of GLM-5.3-Flash's blocks, a float32 model's projections)."""
    gate = module.forget_gate
    return BoundLayer(
        layer_idx=layer_idx, config=config, layout=LAYOUT_TRANSFORMERS,
        q_proj=_bf16_array(module.q_proj.weight), k_proj=_bf16_array(module.k_proj.weight),
        v_proj=_bf16_array(module.v_proj.weight),
        conv_weight=np.ascontiguousarray(_bf16_array(module.conv1d.weight)[:, 0, :]),
        f_a=_bf16_array(gate.f_a_proj.weight), f_b=_bf16_array(gate.f_b_proj.weight),
        dt_bias=_f32_array(gate.dt_bias), a_log=_f32_array(gate.A_log).reshape(config.heads),
        b_proj=_bf16_array(module.b_proj.weight), g_a=_bf16_array(module.g_a_proj.weight),
        g_b=_bf16_array(module.g_b_proj.weight), o_norm=_bf16_array(module.o_norm.weight),
        o_proj=_bf16_array(module.o_proj.weight))


class _OracleBackend:
    """One block on the NumPy oracle (BF16-faithful), sequence by sequence."""

    def __init__(self, bound: BoundLayer):
        self.oracle = KdaOracle(bound, "bf16")
        self.config = bound.config

    def run(self, hidden: Any, conv: Any, recurrent: Any) -> tuple[Any, Any, Any, Any]:
        """hidden [B, T, hidden] BF16 torch, conv [B, C, K] and recurrent [B, H, D, D] (or None):
        (output [B, T, hidden], conv inputs [B, C, T] BF16, conv [B, C, K] FP32, recurrent FP32)."""
        import torch

        outs, inputs, convs, states = [], [], [], []
        for b in range(hidden.shape[0]):
            state = None if conv is None else KdaState.from_transformers(_f32_array(conv[b]), _f32_array(recurrent[b]))
            rows = hidden[b].view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
            stages, state = (self.oracle.decode if rows.shape[0] == 1 else self.oracle.prefill)(rows, state)
            outs.append(np.asarray(stages["final_out"], np.float32))
            inputs.append(np.asarray(stages["qkv_proj"], np.float32).T)
            convs.append(state.conv)
            states.append(state.recurrent)
        as_torch = lambda arrays: torch.from_numpy(np.stack(arrays).astype(np.float32))  # noqa: E731
        return as_torch(outs), as_torch(inputs), as_torch(convs), as_torch(states)


class _StreamHandle:
    """A raw cudaStream_t under the CUDA stream protocol, which cupy.cuda.Stream.from_external takes."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(handle: int) -> Any:
    """The CuPy stream of the raw cudaStream_t `handle` (say torch's current stream), not owned by CuPy."""
    import cupy

    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


class _LayerBackend:
    """One block on the CUDA kernels: the batch's sequences as the slots of a StatePool, prefilled
    packed and decoded in one call, on torch's current stream."""

    def __init__(self, bound: BoundLayer, device_index: int, workspace: Any, options: Any):
        import cupy

        from ..gpu.layer import KdaLayer

        with cupy.cuda.Device(device_index):
            self.layer = KdaLayer(bound, workspace=workspace, options=options)
        self.config = bound.config
        self.device_index = device_index
        self._pools: dict[int, Any] = {}

    def run(self, hidden: Any, conv: Any, recurrent: Any) -> tuple[Any, Any, Any, Any]:
        """As _OracleBackend.run, every tensor on the block's GPU."""
        import cupy
        import torch

        from ..state import StatePool

        batch, tokens = hidden.shape[:2]
        stream = cupy_stream(torch.cuda.current_stream(self.device_index).cuda_stream)
        with cupy.cuda.Device(self.device_index), stream:
            pool = self._pools.get(batch)
            if pool is None:
                pool = self._pools[batch] = StatePool(self.config, batch)
            if conv is None:
                pool.conv[...] = 0
                pool.recurrent[...] = 0
            else:
                pool.conv[...] = cupy.from_dlpack(conv.detach().to(torch.float32).contiguous())
                pool.recurrent[...] = cupy.from_dlpack(recurrent.detach().to(torch.float32).contiguous())
            slots = list(range(batch))
            # A packed prefill takes max_tokens rows at most: longer inputs go in pieces, the state carried.
            piece = max(1, self.layer.max_tokens // batch)
            outs, inputs = [], []
            for first in range(0, tokens, piece):
                part = hidden[:, first:first + piece].contiguous()
                length = part.shape[1]
                rows = part.reshape(batch * length, -1)
                if length == 1:
                    out = self.layer.decode(rows, pool, slots)
                else:
                    out = self.layer.prefill(rows, pool, slots=slots,
                                             cu_seqlens=[b * length for b in range(batch + 1)])
                outs.append(out.reshape(batch, length, -1))
                qkv = torch.from_dlpack(self.layer.workspace.qkv_proj[: batch * length].view(np.int16))
                inputs.append(qkv.view(torch.bfloat16).reshape(batch, length, -1).transpose(1, 2).clone())
            return (torch.cat(outs, dim=1), torch.cat(inputs, dim=2), torch.from_dlpack(pool.conv).clone(),
                    torch.from_dlpack(pool.recurrent).clone())


def _cached_states(cache: Any, layer_idx: int) -> tuple[Any, Any]:
    """(conv [B, C, K], recurrent [B, H, D, D]) a cache holds for a layer, or (None, None) before its
    first update: through get_conv_state / get_recurrent_state where the cache has them
    (transformers >= 5.25), else through has_previous_state and the layer's state lists (5.17)."""
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    if not cache.has_previous_state(layer_idx):
        return None, None
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def _kda_block_class():
    import torch

    class KdaBlock(torch.nn.Module):
        """A transformers KDA block (self_attn) run by glm_kda; forward takes and returns what the
        original does: hidden_states [B, T, hidden] -> [B, T, hidden], its states in `cache`."""

        def __init__(self, original: Any, backend: Any, layer_idx: int, conv_kernel: int):
            super().__init__()
            self.original = [original]  # (a list: not registered as a submodule, its weights not counted twice)
            self.backend = backend
            self.layer_idx = layer_idx
            self.conv_kernel = conv_kernel

        def forward(self, hidden_states: Any, cache: Any = None, attention_mask: Any = None, *,
                    cache_params: Any = None, **kwargs: Any) -> Any:
            cache = cache if cache is not None else cache_params  # (cache_params: transformers 5.17's name)
            if cache is not None and getattr(cache.layers[self.layer_idx], "record_past", False):
                raise NotImplementedError("glm_kda's KDA blocks do not record past states (cache.crop / assisted "
                                          "decoding); restore the original blocks for that")
            dtype = hidden_states.dtype
            if attention_mask is not None:  # padding rows count as zeros, as in the original block
                hidden_states = hidden_states * attention_mask[:, :, None].to(dtype)
            conv, recurrent = (None, None) if cache is None else _cached_states(cache, self.layer_idx)
            out, conv_inputs, _, new_recurrent = self.backend.run(hidden_states.to(torch.bfloat16), conv, recurrent)
            if cache is not None:
                # The cache's own bookkeeping: the last K conv inputs kept, the length advanced by T.
                cache.update_conv_state(conv_inputs.to(dtype), self.layer_idx, conv_kernel_size=self.conv_kernel)
                cache.update_recurrent_state(new_recurrent, self.layer_idx)
            return out.to(dtype)

    return KdaBlock


@dataclass
class Replacement:
    """The blocks use_glm_kda replaced: restore() puts the originals back."""

    model: Any
    swapped: list[tuple[Any, str, Any]] = field(default_factory=list)  # (parent, attribute, original)

    @property
    def blocks(self) -> list[Any]:
        return [getattr(parent, name) for parent, name, _ in self.swapped]

    def restore(self) -> None:
        """Put every original block back (idempotent)."""
        for parent, name, original in self.swapped:
            setattr(parent, name, original)
        self.swapped = []


def use_glm_kda(model: Any, max_tokens: int = 4096, options: Any = None) -> Replacement:
    """Replace every KDA block of a transformers GLM-5.3-Flash or Kimi-Linear model by a KdaBlock
    (in place) and return the Replacement that undoes it. max_tokens: the most rows one kernel call
    takes (batch x tokens of a prefill; longer prefills go in pieces); options: KdaOptions."""
    found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in KDA_CLASSES]
    if not found:
        raise ValueError(f"use_glm_kda: {type(model).__name__} has no KDA block (looked for {', '.join(KDA_CLASSES)})")
    config = KdaConfig.from_dict(model.config.to_dict(), source=f"{type(model).__name__}.config")
    block_class = _kda_block_class()
    device = next(found[0][1].parameters()).device
    workspace = None
    if device.type == "cuda":
        import cupy

        from ..gpu.workspace import KdaWorkspace

        with cupy.cuda.Device(device.index or 0):
            workspace = KdaWorkspace(config, max_tokens)
    replacement = Replacement(model)
    try:
        for name, module in found:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            bound = bound_from_module(module, config, module.layer_idx)
            backend = (_LayerBackend(bound, device.index or 0, workspace, options) if device.type == "cuda"
                       else _OracleBackend(bound))
            setattr(parent, attribute, block_class(module, backend, module.layer_idx, config.conv_kernel))
            replacement.swapped.append((parent, attribute, module))
    except BaseException:
        replacement.restore()  # all or nothing: a block that cannot be replaced leaves the model as it was
        raise
    return replacement

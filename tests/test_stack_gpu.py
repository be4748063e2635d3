"""KdaStack: every KDA layer of a checkpoint with one workspace. Its calls give the bits of the
same layers called one by one (each built on its own, with its own workspace); a bad state list
is refused before the first layer runs. The layer choice is checked on the host."""

from __future__ import annotations

import numpy as np
import pytest

from glm_kda.device import NoGpuError, gpu_status
from glm_kda.state import KdaState
from glm_kda.synthetic import synthetic_config, synthetic_hidden, write_synthetic_checkpoint

GPU_OK, GPU_WHY = gpu_status()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason=f"no CUDA GPU: {GPU_WHY}")


# On the host ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,error,needle", [
    ("some", ValueError, "layers must be 'all' or a list of KDA layer indices, got 'some'"),
    ([], TypeError, "a non-empty list of int layer indices, got \\[\\]"),
    ([0, 1.0], TypeError, "a non-empty list of int layer indices"),
    ([0, 0], ValueError, r"layers \[0, 0\] names a layer twice"),
    ([0, 3], ValueError, r"layers \[3\] are not KDA layers of this checkpoint; its KDA layers: 0, 1, 2"),
])
def test_a_bad_layer_choice_is_refused_by_name(layers, error, needle):
    from glm_kda.gpu.stack import chosen_layers

    with pytest.raises(error, match=needle):
        chosen_layers(synthetic_config("tiny-kimi"), layers)


def test_the_layer_choice_keeps_the_order_given():
    from glm_kda.gpu.stack import chosen_layers

    config = synthetic_config("tiny-kimi")
    assert chosen_layers(config, "all") == (0, 1, 2) and chosen_layers(config, [2, 0]) == (2, 0)


@pytest.mark.skipif(GPU_OK, reason="a GPU is present")
def test_without_a_gpu_the_stack_says_so(tmp_path):
    from glm_kda import KdaStack

    with pytest.raises(NoGpuError, match="KdaStack.from_pretrained needs a CUDA GPU"):
        KdaStack.from_pretrained(tmp_path)


# On a GPU --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack_checkpoint(tmp_path_factory):
    """Kimi-Linear geometry, four layers: KDA layers 0, 1, 2 and an attention layer 3."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("stack"), "kimi", num_layers=4)


def _bits(array):
    host = array.get() if hasattr(array, "get") else np.asarray(array)
    return host.view(np.uint16 if host.dtype.itemsize == 2 else np.uint32).copy()


def _device(state: KdaState) -> KdaState:
    import cupy

    return KdaState(cupy.asarray(state.conv), cupy.asarray(state.recurrent))


@needs_gpu
@pytest.mark.gpu
def test_the_stack_gives_the_bits_of_its_layers_called_one_by_one(stack_checkpoint):
    import cupy

    from glm_kda import KdaLayer, KdaStack

    stack = KdaStack.from_pretrained(stack_checkpoint, max_tokens=256, progress=False)
    assert stack.layer_indices == (0, 1, 2) and len(stack) == 3
    assert len({id(layer.workspace) for layer in stack}) == 1, "the layers must share one workspace"
    alone = [KdaLayer.from_pretrained(stack_checkpoint, i, max_tokens=256, progress=False) for i in (0, 1, 2)]
    cfg = stack.config
    hidden = synthetic_hidden(120, cfg.hidden, seed=7)
    starts = [KdaState.random(cfg, seed=10 + i) for i in range(3)]
    halve = lambda i, out: (out.astype(cupy.float32) * 0.5).astype(out.dtype)  # noqa: E731

    def through_layers(call, rows, states, between=None):
        x = rows
        for i, (layer, state) in enumerate(zip(alone, states)):
            x = call(layer, x, state)
            if between is not None and i < 2:
                x = between(i, cupy.asarray(x) if isinstance(x, np.ndarray) else x)
        return x

    for between in (None, halve):
        mine, theirs = [_device(s) for s in starts], [_device(s) for s in starts]
        outs = [stack.prefill(hidden[:100], mine, between=between),
                through_layers(lambda layer, x, s: layer.prefill(x, s), hidden[:100], theirs, between)]
        for t in range(100, 104):
            outs += [stack.decode(hidden[t], mine, between=between),
                     through_layers(lambda layer, x, s: layer.decode(x, s), hidden[t], theirs, between)]
        outs += [stack.decode_k(hidden[104:107], mine, between=between),
                 through_layers(lambda layer, x, s: layer.decode_k(x, s), hidden[104:107], theirs, between)]
        if between is None:
            assert stack.graphs.captures >= 1, "decode through the stack never replayed one graph"
        for k in range(0, len(outs), 2):
            assert np.array_equal(_bits(outs[k]), _bits(outs[k + 1])), f"between={between}: call {k // 2} differs"
        for i in range(3):
            assert np.array_equal(_bits(mine[i].recurrent), _bits(theirs[i].recurrent)), f"layer {i}: state differs"
            assert np.array_equal(_bits(mine[i].conv), _bits(theirs[i].conv)), f"layer {i}: conv state differs"

    pools, solo = stack.new_pools(4), stack.new_pools(4)
    rows = cupy.asarray(hidden[110:113].view(np.uint16)).view(stack.layers[0].workspace.final_out.dtype)
    pooled = stack.decode(rows, pools, [3, 0, 2])
    by_hand = through_layers(lambda layer, x, pool: layer.decode(x, pool, [3, 0, 2]), rows, solo)
    assert np.array_equal(_bits(pooled), _bits(by_hand)), "pool decode through the stack differs"


@needs_gpu
@pytest.mark.gpu
def test_a_bad_state_list_is_refused_before_the_first_layer(stack_checkpoint):
    import cupy

    from glm_kda import KdaStack

    stack = KdaStack.from_pretrained(stack_checkpoint, layers=[2, 0], max_tokens=64, progress=False)
    assert stack.layer_indices == (2, 0)
    states = [_device(KdaState.random(stack.config, seed=s)) for s in (1, 2)]
    row = synthetic_hidden(1, stack.config.hidden, seed=3)
    stack.decode(row, states)  # passed: the same buffers are not checked again, other ones are
    before = [_bits(s.recurrent) for s in states]
    other = KdaState.zeros(synthetic_config("tiny-kimi"), cupy)
    transposed = KdaState(states[1].conv, states[1].recurrent.transpose(0, 2, 1))
    for bad, needle in (([states[0]], "expected one state (or one StatePool) per layer (2), got 1"),
                        (states[0], "got one"),
                        ([states[0], other], "states[1]"),
                        ([states[0], transposed], "states[1].recurrent must be a contiguous CuPy float32 array")):
        with pytest.raises((TypeError, ValueError), match=None) as info:
            stack.decode(row, bad)
        assert needle in str(info.value), info.value
    with pytest.raises(ValueError, match=r"snapshots\[1\] holds 2 states for 1 rows"):
        stack.decode_k(row, states, [[], [stack.layers[1].new_state()] * 2])
    assert all(np.array_equal(_bits(s.recurrent), b) for s, b in zip(states, before)), "a refused call changed a state"

"""KdaState and StatePool on the host (NumPy arrays): shapes, views into the pool, resets that check
every slot before touching any, and errors that name the buffer or slot."""

from __future__ import annotations

import numpy as np
import pytest

from glm_kda.state import KdaState, StatePool
from glm_kda.synthetic import synthetic_config


@pytest.fixture
def config():
    return synthetic_config("tiny-kimi")


def filled_pool(config, slots: int = 4) -> StatePool:
    pool = StatePool(config, slots, xp=np)
    for slot in range(slots):
        pool.conv[slot] = slot + 1
        pool.recurrent[slot] = -(slot + 1)
    return pool


def test_pool_shapes_and_slot_views(config):
    pool = filled_pool(config)
    assert len(pool) == 4
    assert pool.conv.shape == (4,) + tuple(config.conv_state_shape) and pool.conv.dtype == np.float32
    assert pool.recurrent.shape == (4,) + tuple(config.recurrent_state_shape) and pool.recurrent.dtype == np.float32
    state = pool.state(2)
    state.check(config)
    state.recurrent[0, 0, 0] = 7.0
    assert pool.recurrent[2, 0, 0, 0] == 7.0, "a slot's state must be a view into the pool"


def test_reset_zeroes_only_its_slots(config):
    pool = filled_pool(config)
    pool.reset(1, 3)
    for slot, zeroed in enumerate([False, True, False, True]):
        assert (pool.conv[slot] == 0).all() == zeroed and (pool.recurrent[slot] == 0).all() == zeroed, slot


@pytest.mark.parametrize("slots", [(0, 4), (-1,), (2, 99, 1)])
def test_bad_slot_raises_before_any_slot_changes(config, slots):
    pool = filled_pool(config)
    before = (pool.conv.copy(), pool.recurrent.copy())
    with pytest.raises(IndexError, match=r"slot -?\d+ outside this pool of 4 slots"):
        pool.reset(*slots)
    assert np.array_equal(pool.conv, before[0]) and np.array_equal(pool.recurrent, before[1]), \
        f"reset{slots} changed the pool before it raised"
    with pytest.raises(IndexError, match="outside this pool"):
        pool.state(4)


def test_pool_needs_a_slot(config):
    with pytest.raises(ValueError, match=">= 1 slot"):
        StatePool(config, 0, xp=np)


def test_check_names_the_buffer(config):
    state = KdaState.zeros(config)
    state.check(config, "mine")
    bad = KdaState(state.conv, state.recurrent[:, :, :-1])
    with pytest.raises(ValueError, match=r"^mine\.recurrent has shape"):
        bad.check(config, "mine")


def test_exchange_layouts_refuse_wrong_ranks(config):
    state = KdaState.random(config, seed=3)
    with pytest.raises(ValueError, match=r"transformers conv state must be \[3 \* H \* D = \d+, K\] .* got shape \[1, "):
        KdaState.from_transformers(state.conv[None], state.recurrent)
    with pytest.raises(ValueError, match=r"vLLM conv state must be \[3 \* H \* D = \d+, K - 1\] .* got shape \[\d+\]"):
        KdaState.from_vllm(state.conv.reshape(-1), state.recurrent)


def test_slot_state_is_a_view_of_its_own_slot(config):
    pool = filled_pool(config)
    state = pool.state(2)
    assert (state.conv == 3).all() and (state.recurrent == -3).all(), "state(2) must be slot 2's contents"
    state.conv[0, 0] = 7.0
    assert pool.conv[2, 0, 0] == 7.0, "a slot's conv state must be a view into the pool"

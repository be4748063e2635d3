"""The task table of the one-launch decode (glm_kda.persistent, kernels_src/decode_persistent.cu),
on the CPU: every output is computed by exactly one task, every wait is met by earlier tickets
alone (the launch cannot deadlock), and the Python constants mirror the kernel's."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from glm_kda import gemm_rows, kernels, persistent
from glm_kda.persistent import DOWN, OUT, QKV, STEP, UP_F, UP_G

GEOMETRIES = [(4096, 64), (2304, 32), (256, 4), (512, 16), (1024, 2)]
# (step lag, out lag)
LAGS = [(0, 0), (4, 1), (12, 99), (40, 3)]


def _columns(kind_tasks: np.ndarray, width: int) -> np.ndarray:
    """The columns the tasks of one projection write, one entry per (task, column)."""
    return np.concatenate([np.arange(index * width, (index + 1) * width) for index in kind_tasks[:, 1]])


@pytest.mark.parametrize("lags", LAGS, ids=lambda lags: "lag{}_{}".format(*lags))
@pytest.mark.parametrize("hidden,heads", GEOMETRIES, ids=lambda v: str(v))
def test_every_output_has_exactly_one_task(hidden, heads, lags):
    schedule = persistent.build_schedule(hidden, heads, *lags)
    tasks, dim = schedule.tasks, 128
    qkv, down_dim = heads * dim, 2 * dim + heads
    for kind, n, k in ((DOWN, down_dim, hidden), (QKV, 3 * qkv, hidden), (UP_F, qkv, dim), (UP_G, qkv, dim)):
        width = persistent.group_columns(k)
        columns = _columns(tasks[tasks[:, 0] == kind], width)
        covered = np.sort(columns[columns < n])
        assert np.array_equal(covered, np.arange(n)), (
            f"{persistent.KIND_NAMES[kind]}: {covered.size} column writes for {n} columns, or a column twice")
        assert (columns >= n).sum() < width, f"{persistent.KIND_NAMES[kind]}: a whole task past the matrix"
    steps = tasks[tasks[:, 0] == STEP]
    stepped = np.sort(np.concatenate([np.arange(first, first + count) for first, count in steps[:, 1:3]]))
    assert np.array_equal(stepped, np.arange(heads)), f"heads of the step tasks: {stepped.tolist()}"
    assert set(steps[:, 2].tolist()) == {2} and (steps[:, 1] % 2 == 0).all(), "a step task is a pair of heads"
    outs = tasks[tasks[:, 0] == OUT][:, 1:3]
    pairs = {tuple(pair) for pair in outs.tolist()}
    assert len(pairs) == len(outs) == schedule.out_groups * schedule.out_split, "o_proj (group, k range) twice"
    assert schedule.out_split == gemm_rows.k_split(qkv)
    assert schedule.out_groups * gemm_rows.WARPS_PER_BLOCK * persistent.OUT_TILES * gemm_rows.N_TILE >= hidden


@pytest.mark.parametrize("lags", LAGS, ids=lambda lags: "lag{}_{}".format(*lags))
@pytest.mark.parametrize("hidden,heads", GEOMETRIES, ids=lambda v: str(v))
def test_each_wait_is_met_by_earlier_tickets_and_names_its_inputs(hidden, heads, lags):
    schedule = persistent.build_schedule(hidden, heads, *lags)
    persistent.check_schedule(schedule)  # the deadlock check (raises)
    tasks = schedule.tasks.tolist()
    signalled_by: dict[int, list[int]] = {}
    for ticket, task in enumerate(tasks):
        for counter in task[5:]:
            if counter >= 0:
                signalled_by.setdefault(counter, []).append(ticket)
    qkv = heads * 128
    for ticket, (kind, index, aux, wait, target, *_) in enumerate(tasks):
        if kind == STEP:
            # The counter a step waits for is raised by exactly the q|k|v, f_b and g_b groups of
            # its two heads, all of them.
            producers = [tasks[t] for t in signalled_by[wait]]
            assert len(producers) == target
            heads_fed = set()
            for producer in producers:
                width = persistent.group_columns(128 if producer[0] in (UP_F, UP_G) else hidden)
                first = producer[1] * width
                heads_fed.add((first % qkv) // 128 // 2)
            assert heads_fed == {index // 2}, f"step of head {index} waits on groups of pairs {heads_fed}"
        if kind == OUT and wait >= 0:
            # The k range's o_proj x is written by exactly the step tasks of the heads it spans.
            producers = [tasks[t] for t in signalled_by[wait]]
            assert len(producers) == target and all(producer[0] == STEP for producer in producers)
            fed = set()
            for _, first, count, *_ in producers:
                fed.update(range(first * 128, (first + count) * 128))
            begin, end = aux * schedule.out_range_k, min((aux + 1) * schedule.out_range_k, qkv)
            assert fed >= set(range(begin, end)), f"o_proj range {aux} waits on heads that miss some of its k"
            assert all(any(begin <= k < end for k in range(f * 128, (f + c) * 128)) for _, f, c, *_ in producers)
        if kind in (UP_F, UP_G):
            assert target == sum(task[0] == DOWN for task in tasks), "f_b / g_b must wait for all of f_a|g_a|b"


def test_a_step_before_its_inputs_is_caught():
    schedule = persistent.build_schedule(2304, 32, 4, 1)
    tasks = schedule.tasks.copy()
    step = int(np.flatnonzero(tasks[:, 0] == STEP)[0])
    broken = np.concatenate([tasks[step : step + 1], np.delete(tasks, step, axis=0)])
    with pytest.raises(AssertionError, match="waits for counter"):
        persistent.check_schedule(dataclasses.replace(schedule, tasks=broken))


@pytest.mark.parametrize("hidden,heads,message", [(4096, 63, "even number of heads"), (4100, 64, "hidden % 8"),
                                                  (4096, 0, "even number of heads")])
def test_unsupported_geometry_is_refused(hidden, heads, message):
    with pytest.raises(ValueError, match=message):
        persistent.build_schedule.__wrapped__(hidden, heads)


def test_python_mirrors_the_kernel_constants():
    source = kernels.kernel_source("decode_persistent")

    def define(name: str) -> int:
        match = re.search(rf"#define {name} (\d+)", source)
        assert match, name
        return int(match.group(1))

    assert define("DECODE_PERSISTENT_THREADS") == persistent.THREADS
    assert define("DECODE_PERSISTENT_TILES") == persistent.TILES
    assert define("DECODE_PERSISTENT_OUT_TILES") == persistent.OUT_TILES
    assert define("DECODE_PERSISTENT_TASK_INTS") == persistent.TASK_INTS
    assert define("COUNTER_TICKET") == persistent.TICKET and define("COUNTER_EXIT") == persistent.EXIT
    for kind, name in enumerate(persistent.KIND_NAMES):
        assert re.search(rf"TASK_{name.upper()} = {kind},", source), name


def test_a_wait_short_by_one_signal_is_caught():
    """Move the last producer a step waits on to just after the step: the step's counter then
    stands at target - 1 when its ticket comes, which must be refused."""
    schedule = persistent.build_schedule(2304, 32, 4, 1)
    tasks = schedule.tasks.copy()
    step = int(np.flatnonzero(tasks[:, 0] == STEP)[0])
    counter = tasks[step, 3]
    producer = max(t for t in range(step) if counter in tasks[t, 5:])
    order = [t for t in range(len(tasks)) if t != producer]
    order.insert(order.index(step) + 1, producer)
    with pytest.raises(AssertionError, match="waits for counter"):
        persistent.check_schedule(dataclasses.replace(schedule, tasks=tasks[order]))


@pytest.mark.parametrize("lags", LAGS, ids=lambda lags: "lag{}_{}".format(*lags))
@pytest.mark.parametrize("hidden,heads", GEOMETRIES, ids=lambda v: str(v))
def test_o_proj_tasks_never_precede_the_last_step(hidden, heads, lags):
    tasks = persistent.build_schedule(hidden, heads, *lags).tasks
    last_step = np.flatnonzero(tasks[:, 0] == STEP).max()
    outs = np.flatnonzero((tasks[:, 0] == OUT) & (tasks[:, 3] >= 0))
    assert (outs > last_step).all(), f"o_proj tickets {outs[outs < last_step].tolist()} before the last step {last_step}"

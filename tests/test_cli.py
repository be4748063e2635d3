"""`glm-kda` on a machine without a GPU: the README's demo command runs the NumPy path and says so,
`inspect` checks a checkpoint and names what is wrong, bad arguments are refused before any work,
and the GPU commands say they need a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm_kda import cli
from glm_kda.demo import run_demo
from glm_kda.device import gpu_status
from glm_kda.reference import STAGE_ORDER
from glm_kda.synthetic import write_synthetic_checkpoint

GPU_OK, _ = gpu_status()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The demo's checkpoint cache in a fresh folder."""
    monkeypatch.setenv("GLM_KDA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_demo_runs_the_numpy_path_and_says_so(cache, capsys):
    assert cli.main(["demo", "--geometry", "tiny-kimi", "--prompt", "9", "--steps", "3", "--cpu"]) == 0
    out = capsys.readouterr().out
    assert "--cpu given: running the NumPy reference path" in out, out
    assert "(numpy path)" in out and "9 prefill + 3 decode tokens" in out, out
    for stage in STAGE_ORDER:
        assert f"\n{stage} " in out, f"stage {stage} missing from the demo's table:\n{out}"
    assert (cache / "tiny-kimi-seed0" / "config.json").exists(), "the synthetic checkpoint was not cached"



def test_demo_of_a_geometry_the_kernels_do_not_run_takes_the_numpy_path_and_says_why(cache, capsys, monkeypatch):
    """With a GPU at hand, a tiny geometry (head_dim 16) still runs: on the NumPy path, with the
    kernels' limit named, not as a traceback from the layer."""
    from glm_kda import demo

    monkeypatch.setattr(demo, "gpu_status", lambda: (True, "a stand-in GPU"))
    monkeypatch.setattr(demo, "_run_gpu", lambda *args: pytest.fail("the kernels were asked to run head_dim 16"))
    assert cli.main(["demo", "--geometry", "tiny-glm", "--prompt", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "the CUDA kernels do not run this geometry (head_dim=16" in out and "(numpy path)" in out, out

def test_demo_table_is_the_oracle_comparison_of_its_tokens(cache):
    """The NumPy path's table is the BF16-faithful oracle (prefill, then one decode call a token) against
    the float64 oracle over all the tokens, recomputed here: every stage's ratio the same."""
    from glm_kda.checkpoint import bind_layer
    from glm_kda.demo import demo_checkpoint
    from glm_kda.reference import KdaOracle, compare_stages
    from glm_kda.synthetic import synthetic_hidden

    prompt, steps = 5, 2
    result = run_demo("tiny-glm", prompt=prompt, steps=steps, force_cpu=True)
    assert result["path"] == "numpy"
    layer = bind_layer(demo_checkpoint("tiny-glm"), 0, progress=False)
    hidden = synthetic_hidden(prompt + steps, layer.config.hidden, seed=1)
    faithful = KdaOracle(layer, "bf16")
    stages, state = faithful.prefill(hidden[:prompt], None, chunk=layer.config.chunk)
    rows = [stages]
    for t in range(prompt, prompt + steps):
        row, state = faithful.decode(hidden[t : t + 1], state)
        rows.append(row)
    ours = {k: np.concatenate([r[k] for r in rows]) for k in stages}
    exact, _ = KdaOracle(layer, "float64").prefill(hidden, None)
    expected = compare_stages(ours, exact).ratios()
    got = result["table"].ratios()
    assert set(got) == set(STAGE_ORDER), sorted(got)
    for stage in STAGE_ORDER:
        assert got[stage] == expected[stage], f"{stage}: demo {got[stage]:.6e}, recomputed {expected[stage]:.6e}"


def test_an_interrupted_checkpoint_write_is_not_taken_for_a_checkpoint(cache, monkeypatch):
    """The demo's cached checkpoint appears only once complete: a write stopped after config.json
    (Ctrl-C in the first run) leaves nothing the next run would bind, and the next run writes it."""
    from glm_kda import demo
    from glm_kda.checkpoint import bind_layer

    real_write = demo.write_synthetic_checkpoint

    def interrupted(path, geometry, **kwargs):
        (path / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "write_synthetic_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.demo_checkpoint("tiny-glm")
    assert not (cache / "tiny-glm-seed0").exists(), "an interrupted write left a checkpoint in place"
    assert list(cache.iterdir()) == [], f"scratch left behind: {list(cache.iterdir())}"
    (cache / "tiny-glm-seed0").mkdir()  # an empty directory, as an older interrupted run could leave
    monkeypatch.setattr(demo, "write_synthetic_checkpoint", real_write)
    path = demo.demo_checkpoint("tiny-glm")
    assert bind_layer(path, 0, progress=False).config.hidden > 0
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-glm-seed0"]


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--prompt", "-3"), ("--steps", "two")])
def test_demo_refuses_bad_counts_before_any_work(cache, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--geometry", "tiny-kimi", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "integer >= 1" in err, err
    assert not cache.exists(), "a refused demo wrote its checkpoint"
    with pytest.raises(ValueError, match="prompt and steps must be >= 1"):
        run_demo("tiny-kimi", prompt=4, steps=0)


def test_inspect_reports_a_clean_checkpoint(tmp_path, capsys):
    path = write_synthetic_checkpoint(tmp_path / "glm", "tiny-glm", num_layers=2)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "KDA layers bind cleanly" in out and "geometry: hidden" in out, out
    # The tiny geometry's head_dim is not one the CUDA kernels take: inspect says so, and why.
    assert "CUDA kernels: NOT supported: head_dim=" in out, out


def test_inspect_names_the_missing_config_key(tmp_path, capsys):
    path = write_synthetic_checkpoint(tmp_path / "glm", "tiny-glm", num_layers=2)
    config = json.loads((path / "config.json").read_text())
    key = "rms_norm_eps"
    assert key in config, sorted(config)
    del config[key]
    (path / "config.json").write_text(json.dumps(config))
    assert cli.main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"missing key '{key}'" in err and "config.json" in err, err


@pytest.mark.skipif(GPU_OK, reason="a GPU is present: the GPU commands would run")
@pytest.mark.parametrize("argv", [["bench", "decode"], ["bench", "prefill", "--geometry", "glm"],
                                  ["selftest", "--output", "x.json"]])
def test_gpu_commands_say_they_need_a_gpu(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "CUDA GPU" in captured.err + captured.out, captured
    if argv[0] == "selftest":  # it says why it did not run, and leaves no report behind
        assert captured.err.startswith("error: ") and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_bench_runs_the_checkouts_script_with_its_arguments(name, capsys, monkeypatch):
    """`glm-kda bench NAME ...` is benchmarks/NAME.py of the checkout with the arguments after NAME:
    its help, its refusals (argparse's status 2), and sys.argv given back afterwards."""
    import sys

    argv = list(sys.argv)
    with pytest.raises(SystemExit) as stop:  # (the top-level parser's own -h would also exit 0: not this)
        cli.main(["bench"])
    assert stop.value.code == 2
    capsys.readouterr()
    assert cli.main(["bench", name, "-h"]) == 0
    out = capsys.readouterr().out
    assert f"{name}.py" in out and "--variant" in out and "--geometry" in out, out
    assert cli.main(["bench", name, "--geometry", "llama"]) == 2
    assert "invalid choice: 'llama'" in capsys.readouterr().err
    assert sys.argv == argv


def test_bench_without_a_checkout_says_it_needs_one(capsys, monkeypatch, tmp_path):
    """From an installed wheel there is no benchmarks/ beside the package: the command says that the
    benchmarks need a source checkout, and exits 2."""
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: tmp_path / "benchmarks")
    assert cli.main(["bench", "decode", "--geometry", "glm"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "decode.py" in err and "installed wheel ships no benchmarks" in err, err


def test_selftest_without_pytest_says_how_to_get_it(capsys, tmp_path, monkeypatch):
    """On a GPU machine with only the package installed (no test extra), the self-test says what is
    missing in one error line and exits 2 before any GPU work, leaving no file behind."""
    import importlib.util
    import sys
    import types

    from glm_kda import selftest

    monkeypatch.setattr(selftest, "gpu_status", lambda: (True, "a stand-in GPU"))
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else found(name, *a))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["selftest", "--output", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pip install -e '.[test]'" in err, err
    assert not list(tmp_path.iterdir()), "a refused self-test left a file behind"


def test_every_option_of_every_command_has_help():
    import argparse

    parser_actions = []

    def collect(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    collect(sub)
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                parser_actions.append((parser.prog, action))

    captured = {}

    def build(argv):
        original = argparse.ArgumentParser.parse_args

        def grab(self, args=None, namespace=None):
            captured["parser"] = self
            raise SystemExit(0)

        argparse.ArgumentParser.parse_args = grab
        try:
            with pytest.raises(SystemExit):
                cli.main(argv)
        finally:
            argparse.ArgumentParser.parse_args = original

    build(["inspect", "x"])
    collect(captured["parser"])
    missing = [f"{prog} {action.dest}" for prog, action in parser_actions if not action.help]
    assert parser_actions and not missing, f"options without help: {missing}"


def test_demo_explains_its_columns_names_its_cache_and_judges_the_run(cache, capsys):
    cli.main(["demo", "--geometry", "tiny-kimi", "--prompt", "8", "--steps", "2", "--cpu"])
    cli.main(["demo", "--geometry", "tiny-kimi", "--prompt", "8", "--steps", "2", "--cpu"])
    out = capsys.readouterr().out
    assert "rms-ratio: rms(ours - float64) / rms(float64)" in out and "max-abs" in out
    assert "verdict: final_out" in out
    assert f"cached at {cache}" in out, out


def test_the_demos_gpu_verdict_holds_the_kernels_to_the_oracles_floor(tmp_path):
    """The verdict on a GPU run (its arithmetic, on the host): ours against 1.5x the BF16 oracle's error."""
    from glm_kda import bind_layer, compare_stages
    from glm_kda.demo import _verdict
    from glm_kda.reference import KdaOracle
    from glm_kda.synthetic import synthetic_hidden, write_synthetic_checkpoint

    layer = bind_layer(write_synthetic_checkpoint(tmp_path / "c", "tiny-glm"), 0, progress=False)
    hidden = synthetic_hidden(6, layer.config.hidden, seed=2)

    def run(precision):
        oracle = KdaOracle(layer, precision)
        stages, state = oracle.prefill(hidden[:4], None)
        rows = [stages["final_out"]]
        for t in range(4, 6):
            step, state = oracle.decode(hidden[t : t + 1], state)
            rows.append(step["final_out"])
        return np.concatenate(rows)

    exact, faithful = run("float64"), run("bf16")
    same = compare_stages({"final_out": faithful}, {"final_out": exact})
    assert _verdict(same, layer, hidden, 4, exact, True).startswith("verdict: PASS")
    worse = compare_stages({"final_out": faithful * 1.01}, {"final_out": exact})
    assert _verdict(worse, layer, hidden, 4, exact, True).startswith("verdict: FAIL")

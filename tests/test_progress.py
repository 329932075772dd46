"""Every long step reports how far along it is: the weights' range searches (the GGUF sub-block search among
them) and GPTQ/AdaRound, in every mode; the CLI draws them (a line every tenth with the time left when stderr is
not a terminal) and --quiet prints nothing."""

import json

import pytest

from qtool.hooks import Hooks
from qtool.pipeline import CalibrateOptions, run_calibrate
from tests.helpers import run_cli, tiny_llama_and_ids

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_and_ids(tmp_path_factory.mktemp("progress"))


def _steps(ckpt, recipe, tmp_path, **opts):
    seen = {}
    hooks = Hooks(on_step=lambda name, done, total, item: seen.setdefault(name, []).append((done, total, item)))
    run_calibrate(str(ckpt), recipe, str(tmp_path / "run"), CalibrateOptions(**opts), hooks=hooks)
    return seen


def _complete(calls, total):
    """From 0 to ``total``, never backwards, every call naming what it is on."""
    done = [d for d, _, _ in calls]
    return done[0] == 0 and done[-1] == total and done == sorted(done) and {t for _, t, _ in calls} == {total} \
        and all(item for _, _, item in calls)


@pytest.mark.parametrize("sequential", [False, True])
def test_weight_searches_and_gptq_report_every_layer(llama, tmp_path, sequential):
    ckpt, ids = llama
    seen = _steps(ckpt, "w4a16-block32-gptq", tmp_path, data=str(ids), sequential=sequential)
    searches = seen["calibrating weights"]
    rounding = seen["choosing codes (gptq)"]
    if sequential:  # block by block: each block's weights are one step of their own
        assert all(total <= 7 for _, total, _ in searches)
    else:
        assert _complete(searches, 15)  # the embedding and 2 layers x 7 matrices (lm_head stays float)
        assert _complete(rounding, 14)  # the embedding keeps round-to-nearest
    assert sum(1 for d, t, _ in rounding if d == t) >= 1


def test_a_data_free_gguf_mix_reports_its_sub_block_search(llama, tmp_path):
    ckpt, _ = llama
    seen = _steps(ckpt, "gguf-q4_k_m", tmp_path)
    assert _complete(seen["calibrating weights"], 16)  # 14 matrices, the embedding, lm_head


def test_the_cli_prints_steps_when_not_on_a_terminal_and_nothing_when_quiet(llama, tmp_path, monkeypatch):
    from qtool.cli.output import _Progress

    ckpt, ids = llama
    monkeypatch.setattr(_Progress, "STEP_QUIET_S", 0.0)  # (a tiny model's steps are shorter than the default)
    code, out, err = run_cli("calibrate", ckpt, "-c", "w4a16-block32-gptq", "--data", ids, "-o", tmp_path / "a",
                             "--json")
    assert code == 0, err
    assert "calibrating weights: 1/15" in err and "calibrating weights: 15/15" in err
    assert "choosing codes (gptq): 14/14" in err and "left" in err
    assert json.loads(out)["ok"] is True  # stdout stays one JSON object
    code, out, err = run_cli("calibrate", ckpt, "-c", "w4a16-block32-gptq", "--data", ids, "-o", tmp_path / "b",
                             "--quiet")
    assert code == 0 and err.strip() == "" and out.strip() == ""


def test_report_says_it_is_measuring(llama, tmp_path):
    """`report` runs batches to measure, not to calibrate: its progress said "calibrating: batch 1/1"."""
    ckpt, ids = llama
    code, _, err = run_cli("calibrate", ckpt, "-c", "w8a16", "-o", tmp_path / "run")
    assert code == 0, err
    code, _, err = run_cli("report", ckpt, "-e", tmp_path / "run/encodings.json", "--data", ids, "--json")
    assert code == 0, err
    assert "measuring: batch 1/1" in err and "calibrating" not in err


def test_the_size_search_and_the_sensitivity_ranking_report_their_progress(llama, tmp_path, monkeypatch):
    """Both ran for half an hour on SmolLM2 with no line on a log (their progress went to the export bar, drawn only
    on a terminal, as "exporting")."""
    from qtool.cli.output import _Progress

    ckpt, ids = llama
    monkeypatch.setattr(_Progress, "STEP_QUIET_S", 0.0)
    code, _, err = run_cli("calibrate", ckpt, "--candidates", "w4a16-block32,w8a16", "--target-bpw", "14",
                           "--data", ids, "-o", tmp_path / "mix")
    assert code == 0, err
    assert "measuring damage: " in err and "left" in err
    code, _, err = run_cli("report", ckpt, "-e", tmp_path / "mix/encodings.json", "--data", ids, "--sensitivity")
    assert code == 0, err
    assert "ranking layer sensitivity: " in err


def test_quantizers_that_saw_no_data_are_one_line_that_does_not_blame_the_module(tmp_path):
    """An attention module takes hidden_states by keyword and returns a tuple: its activation quantizers saw no
    data, and each got a line saying "its module never ran", which it did (an MoE printed thousands of lines)."""
    from tests.helpers import tiny_llama_and_ids

    ckpt, ids = tiny_llama_and_ids(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: null\n  activations: null\nlayers:\n"
                      "  - type: LlamaAttention\n    activations: {bitwidth: 8, outputs: true}\n")
    code, out, err = run_cli("calibrate", ckpt, "-c", recipe, "--data", ids, "-o", tmp_path / "c", "--json")
    assert code == 0, err
    assert json.loads(out)["uncalibrated"] == [f"model.layers.{i}.self_attn.{t}" for i in range(2)
                                               for t in ("input", "output")]
    lines = [x for x in err.splitlines() if "saw no data" in x]
    assert lines == ["warning: model.layers.0.self_attn.input, model.layers.0.self_attn.output, "
                     "model.layers.1.self_attn.input and 1 more saw no data and stay float: the module never ran (an "
                     "expert no token reached, a layer the data's kind does not reach: a cross-attention layer on text "
                     "alone), or takes its input by keyword or returns no tensor, where an "
                     "activation quantizer cannot reach (the list: uncalibrated in --json)"], err

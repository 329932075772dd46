"""Recipes: schema, errors with file/key/line, precedence, resolution against real module trees."""

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from qtool.config import load_recipe, parse_recipe, resolve_plan
from qtool.errors import ConfigError

from tests.helpers import error_lines, run_cli
from tests.tinymodels import convnet, mlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(64, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.norm = nn.LayerNorm(64)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(64, 100)


def plan_of(text, model=None, **kw):
    return resolve_plan(parse_recipe(text, "r.yaml"), model or Tiny(), "r.yaml", **kw)


def rows(plan):
    return {q.name: q for q in plan.quantizers}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    load_recipe(path)


def test_shipped_recipe_names():
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {
        "w8a8.yaml", "w8a16.yaml", "w4a16-block32.yaml", "w4a8-block32.yaml"}


def test_defaults_cover_linear_conv_embedding():
    p = rows(plan_of("version: 1"))
    assert p["embed.weight"].shape == (100, 1)
    assert "embed.input" not in p  # integer indices are never quantized
    assert p["blocks.0.attn.weight"].granularity == "per_channel"
    assert p["blocks.0.attn.input"].symmetric is False
    assert "blocks.0.attn.output" not in p  # outputs are off by default
    assert not any(n.startswith("blocks.0.norm") for n in p)
    c = rows(plan_of("version: 1", convnet()))
    assert c["conv1.weight"].shape == (32, 1, 1, 1)


def test_later_rules_win_and_merge_over_defaults():
    text = """
version: 1
defaults:
  weights: {bitwidth: 8, granularity: per_channel}
layers:
  - match: "re:blocks\\\\..*\\\\.mlp\\\\..*"
    weights: {bitwidth: 4, granularity: per_block, block_size: 32}
    activations: null
  - match: "blocks.1.mlp.2"
    weights: {bitwidth: 6}
ignore: ["lm_head"]
"""
    p = rows(plan_of(text))
    assert p["blocks.0.mlp.0.weight"].bitwidth == 4
    assert p["blocks.0.mlp.0.weight"].shape == (128, 2) and p["blocks.0.mlp.0.weight"].block_size == (1, 32)
    assert "blocks.0.mlp.0.input" not in p
    # second rule keeps the first rule's block granularity and only changes bitwidth
    assert p["blocks.1.mlp.2.weight"].bitwidth == 6 and p["blocks.1.mlp.2.weight"].block_size == (1, 32)
    assert p["blocks.0.attn.weight"].bitwidth == 8
    assert not any(n.startswith("lm_head") for n in p)


def test_a_rules_analyzer_and_rounding_replace_the_ones_before_and_name_their_algorithm():
    """rounding: {dampening: 0.1} over gptq defaults said "rounding nearest takes no parameters", naming an
    algorithm the entry never wrote: a rule's rounding (and analyzer) replaces the one before whole."""
    head = ("version: 1\ndefaults:\n  weights: {bitwidth: 4, rounding: {name: gptq, dampening: 0.05, act_order: true}}"
            "\n  activations: null\nlayers:\n  - match: 'blocks.0.mlp.0'\n    weights: {rounding: %s}\n")
    with pytest.raises(ConfigError, match=r"r.yaml:\d+: layers\[0\].weights.rounding: an entry's rounding replaces "
                                          r"the one before whole, so it names its algorithm \(rounding: \{name: \.\.\., "
                                          r"dampening: \.\.\.\}\)"):
        plan_of(head % "{dampening: 0.1}")
    q = rows(plan_of(head % "{name: gptq, dampening: 0.1}"))["blocks.0.mlp.0.weight"]
    assert (q.rounding, dict(q.rounding_args)) == ("gptq", {"dampening": 0.1})  # (act_order: as docs/recipes.md says)


def test_null_defaults_disable_a_kind_and_rules_can_reenable():
    text = """
version: 1
defaults: {weights: null, activations: null}
layers:
  - match: "*.attn"
    weights: {bitwidth: 4, granularity: per_tensor}
"""
    p = rows(plan_of(text))
    assert list(p) == ["blocks.0.attn.weight", "blocks.1.attn.weight"]
    assert p["blocks.0.attn.weight"].symmetric is True  # schema default fills what the rule omits


def test_type_rule_opts_other_module_types_in():
    text = """
version: 1
defaults: {activations: null}
layers:
  - type: LayerNorm
    weights: {bitwidth: 8, granularity: per_tensor}
"""
    p = rows(plan_of(text))
    assert p["blocks.0.norm.weight"].shape == ()


def test_a_type_rule_with_no_spec_opts_modules_in_with_the_defaults():
    """'- type: ConvTranspose2d' alone quantized nothing (the module kept no spec to refine), and hid the coverage
    warning that named its weight; that warning called such a layer a type qtool cannot quantize."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 64, 2, stride=2))
    base = "version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_tensor}\n  activations: null\n"
    plan = plan_of(base, model)
    assert list(rows(plan)) == ["0.weight"]
    assert any("1.weight [8, 64, 2, 2] (ConvTranspose2d) (a layer type the defaults leave float: a layers rule "
               "with type: ConvTranspose2d opts it in (ConvTranspose2d: with per_tensor weights)" in w
               for w in plan.warnings), plan.warnings
    plan = plan_of(base + "layers:\n  - type: ConvTranspose2d\n", model)
    p = rows(plan)
    assert list(p) == ["0.weight", "1.weight"] and p["1.weight"].bitwidth == 4 and p["1.weight"].rule is None
    assert not [w for w in plan.warnings if "have no quantizer" in w]
    # a rule that sets one field sets that field alone (a LayerNorm's output quantizer did not bring its weight)
    plan = plan_of("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: {bitwidth: 8}\nlayers:\n"
                   "  - type: LayerNorm\n    activations: {outputs: true, inputs: false}\n",
                   nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    assert sorted(rows(plan)) == ["0.input", "0.weight", "1.output"]


def test_a_layer_whose_parent_reads_its_weight_without_calling_it_stays_float():
    """Mamba's conv1d (and dt_proj): transformers' kernels take the weight as a tensor, so a weight quantizer,
    which applies when its layer is called, never ran: calibration, report and eval measured it float while the
    file stored it quantized (Jamba's logits moved by 2.07 once the stored values were put in)."""
    import transformers

    from tests.tinymodels import ReadsItsConv

    plan = plan_of("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n", ReadsItsConv())
    assert list(rows(plan)) == ["in_proj.weight"]
    assert any(w.startswith("conv1d (in a ReadsItsConv): the model's code reads the weight without calling the "
                            "layer") for w in plan.warnings), plan.warnings
    from tests.tinymodels import CallsItsLayerAnotherWay, Derived

    for model, want in ((CallsItsLayerAnotherWay(), ["proj.weight", "q.weight", "k.weight"]),
                        (Derived(), ["fc.weight"])):
        plan = plan_of("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n", model)
        assert list(rows(plan)) == want and not [w for w in plan.warnings if "without calling" in w]
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.MambaForCausalLM(cfg)
    weights = {q.module.rsplit(".", 1)[-1] for q in plan_of("version: 1\n", model).weights}
    assert weights == {"embeddings", "in_proj", "x_proj", "out_proj", "lm_head"}, weights  # (conv1d, dt_proj: float)


def test_a_layer_the_model_calls_once_quantized_runs_its_quantizer():
    """Jamba's dt_proj: its mixer reads self.dt_proj.weight, or calls self.dt_proj "in case the model has been
    quantized" (config._is_quantized, which transformers sets loading a quantized file). The fake-quant model took
    the read, so calibration, report and eval ran dt_proj float while the file stored it, and its runtime ran it,
    quantized. qtool marks the configs while quantizers are in, as transformers does."""
    import transformers

    from qtool.model.insert import insert_quantizers, remove_quantizers, set_quantization

    cfg = transformers.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_experts=1,
                                   num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                                   mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)
    model = transformers.JambaForCausalLM(cfg).eval()
    plan = plan_of("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n", model)
    assert "model.layers.0.mamba.dt_proj.weight" in rows(plan)
    assert "model.layers.0.mamba.conv1d.weight" not in rows(plan)  # (read only: left float, as before)
    called = []
    model.model.layers[0].mamba.dt_proj.register_forward_hook(lambda *a: called.append(1))
    insert_quantizers(model, plan)
    set_quantization(model, False)  # (uncalibrated: the call is what is asked)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 8)))
    assert called and model.config._is_quantized
    remove_quantizers(model)
    assert not hasattr(model.config, "_is_quantized")


def test_gpt2s_conv1d_takes_per_tensor_weights_only():
    """transformers' Conv1D (GPT-2) stores its weight [in, out]: per_channel scales went per input channel."""
    from transformers.pytorch_utils import Conv1D

    rule = "version: 1\nlayers:\n  - type: Conv1D\n    weights: {bitwidth: 8, granularity: %s}\n"
    with pytest.raises(ConfigError, match=r"0 is a Conv1D, whose weight's first dimension is its input channels: "
                                          r"per_channel there would share scales across input, not output"):
        plan_of(rule % "per_channel", nn.Sequential(Conv1D(8, 4)))
    assert rows(plan_of(rule % "per_tensor", nn.Sequential(Conv1D(8, 4))))["0.weight"].shape == ()
    # GPTQ there is rounded to nearest: the warning named Linear and "Conv1d" to a user whose layer is Conv1D
    plan = resolve_plan(parse_recipe("version: 1\nlayers:\n  - type: Conv1D\n    weights: {bitwidth: 4, "
                                     "granularity: per_tensor, rounding: gptq}\n"), nn.Sequential(Conv1D(8, 4)))
    assert plan.warnings == ["0 (Conv1D): rounding gptq applies to Linear and Conv1d/Conv2d layers (transformers' "
                             "Conv1D, GPT-2's Linear stored transposed, is not one); this weight is rounded to nearest"]


def test_type_and_match_combine():
    text = """
version: 1
layers:
  - match: "blocks.*"
    type: Embedding
    weights: {bitwidth: 4}
"""
    # (the hint said to add type: Linear to a rule that names Embedding)
    with pytest.raises(ConfigError, match=r"layers\[0\].*matches no module of the model \(the modules match "
                                          r"'blocks.\*' names are .*Linear.*, none of type Embedding\)"):
        plan_of(text)


def test_unmatched_rule_is_error_or_warning():
    text = "version: 1\nlayers:\n  - match: 'decoder.*'\n    weights: {bitwidth: 4}\n"
    with pytest.raises(ConfigError, match=r"r.yaml: layers\[0\]: match 'decoder.\*' matches no module"):
        plan_of(text)
    plan = plan_of(text, allow_unmatched=True)
    assert any("matches no module" in w for w in plan.warnings)


def _shadowed(plan):
    return [w for w in plan.warnings if "change nothing" in w]


@pytest.mark.parametrize("layers, warned", [
    # the narrow rule before the broad one: the broad one sets bitwidth again on every module the first reaches
    ("  - match: 'blocks.0.*'\n    weights: {bitwidth: 8}\n  - match: 'blocks.*'\n    weights: {bitwidth: 6}\n",
     "layers[0] (match 'blocks.0.*'): its weights change nothing: layers[1]"),
    # a later null disables, and a partial rule after a null merges over the defaults, not over the null
    ("  - type: Linear\n    weights: {bitwidth: 8}\n  - match: '*'\n    weights: null\n",
     "layers[0] (type 'Linear'): its weights change nothing: layers[1]"),
    ("  - match: 'blocks.*'\n    weights: null\n  - type: Linear\n    weights: {bitwidth: 8}\n",
     "layers[0] (match 'blocks.*'): its weights change nothing: layers[1]"),
    # a null after an earlier rule resets to the defaults, which a later partial rule then merges over
    ("  - match: 'blocks.*'\n    weights: {bitwidth: 8}\n  - match: 'blocks.0.*'\n    weights: null\n"
     "  - match: 'blocks.0.*'\n    weights: {symmetric: false}\n", None),
    # field by field: the weights undone everywhere, the activations kept
    ("  - match: 'blocks.*'\n    weights: {bitwidth: 8}\n    activations: {bitwidth: 16}\n"
     "  - match: 'blocks.*'\n    weights: {bitwidth: 6}\n", "layers[0] (match 'blocks.*'): its weights change nothing"),
    # what survives somewhere, or on other keys, or in the other field, is no shadow
    ("  - match: 'blocks.*'\n    weights: {bitwidth: 8}\n  - match: 'blocks.0.*'\n    weights: {bitwidth: 6}\n", None),
    ("  - match: 'blocks.*'\n    weights: {bitwidth: 8}\n  - match: 'blocks.*'\n    weights: {symmetric: false}\n",
     None),
    ("  - match: 'blocks.*'\n    weights: {bitwidth: 8}\n  - match: 'blocks.*'\n    activations: {bitwidth: 16}\n",
     None),
])
def test_a_rule_that_later_rules_undo_everywhere_is_a_warning(layers, warned):
    plan = plan_of("version: 1\nlayers:\n" + layers)
    assert [warned in w for w in _shadowed(plan)] == ([True] if warned else []), plan.warnings


@pytest.mark.parametrize("rest, warned", [
    ("layers:\n  - match: 'blocks.0.*'\n    weights: {bitwidth: 4}\nignore: ['blocks.0.*']\n", True),
    ("layers:\n  - match: 'blocks.*'\n    weights: {bitwidth: 4}\nignore: ['blocks.0.*']\n", False),  # (kept on 1)
    ("layers:\n  - match: 'blocks.0.*'\n    weights: {bitwidth: 4}\nignore: ['blocks.1.*']\n", False),
])
def test_a_rule_that_ignore_undoes_everywhere_is_a_warning(rest, warned):
    """A rule whose every module ignore removes changed nothing, silently, where a rule a later one undoes is a
    warning and one that matches nothing an error."""
    plan = plan_of("version: 1\n" + rest)
    said = [w for w in plan.warnings if "every module it reaches is in ignore" in w]
    assert said == ([f"r.yaml: layers[0] (match 'blocks.0.*'): every module it reaches is in ignore (which removes "
                     "modules after every rule), so it changes nothing"] if warned else []), plan.warnings


def test_shipped_recipes_have_no_rule_that_changes_nothing():
    for path in sorted(CONFIGS.glob("*.yaml")):
        recipe = load_recipe(path)
        try:
            plan = resolve_plan(recipe, Tiny(), str(path), allow_unmatched=True)
        except ConfigError:  # (a mix needs Llama layers; 128x128 tiles do not fit this model)
            continue
        assert not _shadowed(plan), path


def test_a_rule_whose_types_have_no_weight_is_an_error_or_a_warning():
    """type: GELU with weights quantized nothing, with no word (LlamaRotaryEmbedding's the same)."""
    text = "version: 1\nlayers:\n  - type: GELU\n    weights: {bitwidth: 4}\n"
    with pytest.raises(ConfigError, match=r"r.yaml: layers\[0\]: type 'GELU' matches only modules with no weight, "
                                          "so its weights quantize nothing"):
        plan_of(text)
    assert any("matches only modules with no weight" in w for w in plan_of(text, allow_unmatched=True).warnings)
    # a rule that also sets activations, that turns weights off, or that is optional is not refused
    for rule in ("    weights: {bitwidth: 4}\n    activations: {bitwidth: 8}\n", "    weights: null\n",
                 "    optional: true\n    weights: {bitwidth: 4}\n"):
        assert not [w for w in plan_of(f"version: 1\nlayers:\n  - type: GELU\n{rule}").warnings if "no weight" in w]


def test_a_type_rule_that_reaches_only_a_media_tower_is_not_said_to_reach_weightless_modules():
    """(the weightless-rule check, on review: a tower's Conv2d has a weight, which the rule does not reach)"""
    class Vlm(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = nn.Sequential(nn.Conv2d(3, 8, 3))
            self.embed = nn.Embedding(100, 64)
            self.lm_head = nn.Linear(64, 100)

        def get_output_embeddings(self):
            return self.lm_head

    plan = plan_of("version: 1\nlayers:\n  - type: Conv2d\n    weights: {bitwidth: 4}\n", Vlm())
    assert "vision_tower.0.weight" not in rows(plan) and any("media encoders stay float" in w for w in plan.warnings)
    # a pattern naming the tower's layers quantizes them (recipes.md), with the defaults where it sets nothing else:
    # it kept them float and still said "a layers rule whose match names them quantizes them"
    for rule in ("  - match: 're:.*vision_tower.*'\n", "  - match: '*vision_tower*'\n"):
        plan = plan_of(f"version: 1\nlayers:\n{rule}", Vlm())
        assert "vision_tower.0.weight" in rows(plan) and not any("media encoders" in w for w in plan.warnings), rule


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_a_weight_with_no_values_is_named_with_its_own_shape():
    """nn.Linear(4, 0) read "shape [0, 1] has a dimension below 1" (the encoding's shape, not the weight's)."""
    model = Tiny()
    model.empty = nn.Linear(4, 0)
    with pytest.raises(ConfigError, match=re.escape("empty.weight has shape [0, 4], no values to quantize: add "
                                                    "'empty' to ignore")):
        plan_of("version: 1\n", model)
    assert "empty.weight" not in rows(plan_of("version: 1\nignore: [empty]\n", model))


def test_block_size_must_divide_input_dim():
    text = "version: 1\ndefaults:\n  weights: {granularity: per_block, block_size: 48}\n"
    with pytest.raises(ConfigError, match=r"defaults.weights.block_size: 48 does not divide the input dimension 64"):
        plan_of(text)



def test_2d_tiles_on_a_convolution_say_they_are_for_2d_weights():
    """32x32 tiles on a [32, 32, 3, 3] convolution weight were said not to divide it."""
    text = "version: 1\ndefaults:\n  weights: {granularity: per_block, block_size: [16, 16]}\n  activations: null\n"
    with pytest.raises(ConfigError, match=r"defaults.weights.block_size: 16x16 tiles are for a 2-D weight \(a "
                                          r"Linear's\); 0.weight has shape \[32, 32, 3, 3\]"):
        plan_of(text, nn.Sequential(nn.Conv2d(32, 32, 3)))


def test_activation_block_size_must_divide_the_last_dimension():
    """An FP8 per-block activation block of 48 on 64-wide layers linted clean, calibrated and exported; eval then
    failed with an internal error and report blamed the data."""
    act = "  activations: {element: fp8_e4m3, granularity: per_block, block_size: %d, dynamic: true%s}\n"
    text = "version: 1\ndefaults:\n  weights: null\n" + act
    model = nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96))
    with pytest.raises(ConfigError, match=r"r.yaml: defaults.activations.block_size: 48 does not divide the last "
                                          r"dimension 64 of 0's inputs"):
        plan_of(text % (48, ""), model)
    with pytest.raises(ConfigError, match=r"does not divide the last dimension 96 of 0's outputs"):
        plan_of(text % (64, ", outputs: true"), model)
    rule = "layers:\n  - type: LayerNorm\n    activations: {element: fp8_e4m3, granularity: per_block, " \
           "block_size: 64, dynamic: true}\n"
    with pytest.raises(ConfigError, match=r"layers\[0\].activations.block_size: 64 does not divide the last "
                                          r"dimension 96 of 1's inputs"):
        plan_of(text % (32, "") + rule, model)
    assert sorted(rows(plan_of(text % (16, ", outputs: true"), model))) == ["0.input", "0.output"]
    # a BatchNorm's weight is as long as its channels, not its input's last dimension (an image's width): refused
    # for that, not by its channels' count; a convolution's last dimension is spatial too (blocks along an image's
    # width calibrated with exit 0; one not dividing it failed at run time, blamed on the data); GPT-2's Conv1D (no
    # in_features) is checked by its weight's [in, out]
    from transformers.pytorch_utils import Conv1D

    for kind, model in [("BatchNorm2d", nn.Sequential(nn.BatchNorm2d(24))),
                        ("Conv2d", nn.Sequential(nn.Conv2d(3, 8, 3))), ("Conv1d", nn.Sequential(nn.Conv1d(3, 8, 3))),
                        ("GroupNorm", nn.Sequential(nn.GroupNorm(4, 16))),
                        ("InstanceNorm1d", nn.Sequential(nn.InstanceNorm1d(16, affine=True)))]:
        rule = f"layers:\n  - type: {kind}\n    activations: {{element: fp8_e4m3, granularity: per_block, " \
               "block_size: 16, dynamic: true}\n"
        with pytest.raises(ConfigError, match=rf"layers\[0\].activations.granularity: per_block activations take "
                                              rf"blocks along the last dimension, which for 0 \({kind}\) is not its "
                                              r"channels"):
            plan_of(text % (16, "") + rule, model)
    conv1d = "layers:\n  - type: Conv1D\n    activations: {element: fp8_e4m3, granularity: per_block, " \
             "block_size: 48, dynamic: true}\n"
    with pytest.raises(ConfigError, match=r"48 does not divide the last dimension 64 of 0's inputs"):
        plan_of("version: 1\ndefaults:\n  weights: null\n  activations: null\n" + conv1d,
                nn.Sequential(Conv1D(96, 64)))

@pytest.mark.parametrize(
    "text, needle",
    [
        ("version: 1\ndefaults:\n  weights: {bitwidth: 8, bogus: 1}\n", r"r.yaml:3: defaults.weights.bogus: unknown key"),
        ("version: 1\ndefaults:\n  weights: {bitwidth: 1}\n", r"r.yaml:3: defaults.weights.bitwidth: .*greater than or equal to 2"),
        ("version: 1\ndefaults:\n  weights: {bitwidth: 17}\n", r"defaults.weights.bitwidth: .*less than or equal to 16"),
        ("version: 1\ndefaults:\n  weights: {bitwidth: eight}\n", r"defaults.weights.bitwidth: .*integer"),
        # a number written as a string, or a float where a count goes, is a mistake to name, not to coerce
        ("version: 1\ndefaults:\n  weights: {bitwidth: '8'}\n", r"defaults.weights.bitwidth: .*integer \(got '8'\)"),
        ("version: 1\ndefaults:\n  weights: {bitwidth: 8.0}\n", r"defaults.weights.bitwidth: .*integer \(got 8.0\)"),
        ("version: 1\ndefaults:\n  weights: {analyzer: {name: percentile, percentile: '99.9'}}\n",
         r"defaults.weights.analyzer.percentile: .*valid number \(got '99.9'\)"),
        ("version: 1\nsmoothquant: {alpha: true}\n", r"smoothquant.alpha: .*valid number"),
        ("version: 1\nlayers:\n  - match: '*'\n    weights: {bitwidth: '4'}\n", r"layers\[0\].weights.bitwidth"),
        ("version: 1\ndefaults:\n  weights: {symmetric: maybe}\n", r"defaults.weights.symmetric"),
        ("version: 1\ndefaults:\n  weights: {granularity: per_row}\n", r"defaults.weights.granularity"),
        ("version: 1\ndefaults:\n  weights: {granularity: per_block}\n", r"needs block_size"),
        ("version: 1\ndefaults:\n  activations: {granularity: per_channel}\n", r"defaults.activations.granularity"),
        ("version: 1\ndefaults:\n  weights: {analyzer: magic}\n", r"defaults.weights.analyzer.name"),
        ("version: 2\n", r"r.yaml:1: version"),
        ("version: 1\nlayers:\n  - weights: {bitwidth: 4}\n", r"layers\[0\]: a layers entry needs 'match'"),
        ("version: 1\nlayers:\n  - match: 're:('\n", r"bad regular expression"),
        ("version: 1\nunknown_top: 3\n", r"r.yaml:2: unknown_top: unknown key"),
        ("version: 1\ndefaults: [1, 2\n", r"r.yaml:\d+: malformed YAML"),
        ("- just\n- a list\n", r"r.yaml:1: a recipe is a mapping"),
    ],
)
def test_bad_recipes_give_one_clear_error(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_recipe(text, "r.yaml")


def test_floats_in_exponent_form_are_numbers():
    """YAML 1.1 (PyYAML) reads 1e-3 as a string, which the stricter number fields then refused; a quoted one
    still is."""
    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_channel, rounding: "
                          "{name: gptq, dampening: 1e-2}}\nsmoothquant: {alpha: 5E-1}\n", "r.yaml")
    assert recipe.defaults.weights.rounding.dampening == 0.01 and recipe.smoothquant.alpha == 0.5
    with pytest.raises(ConfigError, match=r"dampening: Input should be a valid number \(got '1e-2'\)"):
        parse_recipe("version: 1\ndefaults:\n  weights: {rounding: {name: gptq, dampening: '1e-2'}}\n", "r.yaml")


def test_rule_override_errors_name_the_rule():
    text = "version: 1\nlayers:\n  - match: '*.attn'\n    weights: {bitwidth: 99}\n"
    with pytest.raises(ConfigError, match=r"layers\[0\].weights.bitwidth"):
        plan_of(text)


def test_cli_validate_reports_file_key_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ndefaults:\n  weights:\n    bitwidth: 8\n    colour: red\n")
    code, out, err = run_cli("config", "validate", bad)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1
    assert lines[0] == f"error: {bad}:5: defaults.weights.colour: unknown key"
    code, _, err = run_cli("config", "validate", *sorted(CONFIGS.glob("*.yaml")))
    assert code == 0, err


def test_cli_config_show_lists_every_quantizer(tmp_path):
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "mlp.safetensors"
    save_file(mlp().state_dict(), ckpt)
    code, out, err = run_cli("config", "show", CONFIGS / "w4a8-block32.yaml", "--model", ckpt,
                             "--model-class", "tests.tinymodels:mlp", "--json")
    assert code == 0, err
    import json

    plan = json.loads(out)["quantizers"]
    assert [(q["name"], q["bitwidth"], q["granularity"]) for q in plan if q["tensor"] == "weight"] == [
        ("0.weight", 4, "per_block"), ("2.weight", 4, "per_block"), ("4.weight", 4, "per_block")]
    assert plan[0]["shape"] == [128, 2] and plan[0]["block_size"] == [1, 32]
    assert torch.Size(plan[0]["shape"]).numel() == 256


def test_analyzers_are_chosen_per_rule_with_parameters():
    text = """
version: 1
defaults:
  weights: {analyzer: mse}
  activations: {analyzer: {name: percentile, percentile: 99.99}}
layers:
  - match: "blocks.0.*"
    activations: {analyzer: {name: sqnr, gamma: 2.0}}
"""
    p = rows(plan_of(text))
    assert p["blocks.1.attn.weight"].analyzer_label == "mse"
    assert p["blocks.1.attn.input"].analyzer_label == "percentile(percentile=99.99)"
    assert p["blocks.0.attn.input"].analyzer_label == "sqnr(gamma=2.0)"
    from qtool.model.insert import make_analyzer
    from qtool.quant.analyzers import PercentileEncodingAnalyzer, SqnrEncodingAnalyzer

    a = make_analyzer(p["blocks.1.attn.input"])
    assert isinstance(a, PercentileEncodingAnalyzer)
    assert isinstance(make_analyzer(p["blocks.0.attn.input"]), SqnrEncodingAnalyzer)


@pytest.mark.parametrize("text, needle", [
    ("version: 1\ndefaults:\n  weights: {analyzer: {name: minmax, percentile: 99}}\n",
     "analyzer minmax does not take 'percentile'"),
    ("version: 1\ndefaults:\n  weights: {analyzer: {name: percentile, percentile: 20}}\n",
     "defaults.weights.analyzer.percentile"),
    ("version: 1\ndefaults:\n  activations: {analyzer: mse}\n", "analyzer mse searches a weight tensor"),
])
def test_bad_analyzer_settings(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_recipe(text, "r.yaml")


# ---- a new user's first hour (#13): recipes by name, every problem at once, with hints ------------------------
def test_shipped_recipes_load_by_name_and_by_file_name():
    from qtool.config import load_recipe, recipe_file, shipped_recipes

    shipped = shipped_recipes()
    assert {"w8a8", "w8a8-dynamic", "w4a16-block32", "gguf-q4_0"} <= set(shipped)
    assert recipe_file("w8a8") == recipe_file("w8a8.yaml") == shipped["w8a8"]
    assert load_recipe("w8a8-dynamic").defaults.activations.dynamic is True


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    from qtool.config import recipe_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "w8a8.yaml").write_text("version: 1\n")
    assert recipe_file("w8a8.yaml") == Path("w8a8.yaml")


def test_a_recipe_given_as_parsed_yaml_or_as_its_text_says_what_a_recipe_argument_is(tmp_path):
    """A library caller's dict ended in pathlib's TypeError; YAML text read as a file name not found, the text's
    first 200 characters and their newlines in the one line."""
    from qtool.config import load_recipe

    with pytest.raises(ConfigError, match=r"a recipe is a shipped recipe's name, a path to a YAML file or a "
                                          r"RecipeFile \(got dict\)$"):
        load_recipe({"version": 1})
    with pytest.raises(ConfigError) as e:
        load_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 4}\n")
    assert str(e.value) == ("a recipe is a shipped recipe's name or a path to a YAML file, not its text (got text "
                            "beginning 'version: 1'): write it to a file")
    with pytest.raises(ConfigError, match="not its text"):  # (one line past 255 bytes: "File name too long")
        load_recipe("{weights: {bitwidth: 8}" + ", x: 1" * 50 + "}")
    odd = tmp_path / "two\nlines.yaml"  # (a file whose name holds a newline is still a file)
    odd.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4}\n")
    assert load_recipe(str(odd)).defaults.weights.bitwidth == 4


def test_an_unknown_recipe_name_lists_the_shipped_ones_and_the_nearest():
    from qtool.config import load_recipe

    with pytest.raises(ConfigError) as e:
        load_recipe("w8a9")
    text = str(e.value)
    assert "shipped recipes (fp8*, gguf*" in text and "w8a8*" in text and "did you mean w8a8" in text
    with pytest.raises(ConfigError, match="did you mean w4a16-block32 or w4a16-block32-gptq"):  # (a name's stem)
        load_recipe("w4a16")
    assert len(text) < 300  # one readable line (it listed all 40 names: 900 characters)


def test_every_problem_is_listed_with_its_line_and_a_hint(tmp_path):
    bad = tmp_path / "r.yaml"
    bad.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 8, granularty: per_channel}\n"
                   "  activations: {granularity: per_tenssor}\nlayers:\n  - name: 'encoder.*'\n    weights: {bits: 4}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    problems = e.value.problems
    assert len(problems) == 4 and str(e.value).endswith("(and 3 more)")
    assert problems[0] == f"{bad}:3: defaults.weights.granularty: unknown key (did you mean 'granularity'?)"
    assert problems[1].startswith(f"{bad}:4: defaults.activations.granularity:") and "did you mean 'per_tensor'" \
        in problems[1]
    assert problems[2] == f"{bad}:6: layers[0].name: unknown key (did you mean 'match'?)"
    assert problems[3] == f"{bad}:7: layers[0].weights.bits: unknown key (did you mean 'bitwidth'?)"
    # a `name:` for `match:` hid every later problem of the layers (the entry, left with neither, failed the rest)
    bad.write_text("version: 1\nlayers:\n  - name: x\n    weights: {granularity: per_blok}\n  - match: y\n"
                   "    weights: {bitwidth: 40}\ndefaults:\n  weights: {bitwidth: 99}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert [p.split(": ")[0] for p in e.value.problems] == [f"{bad}:8", f"{bad}:3", f"{bad}:4", f"{bad}:6"]
    assert [p.split(": ")[1] for p in e.value.problems] == [
        "defaults.weights.bitwidth", "layers[0].name", "layers[0].weights.granularity", "layers[1].weights.bitwidth"]
    # an unknown key in an entry that has no match or type either: both said, and the later entries' problems
    bad.write_text("version: 1\nlayers:\n  - bogus: 1\n  - match: y\n    weights: {bitwidth: 40}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert e.value.problems == [
        f"{bad}:3: layers[0].bogus: unknown key",
        f"{bad}:3: layers[0]: a layers entry needs 'match' (name pattern) or 'type' (module class)",
        f"{bad}:5: layers[1].weights.bitwidth: Input should be less than or equal to 16 (got 40)"]
    # a misspelt key inside a layers entry's rounding or analyzer: the hint came from the weights' own keys
    bad.write_text("version: 1\ndefaults: {weights: {bitwidth: 4}}\nlayers:\n  - match: '*'\n"
                   "    weights: {rounding: {name: gptq, dampning: 0.1}}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert str(e.value) == f"{bad}:5: layers[0].weights.rounding.dampning: unknown key (did you mean 'dampening'?)"
    # weights at the top level (a first recipe's slip) read "unknown key" with no hint
    bad.write_text("version: 1\nweights: {bitwidth: 4}\nactivation: null\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert e.value.problems == [
        f"{bad}:2: weights: unknown key at the top level (did you mean 'defaults.weights'? weights sit under "
        "defaults, or under a layers entry)",
        f"{bad}:3: activation: unknown key at the top level (did you mean 'defaults.activations'? activations sit "
        "under defaults, or under a layers entry)"]


def test_validate_checks_layers_entries_as_resolution_merges_them(tmp_path):
    """`granularity: per_blok` inside a layers entry used to pass validate and fail every command."""
    bad = tmp_path / "r.yaml"
    bad.write_text("version: 1\nlayers:\n  - match: 'x'\n    weights: {granularity: per_blok, block_size: 32}\n"
                   "  - match: 'y'\n    weights: {bitwdth: 4}\n")
    code, out, err = run_cli("config", "validate", bad, "--json")
    assert code == 2
    problems = json.loads(out)["errors"][0]["problems"]
    assert problems[0].startswith(f"{bad}:4: layers[0].weights.granularity:") and "did you mean 'per_block'" \
        in problems[0]
    assert problems[1].startswith(f"{bad}:6: layers[1].weights.bitwdth: unknown key") and "'bitwidth'" in problems[1]
    # a wrong key elsewhere hid every entry's problems, and an entry's first problem its others, until the next round
    bad.write_text("version: 1\ndefaults:\n  weights: {colour: red}\nlayers:\n  - match: 'x'\n"
                   "    weights: {granularity: per_blok, colour: red}\n  - match: 'y'\n    weights: {bitwidth: 99}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert [p.split(": ", 2)[:2] for p in e.value.problems] == [
        [f"{bad}:3", "defaults.weights.colour"], [f"{bad}:6", "layers[0].weights.granularity"],
        [f"{bad}:6", "layers[0].weights.colour"], [f"{bad}:8", "layers[1].weights.bitwidth"]], e.value.problems
    # an entry that is only valid after an earlier one (block_size over an earlier per_block) is fine
    good = tmp_path / "g.yaml"
    good.write_text("version: 1\nlayers:\n  - match: 'x'\n    weights: {granularity: per_block, block_size: 32}\n"
                    "  - match: 'x'\n    weights: {block_size: 64}\n")
    assert run_cli("config", "validate", good)[0] == 0
    # config show without a model reads it as validate does ("error: layers[1].weights: scale_dtype e8m0 is for
    # float elements", naming no file, on a recipe that validated and calibrated), and sees the data it needs
    mx = tmp_path / "mx.yaml"
    mx.write_text("version: 1\nlayers:\n  - match: '*.q_proj'\n    weights: {element: fp8_e4m3}\n"
                  "  - match: '*.q_proj'\n    weights: {granularity: per_block, block_size: 32, scale_dtype: e8m0,"
                  " rounding: gptq}\n")
    assert run_cli("config", "validate", mx)[0] == 0
    code, out, err = run_cli("config", "show", mx, "--json")
    assert code == 0, err
    assert json.loads(out)["needs_data"] is True


def test_config_list_describes_every_shipped_recipe():
    from qtool.config import shipped_recipes

    code, out, err = run_cli("config", "list", "--json")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out)["recipes"]}
    assert set(rows) == set(shipped_recipes())
    names = list(rows)  # a recipe before its variants (fp8 came after fp8-block: ".yaml" sorts after "-")
    assert names == sorted(names) and names.index("w8a8") < names.index("w8a8-dynamic")
    assert all(r["description"] and r["title"] for r in rows.values())  # every shipped recipe says what it is
    assert rows["w8a8"]["needs_data"] and not rows["w8a8-dynamic"]["needs_data"]
    assert rows["w4a16-block32-gptq"]["needs_data"] and not rows["w4a16-block32"]["needs_data"]
    assert rows["w4a16-block32-signround"]["needs_data"]
    assert rows["w8a8-dynamic"]["activations"] == "int8 per_token dynamic"


def test_config_show_without_a_model_resolves_the_defaults():
    code, out, err = run_cli("config", "show", "w4a16-block32", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["defaults"]["weights"] == {"bitwidth": 4, "symmetric": True, "granularity": "per_block",
                                           "block_size": 32, "analyzer": "minmax", "scale_dtype": "float32",
                                           "rounding": "nearest"}
    assert info["defaults"]["activations"] is None and info["needs_data"] is False
    assert info["ignore"] == ["lm_head"] and info["layers"][0]["type"] == "Embedding"
    code, out, _ = run_cli("config", "show", "w8a8")
    assert code == 0 and "needs calibration data: yes" in out


def test_commands_take_a_shipped_recipe_by_name(tmp_path):
    from safetensors.torch import save_file

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    code, out, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", "w8a16", "--model-class",
                             "tests.tinymodels:mlp", "-o", tmp_path / "run", "--json")
    assert code == 0, err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert Path(manifest["inputs"]["recipe"]["path"]).name == "w8a16.yaml"  # the file it resolved to, hashed
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "-c", "w8a9", "--model-class",
                           "tests.tinymodels:mlp", "-o", tmp_path / "run2")
    assert code == 2 and "did you mean w8a8" in err and not (tmp_path / "run2").exists()


def test_a_rule_that_matches_nothing_names_the_nearest_modules():
    model = nn.Sequential()
    enc = nn.Module()
    enc.layer = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    model.add_module("encoder", enc)
    with pytest.raises(ConfigError) as e:
        resolve_plan(parse_recipe("version: 1\nlayers:\n  - match: 'encoder.layers.*'\n    weights: {bitwidth: 4}\n",
                                  "r.yaml"), model)
    assert "matches no module" in str(e.value) and "nearest module names: encoder.layer" in str(e.value)
    with pytest.raises(ConfigError, match=r"module types nearby: Linear"):
        resolve_plan(parse_recipe("version: 1\nlayers:\n  - type: Linaer\n    weights: {bitwidth: 4}\n"), model)
    # a name that hits only a container, or a norm: what to write instead (it named the very module "nearest")
    enc.norm = nn.LayerNorm(4)
    with pytest.raises(ConfigError, match=r"that a quantizer can take \(encoder.layer is a ModuleList; match "
                                          r"'encoder.layer.\*' names the layers inside it\)"):
        resolve_plan(parse_recipe("version: 1\nlayers:\n  - match: 'encoder.layer'\n    weights: {bitwidth: 4}\n"),
                     model)
    with pytest.raises(ConfigError, match=r"that a quantizer can take \(encoder.norm is a LayerNorm\)"):
        resolve_plan(parse_recipe("version: 1\nlayers:\n  - match: '*.norm'\n    weights: {bitwidth: 4}\n"), model)
    # a container of no layer a quantizer takes (DBRX's experts hold bare 3-D parameters): its ".*" was suggested,
    # which then suggested ".*.*"
    enc.experts = nn.Sequential(nn.SiLU())
    with pytest.raises(ConfigError, match=r"\(encoder.experts is a Sequential, and no module inside it is a layer "
                                          r"type a quantizer takes\)"):
        resolve_plan(parse_recipe("version: 1\nlayers:\n  - match: '*.experts'\n    weights: {bitwidth: 4}\n"),
                     model)


# ---- hostile recipes (#14): no hang, no enormous error line ---------------------------------------------------
def test_yaml_aliases_are_refused_before_expansion():
    laughs = "version: 1\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(ConfigError, match="anchors and aliases"):
        parse_recipe(laughs, "r.yaml")


@pytest.mark.parametrize("pattern", ["re:(a+)+b", "re:(.*)*x", "re:(\\\\w+\\\\.){2,}z", "re:(x{1,3})+y",
                                     "re:((a+))+b", "re:(?:x(y+))*z", "re:(a+){1,30}b"])
def test_regexes_that_backtrack_exponentially_are_refused(pattern):
    with pytest.raises(ConfigError, match="repeats a group that itself repeats"):
        parse_recipe(f"version: 1\nlayers:\n  - match: '{pattern}'\n    weights: {{bitwidth: 4}}\n", "r.yaml")
    parse_recipe("version: 1\nlayers:\n  - match: 're:encoder\\\\.layer\\\\.\\\\d+\\\\..*'\n    weights: {bitwidth: 4}\n")
    for fine in ("re:^((?!vision|audio).)*proj$", "re:(a|ab){1,3}x", "re:(a+){2}b"):  # (lookaheads are atomic)
        parse_recipe(f"version: 1\nlayers:\n  - match: '{fine}'\n    weights: {{bitwidth: 4}}\n")


def test_error_lines_never_echo_a_whole_rejected_value():
    huge = "x" * 100_000
    with pytest.raises(ConfigError) as e:
        parse_recipe(f"version: 1\ndefaults:\n  weights: {{granularity: {huge}}}\n", "r.yaml")
    assert len(str(e.value)) < 400


@pytest.mark.parametrize("width", [80, 100, 160])
def test_config_list_fits_the_terminal_without_breaking_a_word(monkeypatch, width):
    """At 80 columns the table used to cut names and words mid-word ("llm-compress|or's") over 195 lines."""
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run_cli("config", "list")
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= width
    tokens = set(out.replace("│", " ").split())
    code, js, _ = run_cli("config", "list", "--json")
    for r in json.loads(js)["recipes"]:
        assert r["name"] in tokens
        assert all(word in tokens for word in r["title"].split()), r["title"]
    if width == 80:
        assert len(lines) < 130


@pytest.mark.parametrize("pattern, message", [
    ("blocks.0", "'blocks.0' names blocks.0, a Block that no quantizer takes, and the layers inside it (blocks.0.attn "
                 "...) stay quantized: 'blocks.0.*' names them"),
    ("*.mlp", "'*.mlp' names blocks.0.mlp, a Sequential that no quantizer takes, and the layers inside it"),
    ("Embedding", "'Embedding' is a module type, and ignore takes module names: a layers rule {type: Embedding, "
                  "weights: null, activations: null} keeps that type float"),
    ("lm_haed", "'lm_haed' matches no module (did you mean 'lm_head'?)"),
    ("embed.weight", "'embed.weight' is a parameter's name, and ignore takes module names: 'embed'"),
])
def test_an_ignore_entry_that_keeps_nothing_float_it_names_is_refused(pattern, message):
    """A container, a type's name or a misspelt name in ignore left every layer quantized without a word."""
    text = f"version: 1\ndefaults:\n  activations: null\nignore: [{pattern!r}]\n"
    with pytest.raises(ConfigError, match=re.escape(f"r.yaml: ignore[0]: {message}")):
        plan_of(text)
    plan = plan_of(text, allow_unmatched=True)  # a warning then, and the plan as the recipe says
    assert any(message in w for w in plan.warnings) and "blocks.0.attn.weight" in rows(plan)


def test_ignore_entries_that_do_their_job_or_name_nothing_near_are_quiet():
    text = "version: 1\ndefaults:\n  activations: null\nignore: ['blocks.0.*', 're:.*mlp[.]2', 'output', '*.norm']\n"
    plan = plan_of(text)
    assert not plan.warnings
    names = rows(plan)
    assert "blocks.0.attn.weight" not in names and "blocks.1.attn.weight" in names
    assert "blocks.1.mlp.0.weight" in names and "blocks.1.mlp.2.weight" not in names
    plan = plan_of("version: 1\ndefaults:\n  activations: null\nignore: [lm_head]\n", mlp())  # the safety net
    assert not plan.warnings and len(rows(plan)) == 3


@pytest.mark.parametrize("rule, message", [
    ("{match: null, type: [], weights: {bitwidth: 4}}", "type: [] names no module class"),  # was: every module
    ("{match: '*.attn', type: [], weights: {bitwidth: 4}}", "type: [] names no module class"),
    ("{type: '  ', weights: {bitwidth: 4}}", "type: an empty class name"),
    ("{match: '', weights: {bitwidth: 4}}", "match: '' is an empty pattern"),
])
def test_an_empty_type_or_pattern_is_refused(rule, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        plan_of(f"version: 1\nlayers:\n  - {rule}\n")


def test_a_number_past_pythons_digit_limit_is_one_line(tmp_path):
    """PyYAML's int() of a 5000-digit number raised ValueError: config validate printed a traceback (exit 1), other
    commands an internal error (exit 3)."""
    path = tmp_path / "r.yaml"
    path.write_text("version: 1\ndefaults:\n  weights: {bitwidth: " + "9" * 5000 + "}\n")
    for args in (("config", "validate", path), ("config", "show", path)):
        code, _, err = run_cli(*args)
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1 and f"{path}:3: malformed YAML: a number of more than 4000 digits" in \
            lines[0], (args, err)


def test_a_rule_whose_activations_reach_no_tensor_is_refused():
    """type: Embedding with activations made no quantizer and no warning (an Embedding's inputs are token ids)."""
    text = "version: 1\nlayers:\n  - {type: Embedding, activations: {bitwidth: 8}}\n"
    with pytest.raises(ConfigError, match=re.escape("r.yaml: layers[0]: type 'Embedding' matches only modules whose "
                                                    "inputs are integers (token ids)")):
        plan_of(text)
    plan = plan_of("version: 1\nlayers:\n  - {type: Embedding, activations: {bitwidth: 8, outputs: true}}\n")
    assert rows(plan)["embed.output"].bitwidth == 8 and "embed.input" not in rows(plan)
    # outputs: false under defaults that quantize outputs turns the table's off: an effect, which was refused
    plan = plan_of("version: 1\ndefaults:\n  activations: {bitwidth: 8, outputs: true}\nlayers:\n"
                   "  - {type: Embedding, weights: {bitwidth: 4}, activations: {outputs: false}}\n")
    assert "embed.output" not in rows(plan) and rows(plan)["embed.weight"].bitwidth == 4
    for text in ("version: 1\nlayers:\n  - {type: Embedding, activations: {bitwidth: 8, outputs: false}}\n",
                 "version: 1\ndefaults:\n  activations: {bitwidth: 8}\nlayers:\n"
                 "  - {type: Embedding, activations: {bitwidth: 4, outputs: false}}\n"):
        with pytest.raises(ConfigError, match="inputs are integers"):  # (no output quantizer to turn off)
            plan_of(text)


def test_activation_rules_on_embedding_subclasses_and_inputs_off():
    """Review: 'inputs: false' on a Linear was refused as if its inputs were token ids; and a subclass of Embedding
    (Gemma 3's scaled table) got an input quantizer on token ids, and passed the rule's check."""
    class Scaled(nn.Embedding):
        pass

    model = Tiny()
    model.embed = Scaled(100, 64)
    plan = plan_of("version: 1\nlayers:\n  - {match: blocks.0.attn, activations: {inputs: false}}\n", model)
    assert "blocks.0.attn.input" not in rows(plan) and "blocks.1.attn.input" in rows(plan)
    assert "embed.input" not in rows(plan_of("version: 1\n", model))  # the defaults' activations
    with pytest.raises(ConfigError, match="inputs are integers"):
        plan_of("version: 1\nlayers:\n  - {type: Embedding, activations: {bitwidth: 8}}\n", model)


def test_ignore_hints_name_only_whole_module_names():
    """Review: a leaf name was offered ('did you mean embed_tokens?' for model.embed_tokens on a wrapped model), which
    no whole name matches, and a safety-net entry close to a leaf (text_projection beside ViT's projection) was
    refused. The hint names the wrapped table's whole name; text_projection (another last part) stays quiet."""
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.language_model = nn.Module()
            self.model.language_model.embed_tokens = nn.Embedding(10, 8)
            self.vision = nn.Module()
            self.vision.projection = nn.Linear(8, 8)

    plan = plan_of("version: 1\ndefaults:\n  activations: null\nignore: [text_projection]\n", Wrapped())
    assert not plan.warnings and "vision.projection.weight" in rows(plan)
    with pytest.raises(ConfigError, match=re.escape("'model.embed_tokens' matches no module (did you mean "
                                                    "'model.language_model.embed_tokens'?)")):
        plan_of("version: 1\ndefaults:\n  activations: null\nignore: [model.embed_tokens]\n", Wrapped())


def test_ignoring_an_attention_layer_keeps_its_kv_cache_float_without_a_word():
    """CI: an attention layer in ignore is how a recipe keeps one layer's KV cache float (compressed-tensors then
    refuses the mix); it was refused as a container whose layers stay quantized."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2))
    plan = plan_of("version: 1\ndefaults:\n  activations: null\nkv_cache: {granularity: per_tensor}\n"
                   "ignore: [lm_head, model.layers.0.self_attn]\n", model)
    assert plan.kv_float == ["model.layers.0.self_attn"] and not plan.warnings


def test_config_show_says_what_the_activation_defaults_reach():
    """'activations of ..., Embedding' for every recipe (an Embedding's input is token ids); a recipe whose
    activations quantize neither inputs nor outputs said it needs calibration data."""
    from qtool.config import describe_recipe

    info = describe_recipe(parse_recipe("version: 1\n", "r.yaml"))
    assert "Linear" in info["default_types"]["activations"] and "Embedding" not in info["default_types"]["activations"]
    info = describe_recipe(parse_recipe("version: 1\ndefaults:\n  activations: {outputs: true}\n", "r.yaml"))
    assert "Embedding" in info["default_types"]["activations"]
    info = describe_recipe(parse_recipe("version: 1\ndefaults:\n  weights: null\n  activations: {inputs: false, "
                                        "outputs: false}\n", "r.yaml"))
    assert info["default_types"]["activations"] == [] and info["needs_data"] is False


@pytest.mark.parametrize("value, read", [("010", "YAML 1.1 would read it as 8"), ("0x4", "YAML 1.1 would read it as 4"),
                                         ("1_0", "YAML 1.1 would read it as 10"),
                                         ("1:20", "YAML 1.1 would read it as 80"),
                                         ("!!int abc", "not an integer at all"), ("!!int ''", "not an integer at all")])
def test_a_recipe_integer_is_read_only_in_decimal(value, read):
    """YAML 1.1 (PyYAML) read bitwidth: 010 as 8 without a word."""
    with pytest.raises(ConfigError, match=re.escape("r.yaml:3: malformed YAML: ") + ".* is not a decimal integer " +
                       re.escape(f"({read})")):
        parse_recipe(f"version: 1\ndefaults:\n  weights: {{bitwidth: {value}}}\n", "r.yaml")


def test_a_module_named_with_glob_characters_is_matched_by_its_name_and_written_recipes_name_it_alone():
    """ignore: ["x[0]"] named a module exactly yet left it quantized without a word (a glob's [0] is a class), and
    report --suggest / the size search wrote `match: x[0]`, which the next run refused (and `ß*?` would have
    matched every module starting with ß)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from qtool.config import exact_pattern
    from qtool.config.schema import name_matches

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            for n in ("x[0]", "x0", "ß*?", "ßa", "a b"):
                self.add_module(n, nn.Linear(4, 4))

    recipe = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                          "ignore: ['x[0]', 'ß*?']\n")
    plan = resolve_plan(recipe, Odd())
    assert sorted(q.module for q in plan.weights) == ["a b"]  # (x[0] by its name; as globs they name x0 and ßa)
    exact = parse_recipe("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                         f"ignore: [{json.dumps(exact_pattern('x[0]'))}, {json.dumps(exact_pattern('ß*?'))}]\n")
    assert sorted(q.module for q in resolve_plan(exact, Odd()).weights) == ["a b", "x0", "ßa"]

    names = st.text(st.sampled_from("ab.*?[]!-\\^$re:0ß"), min_size=1, max_size=12)

    @settings(max_examples=300, deadline=None)
    @given(names, names)
    def exactly(name, other):
        assert name_matches(exact_pattern(name), name)
        assert name_matches(exact_pattern(name), other) == (name == other)

    exactly()


def test_awq_with_a_rule_of_the_defaults_own_weights_is_a_recipe_that_quantizes():
    """`weights: {}` (the defaults' own settings, under defaults.weights: null) read as no weights at all: awq then
    refused the recipe as quantizing none."""
    base = "version: 1\ndefaults: {weights: null, activations: null}\nawq: {grid: 5}\n"
    with pytest.raises(ConfigError, match="awq chooses scales for quantized weights: the recipe quantizes none"):
        parse_recipe(base, "r.yaml")
    assert parse_recipe(base + "layers:\n  - {match: '*', weights: {}}\n", "r.yaml").layers[0].weights == {}


def test_a_refused_defaults_spec_gives_no_false_problem_on_the_entries_over_it():
    """Defaults refused whole (scale_dtype float16 with 8-bit asymmetric) were taken out, and each layers entry then
    merged over the built-in per_channel spec: 'block_size is only used with granularity per_block' for an entry
    whose defaults are per_block."""
    text = ("version: 1\ndefaults:\n  weights: {bitwidth: 8, symmetric: false, granularity: per_block, block_size: "
            "32, scale_dtype: float16}\n  activations: null\nlayers:\n  - {match: '*', weights: {block_size: 16}}\n")
    with pytest.raises(ConfigError) as e:
        parse_recipe(text, "r.yaml")
    assert len(e.value.problems) == 1 and "defaults.weights: scale_dtype float16" in e.value.problems[0], \
        e.value.problems
    # the entries' own values are still checked (not what depends on the defaults)
    with pytest.raises(ConfigError) as e:
        parse_recipe(text.replace("block_size: 16}", "block_size: 16, bitwidth: 99}"), "r.yaml")
    assert len(e.value.problems) == 2 and "layers[0].weights.bitwidth" in e.value.problems[1], e.value.problems


def test_a_wrong_type_value_hides_no_other_entrys_problems():
    """type: 5 (or a list holding a number) failed as a union, whose error location (type.list[str]) the recheck
    could not follow: every other entry's problems went unsaid until the next round."""
    for value in ("5", "[Linear, 3]"):
        with pytest.raises(ConfigError) as e:
            parse_recipe(f"version: 1\nlayers:\n  - type: {value}\n  - match: '*'\n    weights: {{granularity: "
                         "per_block}\n", "r.yaml")
        assert any("layers[1].weights" in p and "needs block_size" in p for p in e.value.problems), e.value.problems
        # one line for the type, not one per branch of its union (layers[0].type.str, layers[0].type.list[str][1])
        said = [p for p in e.value.problems if "layers[0]" in p]
        assert len(said) == 1 and "layers[0].type: a " in said[0] and "module class name" in said[0], said

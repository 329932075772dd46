"""Mixed precision at a size budget: `--target-bpw` / `--target-size` with `--candidates` choose each weight's
setting among the candidates' (the multiple-choice knapsack in qtool.quant.knapsack), counted in the bytes the
format writes, and write a recipe that reproduces the model."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtool.mixed import fused_groups, join_tied
from qtool.quant.knapsack import choose, frontier

from tests.helpers import error_lines, run_cli, tiny_llama


# ---- the knapsack ---------------------------------------------------------------------------------------------
@st.composite
def problems(draw, max_groups=6, max_cost=10**6):
    groups = draw(st.integers(1, max_groups))
    damage, cost = [], []
    for _ in range(groups):
        k = draw(st.integers(1, 4))
        cost.append(draw(st.lists(st.integers(0, max_cost), min_size=k, max_size=k)))
        damage.append(draw(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=k, max_size=k)))
    lo, hi = sum(min(c) for c in cost), sum(max(c) for c in cost)
    budget = draw(st.integers(max(lo - 5, 0), hi + 5))
    return damage, cost, budget


@settings(max_examples=300, deadline=None)
@given(problems(), st.sampled_from([1, 7, 100, 20000]))
def test_the_budget_is_never_exceeded(problem, resolution):
    damage, cost, budget = problem
    got = choose(damage, cost, budget, resolution=resolution)
    if sum(min(c) for c in cost) > budget:
        assert got is None
        return
    assert got.cost == sum(cost[g][k] for g, k in enumerate(got.options)) <= budget
    assert got.damage == pytest.approx(sum(damage[g][k] for g, k in enumerate(got.options)))


@settings(max_examples=200, deadline=None)
@given(problems(max_groups=4, max_cost=40))
def test_with_whole_units_the_choice_is_the_least_damage_that_fits(problem):
    damage, cost, budget = problem
    got = choose(damage, cost, budget, resolution=10**6)  # one unit per byte: exact
    fits = [o for o in itertools.product(*[range(len(c)) for c in cost])
            if sum(cost[g][k] for g, k in enumerate(o)) <= budget]
    if not fits:
        assert got is None
        return
    best = min(sum(damage[g][k] for g, k in enumerate(o)) for o in fits)
    assert got.damage == pytest.approx(best, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(problems())
def test_the_frontier_trades_size_for_damage(problem):
    damage, cost, _ = problem
    curve = frontier(damage, cost)
    assert curve[0].cost == pytest.approx(sum(min(c) for c in cost), rel=0.01, abs=60)
    for a, b in zip(curve, curve[1:]):
        assert b.cost > a.cost and b.damage < a.damage
    assert curve[-1].damage == pytest.approx(min(sum(min(d) for d in damage), curve[-1].damage))


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="costs are whole"):
        choose([[1.0]], [[-1]], 10)
    with pytest.raises(ValueError, match="finite"):
        choose([[float("nan")]], [[1]], 10)
    with pytest.raises(ValueError, match="at least one option"):
        choose([[]], [[]], 10)


def test_fused_siblings_share_one_group():
    mods = [f"model.layers.{i}.{p}" for i in range(2) for p in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    groups = fused_groups(mods)
    assert groups[0] == ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                         "model.layers.0.self_attn.v_proj")
    assert groups[2] == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert len(groups) == 9 and groups[-1] == ("lm_head",)
    # BERT's query/key/value; an unrelated q_proj under another parent stays apart
    assert fused_groups(["a.query", "a.key", "a.value", "b.q_proj"]) == [("a.query", "a.key", "a.value"),
                                                                          ("b.q_proj",)]


def test_one_projection_of_every_expert_is_one_group():
    """GGUF stacks a layer's experts into one tensor per projection, of one type (and vLLM's MoE kernels run one
    scheme for them): a mix that chose per expert was refused at export, after the search."""
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")]
    groups = fused_groups(["model.layers.0.self_attn.o_proj", *experts, "model.layers.0.mlp.shared_expert.down_proj",
                           "model.layers.1.mlp.experts.0.w1", "model.layers.1.mlp.experts.0.w3",
                           "model.layers.1.mlp.experts.1.w1", "model.layers.1.mlp.experts.0.w2"])
    assert groups == [("model.layers.0.self_attn.o_proj",),
                      tuple(m for m in experts if not m.endswith("down_proj")),
                      tuple(m for m in experts if m.endswith("down_proj")),
                      ("model.layers.0.mlp.shared_expert.down_proj",),
                      ("model.layers.1.mlp.experts.0.w1", "model.layers.1.mlp.experts.0.w3",
                       "model.layers.1.mlp.experts.1.w1"),
                      ("model.layers.1.mlp.experts.0.w2",)]


@pytest.mark.parametrize("first, other", [("nvfp4a16", "w8a16"), ("mxfp4a16", "w4a16-block32"),
                                          ("w8a16", "nvfp4a16")])
def test_the_written_recipe_gives_each_layer_its_candidates_grid_over_a_float_element_base(first, other):
    """An FP4 first candidate with an integer one: the written rule said bitwidth 8 and merged over fp4_e2m1 (one
    error line per layer, after the whole search)."""
    from qtool.config import load_recipe, parse_recipe, recipe_file, resolve_plan
    from qtool.mixed import mixed_recipe
    from tests.test_config import Tiny

    torch.manual_seed(0)
    model = Tiny()
    paths = [recipe_file(first), recipe_file(other)]
    plans = [resolve_plan(load_recipe(p), model, str(p)) for p in paths]
    chosen = {m: (1 if m.startswith("blocks.0.") else 0) for m in plans[0].weight_specs}
    text = mixed_recipe(Path(paths[0]).read_text(), plans, chosen, "test")
    mixed = resolve_plan(parse_recipe(text, "chosen.yaml"), model, "chosen.yaml").weight_specs
    for m, c in chosen.items():
        assert mixed[m] == plans[c].weight_specs[m], m


def test_a_tied_output_layer_takes_its_tables_choice():
    groups = [("model.embed_tokens",), ("model.layers.0.mlp.down_proj",), ("lm_head",)]
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    assert join_tied(groups, tied) == [("model.embed_tokens", "lm_head"), ("model.layers.0.mlp.down_proj",)]
    # a table no candidate quantizes (not in a group) leaves the output layer's group alone
    assert join_tied(groups[1:], tied) == groups[1:]
    assert join_tied(groups, {}) == groups


# ---- end to end -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("mixed")
    ckpt = tiny_llama(d / "llama", num_hidden_layers=2)
    ids = torch.randint(1, 256, (12, 32), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    return ckpt, d / "ids.safetensors"


def _tensor_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            total += t.numel() * t.element_size()
    return total


def _search(out: Path) -> dict:
    return json.loads((out / "calibration" / "search.json").read_text())


@pytest.mark.parametrize("fmt", ["compressed-tensors", "qtool"])
def test_the_searched_model_fits_its_budget_in_the_bytes_the_file_holds(llama, tmp_path, fmt):
    ckpt, data = llama
    base = ["quantize", ckpt, "--data", data, "-f", fmt, "--json", "-q"]
    code, out, err = run_cli(*base, "--candidates", "w4a16-block32-gptq,w8a16", "--target-bpw", "15",
                             "-o", tmp_path / "mix")
    assert code == 0, err
    target = json.loads(out)["target"]
    held = _tensor_bytes(tmp_path / "mix" / "model.safetensors")
    assert target["chosen"]["bytes"] == held <= target["budget"]["bytes"]
    assert target["chosen"]["bits_per_weight"] <= 15.0
    assert target["model_bytes"] == (tmp_path / "mix" / "model.safetensors").stat().st_size
    # both candidates were used, and the mix is closer to float than the cheaper uniform candidate
    assert all(n > 0 for n in target["chosen"]["groups"].values())
    cheap = min(target["uniform"], key=lambda u: u["bytes"])
    assert target["chosen"]["damage"] < cheap["damage"]
    # beside the KL it ranks by, the text's own perplexity on the search samples: float, each uniform candidate and
    # the chosen mix; int8 weights move it less than int4 ones
    f = target["float_perplexity"]
    assert f > 1 and target["chosen"]["perplexity"] > 1
    moved = {u["candidate"]: abs(math.log(u["perplexity"] / f)) for u in target["uniform"]}
    assert all(m > 0 for m in moved.values()), moved
    if fmt == "qtool":  # (compressed-tensors keeps the embedding float: moves of 1e-5 on this model, in any order)
        assert moved["w8a16"] < moved["w4a16-block32-gptq"], moved
    # the written recipe reproduces the model byte for byte
    code, _, err = run_cli(*base, "-c", tmp_path / "mix" / "recipe.yaml", "-o", tmp_path / "again")
    assert code == 0, err
    for f in ("model.safetensors", "calibration/encodings.json"):
        assert (tmp_path / "mix" / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f
    search = _search(tmp_path / "mix")
    assert search["format"] == fmt and search["candidates"] == ["w4a16-block32-gptq", "w8a16"]
    fused = [g for g in search["groups"] if g["modules"][0].endswith("q_proj")]
    assert fused and all(len(g["modules"]) == 3 for g in fused)
    manifest = json.loads((tmp_path / "mix" / "calibration" / "manifest.json").read_text())
    assert manifest["inputs"]["recipe"]["path"] == "recipe.yaml" and manifest["target"]["budget"]["bytes"] == \
        target["budget"]["bytes"]


def test_more_budget_never_predicts_more_damage(llama, tmp_path):
    ckpt, data = llama
    predicted = []
    for bpw in ("14", "15.5"):
        code, out, err = run_cli("calibrate", ckpt, "--data", data, "--json", "-q", "--candidates",
                                 "w4a16-block32-gptq,w8a16", "--target-bpw", bpw, "-o", tmp_path / bpw)
        assert code == 0, err
        predicted.append(json.loads(out)["target"]["chosen"]["predicted_damage"])
        assert (tmp_path / bpw / "recipe.yaml").is_file() and (tmp_path / bpw / "search.json").is_file()
    assert predicted[1] <= predicted[0]
    curve = json.loads((tmp_path / "14" / "search.json").read_text())["frontier"]
    assert [p["bytes"] for p in curve] == sorted(p["bytes"] for p in curve)


@pytest.mark.parametrize("flags,message", [
    (["--target-bpw", "4"], "below the smallest the candidates can make"),
    (["--target-bpw", "40"], "at or above the float checkpoint"),
    (["--target-size", "1KB"], "--target-size 1KB (1000 bytes): below the smallest the candidates can make"),
    (["--target-bpw", "-1"], "bits per weight lie between 0 and 64"),
    (["--target-size", "lots"], "--target-size"),
    (["--target-size", "0"], "is not a size above zero"),
    (["--target-size", "-5MB"], "'-5MB' is not a size like 5GB, 500MB or 2GiB"),
    (["--target-bpw", "15", "-f", "onnx"], "the search does not count --format onnx's bytes"),
])
def test_bad_budgets_are_one_line_exit_2_and_write_nothing(llama, tmp_path, flags, message):
    ckpt, data = llama
    code, _, err = run_cli("quantize", ckpt, "--data", data, "-f", "compressed-tensors", "--candidates",
                           "w4a16-block32-gptq,w8a16", *flags, "-q", "-o", tmp_path / "out")
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and message in lines[0], err
    assert "no limit" not in err  # (--max-shard-size's hint: a budget has one)
    assert not (tmp_path / "out").exists()


def test_candidates_that_quantize_nothing_say_so(llama, tmp_path):
    """Two recipes that quantize no weight read "below the smallest the candidates can make (the float
    checkpoint's bytes)", which said nothing of why."""
    ckpt, data = llama
    for name, tail in (("none.yaml", ""), ("none2.yaml", "# another\n")):
        (tmp_path / name).write_text("version: 1\ndefaults:\n  weights: null\n  activations: null\n" + tail)
    code, _, err = run_cli("calibrate", ckpt, "--data", data, "--candidates",
                           f"{tmp_path / 'none.yaml'},{tmp_path / 'none2.yaml'}", "--target-bpw", "20", "-o",
                           tmp_path / "out", "-q")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "quantize no weight of this model, so there is nothing to choose" \
        in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--target-bpw", "15"], "choose among --candidates"),
    (["-c", "w8a16", "--candidates", "w8a16,w4a16-block32", "--target-bpw", "15"], "exclude each other"),
    (["--candidates", "w8a16,w4a16-block32"], "needs a budget"),
    (["--candidates", "w8a16", "--target-bpw", "15"], "two or more recipes"),
    (["--candidates", "w8a16,w4a8-block32", "--target-bpw", "15"], "differs from w8a16"),
    (["--candidates", "w8a16,no-such-recipe", "--target-bpw", "15"], "no-such-recipe"),
    (["--candidates", "w4a16-block32,w8a16,w8a16.yaml", "--target-bpw", "15"],
     "w8a16 and w8a16.yaml are the same recipe"),
    ([], "pass a recipe with -c"),
    (["-c", "w8a16", "--search-metric", "nll"], "go with --candidates"),
    (["--candidates", "w8a16,w4a16-block32", "--target-bpw", "15", "--search-metric", "mse"],
     "--search-metric must be one of kl, nll"),
    (["--candidates", "w8a16,w4a16-block32", "--target-bpw", "15", "--search-data", "no/such/file.txt"],
     "--search-data path not found"),
])
def test_flags_that_do_not_go_together_are_refused(llama, tmp_path, args, message):
    ckpt, data = llama
    code, _, err = run_cli("calibrate", ckpt, "--data", data, *args, "-q", "-o", tmp_path / "out")
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_a_later_candidate_quantizing_a_layer_the_first_ignores_is_refused_before_any_calibration(llama, tmp_path):
    """The conflict was found once every candidate had been calibrated and measured (hours on a real model)."""
    ckpt, data = llama
    (tmp_path / "a.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, granularity: per_block, "
                                     "block_size: 32}\n  activations: null\nignore: ['*.q_proj', lm_head]\n")
    (tmp_path / "b.yaml").write_text("version: 1\ndefaults:\n  weights: {bitwidth: 8}\n  activations: null\n"
                                     "ignore: [lm_head]\n")
    code, _, err = run_cli("calibrate", ckpt, "--data", data, "--candidates", f"{tmp_path / 'a.yaml'},"
                           f"{tmp_path / 'b.yaml'}", "--target-bpw", "12", "-o", tmp_path / "out")
    assert code == 2, err
    assert "model.layers.0.self_attn.q_proj's setting from" in error_lines(err)[-1]
    assert "put the recipe that quantizes most layers first" in error_lines(err)[-1]
    assert "candidate 1/2" not in err and not (tmp_path / "out").exists(), err


def test_gguf_counts_llama_cpp_blocks_and_a_tied_output_layer(tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import save_file

    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", True, hidden=256)
    ids = torch.randint(1, 300, (8, 32), generator=torch.Generator().manual_seed(3))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, out, err = run_cli("quantize", ckpt, "--data", tmp_path / "ids.safetensors", "-f", "gguf", "--json", "-q",
                             "--candidates", "gguf-q3_k_m,gguf-q4_k_m,gguf-q6_k", "--target-bpw", "6",
                             "-o", tmp_path / "out")
    assert code == 0, err
    target = json.loads(out)["target"]
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    assert target["chosen"]["bytes"] == sum(int(t.n_bytes) for t in reader.tensors) <= target["budget"]["bytes"]
    assert len([g for g in target["chosen"]["groups"].values() if g]) >= 2


def test_a_tied_moe_models_gguf_budget_counts_the_output_layer_it_writes(tmp_path):
    """qwen2moe's llama.cpp loader needs output.weight, so GGUF writes the tied table twice: the budget counts the
    copy (it was counted free, and the file went over), and each expert projection takes one type."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import save_file

    from tests.test_gguf_families import _tiny

    ckpt = _tiny(tmp_path / "m", "qwen2_moe", tie_word_embeddings=True)
    ids = torch.randint(1, 200, (8, 32), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    code, out, err = run_cli("quantize", ckpt, "--data", tmp_path / "ids.safetensors", "-f", "gguf", "--json", "-q",
                             "--candidates", "gguf-q8_0,gguf-q4_0", "--target-size", "200KB", "-o", tmp_path / "out")
    assert code == 0, err
    target = json.loads(out)["target"]
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    assert "output.weight" in {t.name for t in reader.tensors}
    assert target["chosen"]["bytes"] == sum(int(t.n_bytes) for t in reader.tensors) <= 200_000


def test_report_draws_the_searched_curve_beside_the_uniform_candidates(llama, tmp_path):
    ckpt, data = llama
    code, _, err = run_cli("calibrate", ckpt, "--data", data, "-q", "--candidates", "w4a16-block32-gptq,w8a16",
                           "--target-bpw", "14", "-o", tmp_path / "run")
    assert code == 0, err
    enc = tmp_path / "run" / "encodings.json"
    for chart in ("curve.svg", "curve.png"):
        code, out, err = run_cli("report", ckpt, "-e", enc, "--data", data, "--pareto", tmp_path / chart, "--json",
                                 "-q")
        assert code == 0, err
        assert (tmp_path / chart).stat().st_size > 1000
    points = json.loads((tmp_path / "curve.json").read_text())
    assert points == json.loads(out)["pareto"]
    assert [u["candidate"] for u in points["uniform"]] == ["w4a16-block32-gptq", "w8a16"]
    assert points["chosen"]["bits_per_weight"] <= points["budget_bits_per_weight"] == 14.0
    assert points["chosen"]["held_out_damage"] == pytest.approx(json.loads(out)["end_to_end"]["kl_divergence"])
    assert (tmp_path / "curve.svg").read_text().lstrip().startswith("<?xml")
    code, _, err = run_cli("report", ckpt, "-e", enc, "--data", data, "--pareto", tmp_path / "c.jpg", "-q")
    assert code == 2 and ".png or .svg" in err
    code, _, err = run_cli("report", ckpt, "-e", tmp_path / "run" / "x" / "encodings.json", "--data", data,
                           "--pareto", tmp_path / "c.png", "-q")
    assert code == 2 and "no search.json" in err
    record = tmp_path / "run" / "search.json"
    search = json.loads(record.read_text())
    search["frontier"][0] = "x"
    record.write_text(json.dumps(search))
    code, _, err = run_cli("report", ckpt, "-e", enc, "--data", data, "--pareto", tmp_path / "broken.svg", "-q")
    assert code == 2 and len(error_lines(err)) == 1 and "search.json: frontier[0] must be a JSON object" in err, err
    assert not (tmp_path / "broken.svg").exists() and not (tmp_path / "broken.json").exists()


_SEARCH = {"format": "qtool", "damage": "mean per-token KL divergence (nats)",
           "budget": {"bits_per_weight": 6.0, "flag": "--target-bpw 6"},
           "chosen": {"bits_per_weight": 5.5, "predicted_damage": 0.01, "damage": 0.012},
           "frontier": [{"bits_per_weight": 4.5, "predicted_damage": 0.03}, {"bits_per_weight": 5.5,
                                                                            "predicted_damage": 0.01}],
           "uniform": [{"candidate": "w4a16", "bits_per_weight": 4.5, "damage": 0.03}]}


@pytest.mark.parametrize("path,value,needle", [
    ("frontier/1", "x", "frontier[1] must be a JSON object"),
    ("frontier", [], "frontier must be a non-empty list"),
    ("uniform/0/damage", None, "uniform[0].damage must be a finite number"),
    ("uniform/0/candidate", 7, "uniform[0].candidate must be a string"),
    ("chosen/bits_per_weight", 10**400, "chosen.bits_per_weight must be a finite number"),
    ("chosen/damage", "0.1", "chosen.damage must be a finite number"),
    ("budget", [6], "budget must be a JSON object"),
    ("budget/flag", False, "budget.flag must be a string"),
    ("damage", None, "damage must be a string"),
])
def test_a_malformed_search_record_is_one_line_naming_the_key(tmp_path, path, value, needle):
    import copy

    from qtool.errors import UsageError
    from qtool.report import pareto_points, read_search

    good = tmp_path / "search.json"
    good.write_text(json.dumps(_SEARCH))
    assert pareto_points(read_search(good))["curve"][1] == {"bits_per_weight": 5.5, "damage": 0.01}
    bad = copy.deepcopy(_SEARCH)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
    obj = bad
    for p in parents:
        obj = obj[p]
    obj[last] = value
    good.write_text(json.dumps(bad))
    with pytest.raises(UsageError) as e:
        read_search(good)
    assert str(e.value).startswith(f"{good}: ") and needle in str(e.value) and "\n" not in str(e.value)
    good.write_text(json.dumps(_SEARCH).replace("0.03", "NaN", 1))  # strict JSON: NaN is not a number here
    with pytest.raises(UsageError):
        read_search(good)


def test_a_swapped_weight_is_computed_with_and_everything_is_restored():
    """The search swaps one candidate's weights into the base model group by group: inside the block the module
    computes with exactly that weight (quantized or not), and afterwards the model computes as before."""
    from qtool.config import parse_recipe, resolve_plan
    from qtool.model.insert import computing_with, fake_quant_weight, insert_quantizers, set_stored_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    plan = resolve_plan(parse_recipe("version: 1\ndefaults: {weights: {bitwidth: 4}, activations: null}\n"
                                     "ignore: ['1']\n"), model)
    insert_quantizers(model, plan)
    q = model[0].qtool_quantizers["weight"]
    q.set_range(model[0].weight.detach().min(1, keepdim=True).values.clamp(max=0),
                model[0].weight.detach().max(1, keepdim=True).values.clamp(min=0))
    x = torch.randn(3, 8)
    before = model(x)
    assert fake_quant_weight(model[1]) is None and not torch.equal(fake_quant_weight(model[0]), model[0].weight)
    other0, other1 = torch.randn(8, 8), torch.randn(4, 8)
    with computing_with({model[0]: other0, model[1]: other1}):
        assert torch.equal(model(x), torch.nn.functional.linear(
            torch.nn.functional.linear(x, other0, model[0].bias), other1, model[1].bias))
    assert torch.equal(model(x), before)
    with computing_with({model[0]: None}):  # None: the float weight
        assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    assert torch.equal(model(x), before)
    stored = torch.zeros(8, 8)
    set_stored_weight(model[0], stored)
    with computing_with({model[0]: other0}):
        pass
    assert fake_quant_weight(model[0]) is stored


def test_a_mix_measured_worse_than_a_uniform_candidate_that_fits_falls_back_to_it(llama, tmp_path, monkeypatch):
    """The final measurement checks the per-layer prediction: where the calibrated mix measures more damage than a
    candidate whole that fits the budget, that candidate is what gets written (recipe.yaml says so), byte for byte
    what `-c candidate` writes."""
    import qtool.pipeline.search as pipeline

    ckpt, data = llama
    real = pipeline._measured_damage
    def worse(*a, **k):  # the mix: far worse
        damage, perplexity = real(*a, **k)
        return damage + 1.0, perplexity

    monkeypatch.setattr(pipeline, "_measured_damage", worse)
    code, out, err = run_cli("calibrate", ckpt, "--data", data, "--json", "-q", "--candidates",
                             "w4a16-block32-gptq,w8a16", "--target-bpw", "15.5", "-o", tmp_path / "mix")
    assert code == 0, err
    target = json.loads(out)["target"]
    assert target["fallback"]["candidate"] == "w8a16" and target["chosen"]["groups"]["w4a16-block32-gptq"] == 0
    assert "measured more damage" in (tmp_path / "mix" / "recipe.yaml").read_text()
    monkeypatch.undo()
    code, _, err = run_cli("calibrate", ckpt, "--data", data, "-q", "-c", "w8a16", "-o", tmp_path / "plain")
    assert code == 0, err
    mix, plain = (json.loads((tmp_path / d / "encodings.json").read_text()) for d in ("mix", "plain"))
    assert (mix.pop("recipe"), plain.pop("recipe")) == ("recipe.yaml", "w8a16.yaml") and mix == plain
    assert not (tmp_path / "mix" / "codes.safetensors").exists()  # the mix's GPTQ codes went with it
    search = json.loads((tmp_path / "mix" / "search.json").read_text())
    assert search["fallback"]["mix_damage"] > search["chosen"]["damage"]
    # the mix's perplexity on the search samples stays on record; the chosen one is uniform w8a16's
    w8 = next(u for u in search["uniform"] if u["candidate"] == "w8a16")
    assert search["fallback"]["mix_perplexity"] > 1 and search["chosen"]["perplexity"] == w8["perplexity"]


def test_ranking_by_the_text_loss_on_data_apart_from_the_calibration(llama, tmp_path):
    """--search-metric nll chooses by each group's change in the search text's next-token loss, and --search-data
    measures it on data of its own (here 5 samples the calibration never saw, so 5 are measured although
    --search-samples allows 8); the record says what it ranked by, and the prediction is the chosen changes' sum."""
    from safetensors.torch import save_file

    ckpt, data = llama
    apart = tmp_path / "apart.safetensors"
    # (samples of 80 tokens, past the model's 64 positions: calibration checks --data, and nothing checked these)
    save_file({"input_ids": torch.randint(1, 256, (5, 80), generator=torch.Generator().manual_seed(7))}, apart)
    code, out, err = run_cli("calibrate", ckpt, "--data", data, "--json", "-q", "--candidates",
                             "w4a16-block32-gptq,w8a16", "--target-bpw", "14", "--search-metric", "nll",
                             "--search-data", apart, "--search-samples", "8", "-o", tmp_path / "nll")
    assert code == 0, err
    past = f"--search-data {apart}: samples of 80 tokens run past the model's 64 positions"
    assert [w for w in json.loads(out)["warnings"] if w.startswith("--search-data")] == [
        w for w in json.loads((tmp_path / "nll" / "search.json").read_text())["warnings"]], out
    assert any(w.startswith(past) for w in json.loads(out)["warnings"]), out
    target = json.loads(out)["target"]
    assert target["chosen"]["bytes"] <= target["budget"]["bytes"]
    assert "NLL" in target["ranked_by"]
    search = json.loads((tmp_path / "nll" / "search.json").read_text())
    assert search["samples"] == 5
    changes = [g["nll_change"] for g in search["groups"]]
    assert all(c[0] == 0.0 for c in changes) and any(c[1] != 0.0 for c in changes)
    picked = [g["nll_change"][search["candidates"].index(g["choice"])] for g in search["groups"]]
    assert search["chosen"]["predicted_nll_change"] == pytest.approx(sum(picked))
    assert search["search_data"] == str(apart)
    # the choice is the knapsack's over the NLL changes (not the KL ones) within the budget
    cands, groups = search["candidates"], search["groups"]
    fixed = search["chosen"]["bytes"] - sum(g["bytes"][cands.index(g["choice"])] for g in groups)
    by_nll = choose([g["nll_change"] for g in groups], [g["bytes"] for g in groups], search["budget"]["bytes"] - fixed)
    assert [cands[k] for k in by_nll.options] == [g["choice"] for g in groups]
    # the KL prediction stays on record for the same choice
    kl = [g["damage_change"][search["candidates"].index(g["choice"])] for g in search["groups"]]
    base = next(u for u in search["uniform"] if u["candidate"] == "w4a16-block32-gptq")["damage"]
    assert search["chosen"]["predicted_damage"] == pytest.approx(base + sum(kl))


def test_ranking_by_the_text_loss_needs_a_language_model(tmp_path):
    from safetensors.torch import save_file

    from tests.tinymodels import mlp

    save_file(mlp().state_dict(), tmp_path / "m.safetensors")
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, tmp_path / "x.safetensors")
    code, _, err = run_cli("calibrate", tmp_path / "m.safetensors", "--model-class", "tests.tinymodels:mlp",
                           "--data", tmp_path / "x.safetensors", "--candidates", "w4a16-block32,w8a16",
                           "--target-bpw", "12", "--search-metric", "nll", "-q", "-o", tmp_path / "out")
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and "causal language models only" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_ranked_by_the_text_loss_the_final_check_compares_the_texts_perplexity(llama, tmp_path, monkeypatch):
    """Under --search-metric nll the check after calibration compares what the choice minimized: a mix whose
    search-text perplexity measured above a uniform candidate's that fits gives way to that candidate, even where
    its KL is lower."""
    import qtool.pipeline.search as pipeline

    ckpt, data = llama
    real = pipeline._measured_damage

    def worse_text(*a, **k):  # the mix: less KL, far more perplexity
        damage, perplexity = real(*a, **k)
        return damage * 0.5, perplexity * 2.0

    monkeypatch.setattr(pipeline, "_measured_damage", worse_text)
    code, out, err = run_cli("calibrate", ckpt, "--data", data, "--json", "-q", "--candidates",
                             "w4a16-block32-gptq,w8a16", "--target-bpw", "15.5", "--search-metric", "nll",
                             "-o", tmp_path / "mix")
    assert code == 0, err
    target = json.loads(out)["target"]
    fits = [u for u in target["uniform"] if u["bytes"] <= target["budget"]["bytes"]]
    assert target["fallback"]["candidate"] == min(fits, key=lambda u: u["perplexity"])["candidate"]
    assert target["chosen"]["groups"][target["fallback"]["candidate"]] > 0
    assert target["fallback"]["mix_perplexity"] > target["chosen"]["perplexity"]
    assert "measured more perplexity on the search text" in (tmp_path / "mix" / "recipe.yaml").read_text()


def test_one_group_holding_every_weight_changes_the_loss_as_the_whole_option_does(llama, tmp_path):
    """group_damage's per-group NLL change is the text's own loss change: with one group holding every weight,
    swapping it is swapping the whole model, so its change is log(perplexity together / perplexity of the base);
    int8 weights in an int4 model change the loss, and by less than int4 moves it from float."""
    import qtool
    from qtool.data import load_data
    from qtool.mixed import effective_weights, group_damage

    ckpt, data = llama
    for recipe in ("w4a16-block32", "w8a16"):
        code, _, err = run_cli("calibrate", ckpt, "--data", data, "-q", "-c", recipe, "-o", tmp_path / recipe)
        assert code == 0, err
    base = qtool.load_calibrated(str(ckpt), str(tmp_path / "w4a16-block32" / "encodings.json"))
    other = qtool.load_calibrated(str(ckpt), str(tmp_path / "w8a16" / "encodings.json"))
    modules = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    weights = effective_weights(other, modules)
    batches = list(load_data(data, batch_size=4))
    damage, changes, together, ppl = group_damage(base, batches, [tuple(modules)], [weights], torch.device("cpu"),
                                                  True)
    nll_change = ppl["nll_changes"][0][0]
    assert nll_change == pytest.approx(math.log(ppl["together"][0] / ppl["base"]), rel=1e-6, abs=1e-9)
    assert changes[0][0] + damage == pytest.approx(together[0], rel=1e-6)  # the KL side, the same way
    assert nll_change != 0.0
    assert abs(math.log(ppl["together"][0] / ppl["float"])) < abs(math.log(ppl["base"] / ppl["float"]))


def test_search_data_is_an_input_an_overwrite_never_deletes_and_nll_needs_tokens_to_score(llama, tmp_path):
    from safetensors.torch import save_file

    ckpt, data = llama
    out = tmp_path / "run"
    out.mkdir()
    inside = out / "apart.safetensors"
    save_file({"input_ids": torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(3))}, inside)
    args = ["calibrate", ckpt, "--data", data, "-q", "--candidates", "w4a16-block32-gptq,w8a16", "--target-bpw", "14"]
    code, _, err = run_cli(*args, "--search-data", inside, "-o", out, "--overwrite")
    assert code == 2 and "search data" in error_lines(err)[0], err
    assert inside.is_file()
    one = tmp_path / "one-token.safetensors"
    save_file({"input_ids": torch.randint(1, 256, (4, 1), generator=torch.Generator().manual_seed(3))}, one)
    code, _, err = run_cli(*args, "--search-data", one, "--search-metric", "nll", "-o", tmp_path / "nll")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and "no next token to score" in lines[0], err
    assert not (tmp_path / "nll").exists()


def test_a_budget_met_in_one_format_and_exported_in_another_says_how_far_over_it_is(llama, tmp_path):
    """calibrate --candidates counts qtool's format; compressed-tensors keeps the embedding float and ONNX every
    weight, and exporting in them missed the budget by up to 4.6x without a word."""
    ckpt, data = llama
    code, _, err = run_cli("calibrate", ckpt, "--candidates", "w4a16-block32,w8a16", "--target-bpw", "14",
                           "--data", data, "-o", tmp_path / "cal", "-q")
    assert code == 0, err
    enc = tmp_path / "cal" / "encodings.json"
    code, out, err = run_cli("export", ckpt, "-e", enc, "-o", tmp_path / "ct", "-f", "compressed-tensors", "--json")
    assert code == 0, err
    res = json.loads(out)
    over = [w for w in res["export_warnings"] if "the size budget" in w]
    assert len(over) == 1 and "was met in the qtool format" in over[0] and "--target-bpw 14" in over[0], over
    assert res["size"]["model_bytes"] > json.loads((tmp_path / "cal" / "search.json").read_text())["budget"]["bytes"]
    code, out, err = run_cli("export", ckpt, "-e", enc, "-o", tmp_path / "q", "--json")
    assert code == 0, err
    assert not [w for w in json.loads(out)["export_warnings"] if "the size budget" in w]
    # the same format with other options than the search counted: --no-pack's byte a 4-bit code went over silently
    code, out, err = run_cli("calibrate", ckpt, "--candidates", "w4a16-block32,w8a16", "--target-bpw", "10.6", "--data",
                             data, "-o", tmp_path / "tight", "-q")
    assert code == 0, err
    code, out, err = run_cli("export", ckpt, "-e", tmp_path / "tight" / "encodings.json", "-o", tmp_path / "unpacked",
                             "--no-pack", "--json")
    assert code == 0, err
    over = [w for w in json.loads(out)["export_warnings"] if "the size budget" in w]
    assert len(over) == 1 and "was met in the qtool format written with packed codes (no --no-pack)" in over[0], over
    # (ONNX cannot count a budget: the line does not send the user to a search that is refused)
    from qtool.export import get_exporter
    from qtool.pipeline.export import _budget_missed

    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(10 ** 9)
    over = _budget_missed(enc, "onnx", get_exporter("onnx").Options(), [big])
    assert "does not count --format onnx's bytes" in over and "quantize --format onnx" not in over, over
    ct = get_exporter("compressed-tensors")
    assert "quantize --format compressed-tensors" in _budget_missed(enc, "compressed-tensors", ct.Options(), [big])


def test_compressed_tensors_damage_is_measured_with_the_layers_it_writes_float(llama, tmp_path):
    """compressed-tensors keeps the embedding table float and its bytes were counted so, but the damage ranked was
    measured with the table at int8: bit for bit the qtool format's figures."""
    ckpt, data = llama
    damage = {}
    for fmt, bpw in (("qtool", "14"), ("compressed-tensors", "29")):
        code, out, err = run_cli("quantize", ckpt, "--candidates", "w4a16-block32,w8a16", "--target-bpw", bpw,
                                 "--data", data, "-f", fmt, "-o", tmp_path / fmt, "--json", "-q")
        assert code == 0, err
        damage[fmt] = {u["candidate"]: u["damage"] for u in json.loads(out)["target"]["uniform"]}
    # the same calibrations; only the table's quantizer differs (int8 in qtool's file, float in compressed-tensors')
    for c in ("w4a16-block32", "w8a16"):
        assert damage["compressed-tensors"][c] != damage["qtool"][c], damage
    # what the export measures against the float model for the chosen file agrees with the float table
    assert damage["compressed-tensors"]["w8a16"] < damage["qtool"]["w8a16"], damage


def test_a_searched_recipes_plan_warnings_name_it_as_the_output_holds_it(tmp_path):
    """The chosen recipe's warnings named its temporary path (.OUT.tmp-HOST-PID-.../recipe.yaml) in the manifest,
    the --json summary and stderr: two identical runs wrote different manifests."""
    import pydoc_data.topics

    from tests.test_gguf import _tiny_llama

    ckpt = _tiny_llama(tmp_path / "m", False)  # (a byte-level BPE tokenizer, which GGUF takes)
    data = tmp_path / "calib.txt"
    data.write_text(" ".join(list(pydoc_data.topics.topics.values())[:30]))
    args = ["quantize", ckpt, "--data", data, "--candidates", "gguf-q4_0,w8a16", "--target-bpw", "12", "-f", "gguf",
            "--gguf-fallback", "f16", "-o", tmp_path / "o", "--json", "-q"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    warnings = json.loads(out)["warnings"]
    first = (tmp_path / "o" / "calibration" / "manifest.json").read_bytes()
    assert any(w.startswith("recipe.yaml: layers[") for w in warnings), warnings
    assert not [w for w in warnings if ".tmp-" in w], warnings
    code, _, err = run_cli(*args, "--overwrite")
    assert code == 0, err
    assert (tmp_path / "o" / "calibration" / "manifest.json").read_bytes() == first


def test_the_smallest_size_a_refusal_names_is_a_budget_that_fits(llama, tmp_path):
    """"--target-bpw 19.924: below the smallest ... (N bytes, 19.924 bits per weight)": the figure was rounded
    down; and N bytes written in GB (0.03207424GB) parsed one byte short (float arithmetic) and was refused."""
    import re

    ckpt, data = llama
    base = ["quantize", ckpt, "--data", data, "-f", "compressed-tensors", "--candidates", "w4a16-block32-gptq,w8a16",
            "-q"]
    code, _, err = run_cli(*base, "--target-bpw", "4", "-o", tmp_path / "no")
    assert code == 2, err
    nbytes, bpw = re.search(r"\((\d+) bytes, ([\d.]+) bits per weight", err).groups()
    code, _, err = run_cli(*base, "--target-bpw", bpw, "-o", tmp_path / "bpw")
    assert code == 0, err
    code, _, err = run_cli(*base, "--target-size", f"{int(nbytes) / 1e9}GB", "-o", tmp_path / "size")
    assert code == 0, err


@pytest.mark.parametrize("params,floor", [(1000, 1001), (8_000_000, 8_008_000), (3_000_000, 423_000)])
def test_a_bits_per_weight_budget_is_counted_in_decimal(params, floor):
    """The refusal's floor rounded up (8.008 bits) was turned back into bytes in float arithmetic, one byte short
    of the floor it printed: the same refusal again."""
    import math
    from types import SimpleNamespace

    from qtool.pipeline.common import TargetOptions
    from qtool.pipeline.search import Measured

    state = SimpleNamespace(cost=SimpleNamespace(params=params))
    printed = float(f"{math.ceil(Measured.bpw(state, floor) * 1000) / 1000:.3f}")
    assert Measured.budget(state, TargetOptions(["a", "b"], bits_per_weight=printed)) >= floor


def test_a_library_target_is_checked_as_the_cli_checks_it(tmp_path):
    """TargetOptions(metric="mse") ranked by NLL and fell back by KL; candidates as one string were read a letter at
    a time ('w: recipe file not found'); Path candidates ran the whole search, then a TypeError."""
    from qtool.errors import UsageError
    from qtool.pipeline import CalibrateOptions, TargetOptions, run_calibrate

    ckpt = tiny_llama(tmp_path / "m")
    for target, said in ((TargetOptions(["w8a16", "w4a16-block32"], bits_per_weight=6.0, metric="mse"),
                          "--search-metric must be one of kl, nll (got 'mse')"),  # (the CLI's line)
                         (TargetOptions("w8a16,w4a16-block32", bits_per_weight=6.0),
                          "candidates takes a list of recipes"),
                         (TargetOptions(["w8a16", "w4a16-block32"], bits_per_weight=float("nan")),
                          "--target-bpw nan: bits per weight lie between 0 and 64"),  # (a ValueError from Decimal)
                         (TargetOptions(["w8a16", "w4a16-block32"], bits_per_weight=float("inf")),
                          "--target-bpw inf: bits per weight lie between 0 and 64")):
        with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
            run_calibrate(str(ckpt), None, str(tmp_path / "r"), CalibrateOptions(), target=target)
        assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("metric", ["kl", "nll"])
def test_search_samples_that_keep_no_token_are_one_line(llama, tmp_path, metric):
    """Samples every attention_mask drops whole: each candidate measured damage 0 and the cheapest won every group
    with exit 0 (kl); nll's refusal guessed "samples of one token?" and advised kl, which then did that."""
    from safetensors.torch import save_file

    ckpt, ids_file = llama
    ids = torch.randint(1, 256, (8, 32), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids, "attention_mask": torch.zeros_like(ids)}, tmp_path / "pad.safetensors")
    code, _, err = run_cli("calibrate", ckpt, "--candidates", "w4a16-block32,w8a16", "--target-bpw", "12.5",
                           "--data", ids_file, "--search-data", tmp_path / "pad.safetensors", "--search-metric",
                           metric, "-o", tmp_path / "out")
    assert code == 2 and not (tmp_path / "out").exists()
    assert [line for line in error_lines(err) if line.startswith("error")] == [
        f"error: {tmp_path / 'pad.safetensors'}: the search's 8 sample(s) hold no token their attention_mask keeps "
        "(every mask is 0): nothing to measure damage on; give --search-data whose samples hold text, or more "
        "--search-samples"], err

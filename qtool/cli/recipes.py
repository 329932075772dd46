"""``qtool config list|show|validate``: the shipped recipes in a table, what a recipe resolves to (on a model,
with its plan and memory estimate), and a recipe linted without running it."""

from __future__ import annotations

from typing import List, Optional

import typer

from .core import Table, _console, _emit_json, _errors, _esc, _one_process, config_app, err
from .options import (_DEBUG, _JSON, _MODEL_CLASS, _TRUST_CODE, _TRUST_PICKLE, _UNMATCHED, _checkpoint,
                      _complete_recipe, _opts)
from .output import _plan_table


@config_app.command("list", epilog="Examples:\n\n\b\n  qtool config list\n  qtool config list --json")
def config_list(json_out: bool = _JSON) -> None:
    """List the recipes that ship with qtool (use one by name: -c w8a8)."""
    from ..config import load_recipe, recipe_description, recipe_needs_data, shipped_recipes, spec_label, weights_label

    rows = []
    with _errors(False, json_out):
        _one_process("config list")
        for name, path in shipped_recipes().items():
            recipe = load_recipe(path)
            description = recipe_description(path.read_text(encoding="utf-8"))
            rows.append({"name": name, "title": description.split(": ", 1)[0].split(". ", 1)[0].rstrip("."),
                         "weights": weights_label(recipe),
                         "activations": spec_label(recipe.defaults.activations)
                         + (" + smoothquant" if recipe.smoothquant else ""),
                         "needs_data": recipe_needs_data(recipe), "description": description, "path": str(path)})
    if json_out:
        _emit_json({"ok": True, "recipes": rows})
        return
    con = _console()
    title = "shipped recipes: qtool quantize MODEL -c NAME ...; qtool config show NAME"
    if con.width >= 120:  # one row per recipe
        t = Table(title=title, title_justify="left")
        for col in ("name", "weights", "activations", "--data", "what"):
            t.add_column(col, no_wrap=col == "name")
        for r in rows:
            t.add_row(r["name"], r["weights"], r["activations"], "yes" if r["needs_data"] else "no", _esc(r["title"]))
    else:  # narrow terminals: what it is beneath its grids, so no column is too narrow for its words
        from rich import box

        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        t.add_column("name", no_wrap=True)
        t.add_column("weights | activations | needs --data; what it is")
        for r in rows:
            t.add_row(r["name"], _esc(f"{r['weights']} | {r['activations']} | "
                                      f"{'data' if r['needs_data'] else 'no data'}\n{r['title']}"))
    con.print(t)


def _rotation_json(rotation) -> dict:
    """A plan's rotations: which, of what type, and the modules each online one runs on."""
    return {"rotations": list(rotation.rotations), "type": rotation.kind, "seed": rotation.seed,
            **({"block_size": rotation.r1_blocks} if rotation.r1_blocks else {}),
            "online": [{**r.to_json(), "rotates": r.rotated} for r in rotation.online()]}


def _recipe_text(recipe: str, json_out: bool) -> None:
    """``config show`` without a model: what the recipe says, every default resolved."""
    import yaml

    from ..config import describe_recipe, load_recipe, recipe_description, recipe_file

    with _errors(False, json_out):
        _one_process("config show")
        path = recipe_file(recipe)
        info = describe_recipe(load_recipe(path))
        description = recipe_description(path.read_text(encoding="utf-8"))
    if json_out:
        _emit_json({"ok": True, "recipe": str(path), "description": description, **info})
        return
    con = _console()
    con.print(_esc(f"recipe: {path}"))
    if description:
        con.print(_esc(description))
    if info["gguf_mix"]:
        con.print(_esc(f"gguf_mix: {info['gguf_mix']} (each weight's GGUF type as llama-quantize chooses it; the "
                       "weights defaults below say how its codes are chosen)"))
    con.print(_esc(yaml.safe_dump({k: info[k] for k in ("defaults", "layers", "ignore", "smoothquant",
                                                        "fold_batch_norms", "kv_cache", "rotate")
                                   if info[k] not in (None, [], False)}, sort_keys=False, width=110).rstrip()))
    types = info["default_types"]
    con.print(_esc("by default (layers entries aside) it quantizes: "
                   f"weights of {', '.join(types['weights']) or 'no module'}; "
                   f"activations of {', '.join(types['activations']) or 'no module'} (subclasses included)"))
    con.print(f"needs calibration data: {'yes' if info['needs_data'] else 'no'}")
    con.print("(pass --model CHECKPOINT to see the plan: one row per quantizer)")


@config_app.command("show", epilog="Examples:\n\n\b\n  qtool config show w8a8                        (the recipe, every default resolved)\n  qtool config show my.yaml --model MODEL_DIR   (the plan: one row per quantizer)")
def config_show(
    recipe: str = typer.Argument(..., metavar="RECIPE", help="Recipe YAML, or a shipped recipe's name (qtool config list).",
                                 autocompletion=_complete_recipe),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Checkpoint to resolve the recipe against "
                                        "(without it: the recipe's rules with every default resolved)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="With a Hugging Face Hub ID as --model: a "
                                           "branch, tag or commit (default main)."),
    model_class: Optional[str] = _MODEL_CLASS,
    trust_pickle: bool = _TRUST_PICKLE,
    trust_remote_code: bool = _TRUST_CODE,
    allow_unmatched: bool = _UNMATCHED,
    json_out: bool = _JSON,
    debug: bool = _DEBUG,
) -> None:
    """Print the resolved plan: one row per quantizer (with --model), or what the recipe says (without)."""
    from dataclasses import asdict

    from ..pipeline import plan_for

    if model is None and revision is None:
        _recipe_text(recipe, json_out)
        return
    with _errors(debug, json_out):
        if model is None:
            from ..errors import UsageError

            raise UsageError("--revision names a version of the --model Hub ID: pass --model ORG/NAME")
        _one_process("config show")
        model = _checkpoint(model, revision)
        opts = _opts(model_class=model_class, trust_pickle=trust_pickle, trust_remote_code=trust_remote_code,
                     allow_unmatched=allow_unmatched)
        loaded, plan = plan_for(model, recipe, opts)
    from ..calibration import estimate_run, streams

    # as calibrate, without --data and at its default batches, would run it
    estimate = estimate_run(loaded.model, plan, "streaming" if loaded.kind == "hf" and streams(plan, opts)
                            else "in_memory", opts)
    if json_out:
        _emit_json({"ok": True, "quantizers": [asdict(q) for q in plan.quantizers],
                    "weights_quantized": plan.coverage.to_json(),
                    "memory": {"mode": estimate.mode, "peak_bytes": estimate.peak,
                               "sequential_bytes": estimate.sequential},
                    "smoothquant": [asdict(g) for g in plan.smoothing],
                    **({"batch_norm_folds": [asdict(f) for f in plan.folds]} if plan.folds else {}),
                    **({"rotation": _rotation_json(plan.rotation)} if plan.rotation else {}),
                    "warnings": plan.warnings})
        return
    console = _console()
    console.print(_plan_table(plan))
    console.print(plan.coverage.describe())
    console.print(f"calibrating it: {estimate.describe()}, at --batch-size {opts.batch_size} --seq-len "
                  f"{opts.seq_len}")
    if plan.smoothing:
        console.print(f"smoothquant (alpha {plan.smoothing[0].alpha}), before calibration: {len(plan.smoothing)} "
                      "groups, e.g. " + _esc(f"{plan.smoothing[0].smooth} -> {', '.join(plan.smoothing[0].balance)}"))
    if plan.folds:
        console.print(f"fold_batch_norms, before calibration: {len(plan.folds)} batch norms into the convolution "
                      "before each (each pair checked on the first batch), e.g. "
                      + _esc(f"{plan.folds[0].bn} -> {plan.folds[0].conv}"))
    if plan.rotation:
        rot = _rotation_json(plan.rotation)
        fused = [r for r in rot["rotations"] if r in ("r1", "r2")]
        console.print(_esc(f"rotate ({rot['type']}, seed {rot['seed']}), before calibration: "
                           + "; ".join(([f"{' '.join(fused)} fused into the weights"
                                         + (f" (r1 in blocks of {rot['block_size']})" if "block_size" in rot else "")]
                                        if fused else [])
                                       + [f"{o['name']} online ({o['rotates']}) on {len(o['modules'])} modules, "
                                          f"e.g. {o['modules'][0]}" for o in rot["online"]])))
    for w in plan.warnings:
        err.print(f"warning: {w}", markup=False)


@config_app.command("validate", epilog="Examples:\n\n\b\n  qtool config validate my.yaml other.yaml")
def config_validate(
    recipes: List[str] = typer.Argument(..., metavar="RECIPES", help="Recipe YAML files."),
    json_out: bool = _JSON,
) -> None:
    """Check recipes against the schema (no model needed)."""
    from ..config import load_recipe
    from ..errors import ConfigError

    failed = []
    with _errors(False, json_out):  # (anything but a recipe's own problems: one line, exit 3, as elsewhere)
        _one_process("config validate")
        for r in recipes:
            try:
                load_recipe(r)
                if not json_out:
                    err.print(f"ok: {r}", markup=False)
            except ConfigError as e:
                failed.append({"recipe": r, "error": str(e), "problems": e.problems})
                for problem in e.problems:
                    err.print(f"error: {problem}", markup=False)
    if json_out:
        _emit_json({"ok": not failed, **({"exit_code": 2} if failed else {}), "errors": failed})
    if failed:
        raise typer.Exit(2)

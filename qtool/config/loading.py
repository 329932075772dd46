"""Loading a recipe: YAML read safely (no aliases, no repeated keys) and validated, with file, key and line in
every error, and every problem of a file listed at once."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml
from pydantic import ValidationError

from ..errors import ConfigError
from .messages import _describe, _key_path, _short, fields_at
from .schema import NEEDS_SELECTOR, Recipe, rule_specs
from .shipped import recipe_file


def _line_of(node, loc: Sequence[Any]) -> Optional[int]:
    """Line (1-based) of the YAML node at ``loc``, or of the deepest node that exists on the way."""
    best = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        nxt = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == part:
                    nxt = k if part == loc[-1] else v
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            nxt = node.value[part]
        if nxt is None:
            break
        node = nxt
        best = node.start_mark.line + 1
    return best


def _check_node_graph(node, source: str) -> None:
    """Refuse what PyYAML would silently expand or drop, before anything is constructed: a reused node (an alias;
    the graph is walked once per node object) and a key given twice in one mapping (the last would win)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n is None:
            continue
        if id(n) in seen:
            raise ConfigError(f"{source}: YAML anchors and aliases (&name / *name) are not allowed in recipes (a "
                              "few lines of them can expand to billions of values); write the values out")
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            keys = set()
            for key, _ in n.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        raise ConfigError(f"{source}:{key.start_mark.line + 1}: key {_short(key.value)} is given "
                                          "twice in the same mapping; keep one")
                    keys.add(key.value)
            stack.extend(x for pair in n.value for x in pair)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading floats as YAML 1.2 does: ``1e-3`` is a number (YAML 1.1 wants ``1.0e-3``, so
    PyYAML read it as a string, which the recipe's number fields refuse)."""


RecipeLoader.add_implicit_resolver(  # (on a copy of SafeLoader's resolvers: PyYAML copies them for a subclass)
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _decimal_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer only as written in decimal: YAML 1.1 (PyYAML) reads ``010`` as 8, ``0x10`` as 16, ``1_0`` as 10
    and ``1:20`` as 80, which a recipe's ``bitwidth: 010`` would become without a word."""
    value = loader.construct_scalar(node)
    if not re.fullmatch(r"[-+]?(?:0|[1-9][0-9]*)", value):
        try:
            read = f"YAML 1.1 would read it as {yaml.SafeLoader.construct_yaml_int(loader, node)}"
        except (ValueError, IndexError):  # (!!int abc, !!int '')
            read = "not an integer at all"
        raise yaml.constructor.ConstructorError(
            None, None, f"{value[:40]!r} is not a decimal integer ({read}): write the number in decimal",
            node.start_mark)
    return int(value)


RecipeLoader.add_constructor("tag:yaml.org,2002:int", _decimal_int)


def _scalars(node):
    """Every scalar node under ``node`` (a composed YAML document), in document order."""
    if isinstance(node, yaml.ScalarNode):
        yield node
    elif isinstance(node, yaml.SequenceNode):
        for child in node.value:
            yield from _scalars(child)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from _scalars(key)
            yield from _scalars(value)


def load_yaml(text: str):
    """A recipe's YAML (or any recipe-shaped YAML qtool reads) as data, with :class:`RecipeLoader`."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506  (a SafeLoader subclass)


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    """Parse and validate a recipe; every problem is a ``ConfigError`` naming source, key path and line."""
    try:
        node = yaml.compose(text, Loader=RecipeLoader)
        _check_node_graph(node, source)
        data = load_yaml(text)
    except RecursionError:
        raise ConfigError(f"{source}: malformed YAML: nested too deep") from None
    except ValueError:  # (PyYAML's int() of a number past Python's 4300-digit limit)
        line = next((n.start_mark.line + 1 for n in _scalars(node) if len(n.value) > 4000), None)
        raise ConfigError(f"{source}{f':{line}' if line else ''}: malformed YAML: a number of more than 4000 digits "
                          "(no recipe value is that large)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "'\\t'" in problem:  # (PyYAML's "found character '\t' that cannot start any token")
            raise ConfigError(f"{source}{where}: malformed YAML: a tab where YAML takes none (it indents "
                              "with spaces): use spaces") from None
        raise ConfigError(f"{source}{where}: malformed YAML: {_short(problem, 200)[1:-1]}") from None
    if data is None:  # an empty file (or only comments) is a mistake far more often than a wish for defaults
        raise ConfigError(f"{source}:1: empty recipe; write at least `version: 1` and what to quantize "
                          "(`qtool config list` shows the shipped recipes)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: a recipe is a mapping of keys (version, defaults, layers, ignore)")
    problems: List[str] = []
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = list(err["loc"])
            line = _line_of(node, loc)
            where = f":{line}" if line else ""
            described = _describe(err, fields_at(Recipe, loc))
            problems.append(f"{source}{where}: {_key_path(loc) or '(top level)'}: {described}")
        recipe = None
        # the layers entries' merged settings are checked on a recipe that validates: the one left once the keys
        # above are taken out (so a wrong key elsewhere does not hide them until the next round)
        unselected: List[int] = []
        rest = _without(data, [list(err["loc"]) for err in e.errors()], unselected)
        for i in unselected:  # (an entry that had neither before its unknown key was taken out)
            line = _line_of(node, ["layers", i])
            problems.append(f"{source}{f':{line}' if line else ''}: layers[{i}]: {NEEDS_SELECTOR}")
        # (a defaults spec refused whole is taken out whole: the entries merged over the built-in one instead would
        # be refused for what the user's defaults set, per_block under a per_channel default)
        dropped = set()
        for loc in (list(err["loc"]) for err in e.errors()):
            if loc[:1] == ["defaults"] and len(loc) <= 2:
                dropped |= {loc[1]} if len(loc) == 2 else {"weights", "activations"}
        if rest is not None:
            problems += [p for p in _rule_problems(rest, node, source, skip=dropped) if p not in problems]
    if recipe is not None:
        problems += _rule_problems(recipe, node, source)
    if problems:
        shown = problems[:MAX_PROBLEMS]
        if len(problems) > MAX_PROBLEMS:
            shown.append(f"{source}: ... and {len(problems) - MAX_PROBLEMS} more problems")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(shown[0] + more, shown)
    return recipe


MAX_PROBLEMS = 20  # recipe problems listed at once (the rest are counted)


def _without(data: Dict[str, Any], locations: List[List[Any]], unselected: List[int]) -> Optional[Recipe]:
    """The recipe ``data`` validates to once each key a validation error names is taken out (a ``layers`` entry
    that cannot lose it left with neither field, so later entries keep their places), or None where that does not
    validate either. A layers entry left with neither ``match`` nor ``type`` matches nothing (its other fields
    still checked); its index goes to ``unselected`` unless the key taken out stood for one (``name:``)."""
    import copy

    rest = copy.deepcopy(data)
    for loc in locations:
        if len(loc) > 3 and loc[0] == "layers" and loc[2] in ("type", "match"):  # (a union's branch: type.list[str])
            loc = loc[:3]
        parent = rest
        for step in loc[:-1]:
            try:
                parent = parent[step]
            except (KeyError, IndexError, TypeError):
                return None
        key = loc[-1] if loc else None
        if len(loc) == 3 and loc[0] == "layers" and isinstance(parent, dict) and key not in parent and \
                key in ("type", "match"):
            continue  # (its other branch's error, the key taken out already)
        if isinstance(parent, dict) and key in parent:
            del parent[key]
            if len(loc) == 3 and loc[0] == "layers" and "match" not in parent and "type" not in parent:
                parent["match"] = "re:(?!)"
                if not _stands_for_a_selector(key) and loc[1] not in unselected:
                    unselected.append(loc[1])
        elif len(loc) >= 2 and loc[0] == "layers" and isinstance(loc[1], int) and isinstance(rest.get("layers"), list) \
                and loc[1] < len(rest["layers"]):
            rest["layers"][loc[1]] = {"match": "re:(?!)"}  # (matches nothing)
        else:
            return None
    try:
        return Recipe.model_validate(rest)
    except ValidationError:
        return None


def _stands_for_a_selector(key) -> bool:
    """Whether a key a layers entry may not have was meant as its ``match`` or ``type`` (``name:``, ``matches:``)."""
    import difflib

    from .messages import _SYNONYMS

    return isinstance(key, str) and (_SYNONYMS.get(key) in ("match", "type")
                                     or bool(difflib.get_close_matches(key, ["match", "type"], n=1, cutoff=0.6)))


def _rule_problems(recipe: Recipe, node, source: str, skip=()) -> List[str]:
    """Each ``layers`` entry's partial weights/activations merged as resolution will merge them (over the defaults,
    and over every earlier entry's): a value that no merge accepts is a problem now, not on the first model. ``skip``:
    the kinds (weights, activations) whose defaults were refused: their entries' own values are still checked, not
    what depends on the defaults (a whole-spec problem, ": ..."), which no entry can be checked against."""
    problems = []
    for i, kind, _, error in rule_specs(recipe):
        for said in error.problems if error is not None else ():
            if kind in skip and said.startswith(":"):
                continue
            part = getattr(recipe.layers[i], kind)
            whole = said.lstrip(" ").startswith(":")  # ": <problem>" of the whole spec, ".<key>: <problem>" of a key
            key = said.lstrip(".: ")  # (from _merge with an empty location)
            field = "" if whole else key.split(":", 1)[0].strip()
            line = _line_of(node, ["layers", i, kind] + ([field] if field in part else []))
            problems.append(f"{source}{f':{line}' if line else ''}: layers[{i}].{kind}{': ' if whole else '.'}{key}")
    return problems


@dataclass(frozen=True)
class RecipeFile:
    """A recipe read once: the file it came from (a shipped recipe's name resolved to its file), the sha256 of the
    bytes read, their text and the validated recipe. A run reads its recipe into one of these at its edge and
    hands it on, so the file is opened once and what is hashed in the manifest is what was parsed."""

    path: str
    sha256: str
    text: str
    recipe: Recipe


def read_recipe(arg: Union[str, Path, RecipeFile]) -> RecipeFile:
    """Read and validate a recipe file, or a shipped recipe by name (see :func:`recipe_file`); a ``RecipeFile``
    is returned as it is."""
    if isinstance(arg, RecipeFile):
        return arg
    path = recipe_file(arg)
    try:
        data = path.read_bytes()
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as read_text's newlines
    except FileNotFoundError:
        raise ConfigError(f"{path}: recipe file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read recipe: {e}") from None
    return RecipeFile(str(path), hashlib.sha256(data).hexdigest(), text, parse_recipe(text, str(path)))


def load_recipe(path: Union[str, Path, RecipeFile]) -> Recipe:
    """Load and validate a recipe file, or a shipped recipe by name (see :func:`recipe_file`)."""
    return read_recipe(path).recipe

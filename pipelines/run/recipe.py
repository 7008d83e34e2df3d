"""Loading recipes: YAML with `extends:`, command-line overrides, strict validation with readable errors."""

from __future__ import annotations

import copy
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from polydraft.models.folders import mirrored
from polydraft.pipelines.schema import FieldError, Recipe


class RecipeError(ValueError):
    """A recipe that cannot be loaded; the message names the file and the full key path."""


class _Loader(yaml.SafeLoader):
    """PyYAML reads `1e-3` as a string (YAML 1.1 wants a dot); recipes write learning rates that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, origin: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise RecipeError(f"{origin}: not valid YAML: {err}") from err


def _record(value: Any, path: tuple, origin: str, provenance: dict[tuple, str]) -> None:
    """Remember which file (or override) set `path` and every key below it."""
    for known in [p for p in provenance if p[: len(path)] == path]:
        del provenance[known]
    provenance[path] = origin
    if isinstance(value, dict):
        for key, item in value.items():
            _record(item, (*path, key), origin, provenance)


def _merge(base: dict, child: dict, origin: str, provenance: dict[tuple, str], prefix: tuple = ()) -> dict:
    """Deep-merge `child` into a copy of `base`: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in child.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, origin, provenance, path)
        else:
            out[key] = copy.deepcopy(value)
            _record(value, path, origin, provenance)
    return out


def _read_with_extends(path: Path, provenance: dict[tuple, str], chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise RecipeError(f"{path}: `extends` forms a cycle: {cycle}")
    if not path.is_file():
        where = f"{chain[-1]}: extends " if chain else ""
        raise RecipeError(f"{where}{path}: no such recipe file")
    data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of blocks, got {type(data).__name__}")
    base: dict = {}
    extends = data.pop("extends", None)
    if extends is not None:
        if not isinstance(extends, str):
            raise RecipeError(f"{path}: extends: expected a relative path (string), got {extends!r}")
        base = _read_with_extends(path.parent / extends, provenance, (*chain, path))
    return _merge(base, data, str(path), provenance)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`finetune.optim.lr=3e-5` -> (["finetune", "optim", "lr"], 3e-05). The value is read as YAML."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {text!r}: empty key in {key!r}")
    return parts, parse_yaml(raw, f"override {text!r}") if raw.strip() else ""


def apply_overrides(data: dict, overrides: list[str], provenance: dict[tuple, str]) -> dict:
    for text in overrides:
        parts, value = parse_override(text)
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        data = _merge(data, nested, f"override `{text}`", provenance)
    return data


_EXPECTED = {
    "float_type": "float",
    "int_type": "int",
    "bool_type": "bool",
    "string_type": "string",
    "list_type": "list",
    "dict_type": "mapping",
    "model_type": "mapping",
    "int_from_float": "int",
}
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _describe(error: dict) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {error['input']!r}"
    if kind == "literal_error":
        return f"expected {error['ctx']['expected']}, got {error['input']!r}"
    if kind == "too_short":
        return f"must have at least {error['ctx']['min_length']} item(s), got {error['input']!r}"
    if kind in _BOUNDS:
        return f"{error['msg'].replace('Input should', 'must')}, got {error['input']!r}"
    return error["msg"].removeprefix("Value error, ")


def _origin(loc: tuple, provenance: dict[tuple, str], default: str) -> str:
    return _set_at(loc, provenance, default)[1]


def _set_at(loc: tuple, provenance: dict[tuple, str], default: str) -> tuple[int, str]:
    """(when, where) the value at `loc` was set: its rank in the order values were set (later files and
    overrides rank higher; -1 for a default) and the file or override that set it."""
    order = {path: rank for rank, path in enumerate(provenance)}
    for end in range(len(loc), 0, -1):
        if loc[:end] in provenance:
            return order[loc[:end]], provenance[loc[:end]]
    return -1, default


def _line(error: dict, provenance: dict[tuple, str], default_origin: str) -> str:
    """`<file or override>: <key path>: <what is wrong and what is allowed>` for one validation error."""
    # pydantic adds the union member or validator name to some locations; keep only real keys
    loc = tuple(
        p for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))
    )
    cause = (error.get("ctx") or {}).get("error")
    if not isinstance(cause, FieldError) or not cause.keys:
        path = "".join(f"{p}: " for p in [".".join(str(p) for p in loc)] if p)
        return f"{_origin(loc, provenance, default_origin)}: {path}{_describe(error)}"
    # a check across fields: blame the key set last (the child recipe or override that broke a rule the
    # base kept), the first key listed when none was set, and say where the others were set
    keys = [(*loc, *key.split(".")) for key in cause.keys]
    blamed = max(keys, key=lambda key: _set_at(key, provenance, default_origin)[0])
    origin = _origin(blamed, provenance, default_origin)
    others = [
        f"{'.'.join(key)} set in {_origin(key, provenance, default_origin)}"
        for key in keys
        if key != blamed and _origin(key, provenance, default_origin) != origin
    ]
    also = f" ({'; '.join(others)})" if others else ""
    path = ".".join(blamed)
    return f"{origin}: {cause}{also}" if str(cause).startswith(path) else f"{origin}: {path}: {cause}{also}"


def validate(data: dict, provenance: dict[tuple, str], default_origin: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        lines = [_line(error, provenance, default_origin) for error in err.errors()]
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(dict.fromkeys(lines))) from None


def _anchored(value: Any, origin: str | None) -> Any:
    """A relative path written in a recipe file, made relative to that file's folder (an override's
    stays relative to the working directory)."""
    if not isinstance(value, str) or origin is None or origin.startswith("override"):
        return value
    if Path(value).is_absolute() or value.startswith("~"):
        return value
    return str(Path(origin).parent / value)


def _anchored_model(value: Any, origin: str | None) -> Any:
    """A model reference (target.path, a drafter's init, a measured drafter) is a local folder or a hub id.
    It is read as a folder relative to the recipe file that wrote it when it starts with `./` or `../`,
    or when that folder exists; anything else is a hub id (`org/name`), read from its copy in the
    $POLYDRAFT_HUB_MIRROR folder when there is one (`models.folders.mirrored`)."""
    anchored = _anchored(value, origin)
    if anchored != value and (value.startswith(("./", "../")) or Path(anchored).is_dir()):
        return anchored
    return mirrored(value, "models") or value  # a hub id: its copy in $POLYDRAFT_HUB_MIRROR, if any


def anchor_paths(data: dict, provenance: dict[tuple, str]) -> None:
    """Resolve the recipe's local paths (bootstrap cache, `local` data sources, local model folders)
    against the file that wrote them, so that a recipe runs the same from any working directory."""
    boot = (data.get("target") or {}).get("bootstrap") if isinstance(data.get("target"), dict) else None
    if isinstance(boot, dict) and "cache_dir" in boot:
        where = _origin(("target", "bootstrap", "cache_dir"), provenance, "")
        boot["cache_dir"] = _anchored(boot["cache_dir"], where or None)
    blocks = data.get("data") if isinstance(data.get("data"), dict) else {}
    for block in ("distill", "open", "pretrain", "eval"):
        sources = blocks.get(block)
        for source in sources if isinstance(sources, list) else []:
            if isinstance(source, dict) and source.get("kind") == "local" and "path" in source:
                source["path"] = _anchored(source["path"], _origin(("data", block), provenance, "") or None)
    models = [("target", "path")]
    models += [(stage, "drafter", "init") for stage in ("pretrain", "finetune")]
    drafters = (
        (data.get("measure") or {}).get("extra_drafters") if isinstance(data.get("measure"), dict) else None
    )
    models += [
        ("measure", "extra_drafters", name) for name in (drafters if isinstance(drafters, dict) else {})
    ]
    for key in models:
        parent = data
        for part in key[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and isinstance(parent.get(key[-1]), str):
            parent[key[-1]] = _anchored_model(parent[key[-1]], _origin(key, provenance, "") or None)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a recipe file (following `extends:`), apply `key.path=value` overrides and validate it.
    Relative local paths are resolved against the recipe file that wrote them (`anchor_paths`)."""
    provenance: dict[tuple, str] = {}
    data = _read_with_extends(Path(path), provenance)
    data = apply_overrides(data, overrides or [], provenance)
    anchor_paths(data, provenance)
    return validate(data, provenance, str(Path(path).resolve()))


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (defaults included) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ----------------------------------------------------------------------------- shipped recipes


@dataclass(frozen=True)
class ShippedRecipe:
    name: str
    """The path under `recipes/` without `.yaml` (`vicuna-7b/de`): also its default run directory."""
    path: Path
    launch: str
    """The launch command its first comment line gives."""
    description: str
    """The first sentence of the comment after it."""


def header(path: Path) -> tuple[str, str]:
    """(launch command, description) from a recipe's leading comment: its first line is the command (a
    test holds every shipped recipe to it), the first sentence after it says what the recipe is."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    launch = lines[0] if lines else ""
    text = " ".join(line for line in lines[1:] if line)
    return launch, re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]


def shipped_recipes(root: Path) -> list[ShippedRecipe]:
    """Every recipe under `root` (the repository's `recipes/`; accelerate and DeepSpeed configs excluded)."""
    found = []
    for path in sorted(root.rglob("*.yaml")):
        if path.relative_to(root).parts[0] == "accelerate":
            continue
        launch, description = header(path)
        found.append(
            ShippedRecipe(path.relative_to(root).with_suffix("").as_posix(), path, launch, description)
        )
    return found


def copy_recipe(source: Path, destination: Path) -> None:
    """Write `source` as one standalone recipe at `destination`: its `extends` chain merged, relative local
    paths made absolute (they were relative to the files that wrote them), checked to load the same."""
    if destination.exists():
        raise RecipeError(f"{destination}: already exists; give a new file name")
    provenance: dict[tuple, str] = {}
    data = _read_with_extends(source, provenance)
    anchor_paths(data, provenance)
    expected = validate(copy.deepcopy(data), dict(provenance), str(source))
    _, description = header(source)
    lines = [
        f"# polydraft run {destination}",
        *(f"# {line}" for line in textwrap.wrap(description, 100)),
        f"# A standalone copy of {source} made by `polydraft recipes --copy`: its `extends` chain merged,",
        "# local paths made absolute, nothing else changed (the schema's defaults apply as in the original).",
    ]
    text = "\n".join(lines) + "\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_text(text, encoding="utf-8")
    if load_recipe(destination) != expected:
        destination.unlink()
        raise RecipeError(f"{source}: its standalone copy does not load as the same recipe (a bug)")

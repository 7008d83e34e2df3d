"""Loading recipes: YAML with `extends:`, command-line overrides, strict validation with readable errors."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipelines.schema import Recipe


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
    return error["msg"].removeprefix("Value error, ")


def _origin(loc: tuple, provenance: dict[tuple, str], default: str) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in provenance:
            return provenance[loc[:end]]
    return default


def validate(data: dict, provenance: dict[tuple, str], default_origin: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        lines = []
        for error in err.errors():
            # pydantic adds the union member or validator name to some locations; keep only real keys
            loc = tuple(
                p
                for p in error["loc"]
                if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))
            )
            path = "".join(f"{p}: " for p in [".".join(str(p) for p in loc)] if p)
            lines.append(f"{_origin(loc, provenance, default_origin)}: {path}{_describe(error)}")
        raise RecipeError("invalid recipe:\n  " + "\n  ".join(dict.fromkeys(lines))) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a recipe file (following `extends:`), apply `key.path=value` overrides and validate it."""
    provenance: dict[tuple, str] = {}
    data = _read_with_extends(Path(path), provenance)
    data = apply_overrides(data, overrides or [], provenance)
    return validate(data, provenance, str(Path(path).resolve()))


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (defaults included) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)

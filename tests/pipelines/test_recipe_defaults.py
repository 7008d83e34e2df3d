"""Defaults survive a partial block: for every block and nested sub-block of the recipe, setting one field
leaves every other value of the resolved recipe where it is when the field is not set (except the
cross-block defaults the schema documents), and the resolved recipe reloads to itself."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ValidationError

from polydraft.pipelines.schema import Recipe

BASE: dict[str, Any] = {"target": {"path": "org/target"}, "data": {"pairs": ["de-en"]}}
F_ONLY = {"pretrain": {"enabled": False}}
"""finetune.drafter is only accepted without pretraining."""

CROSS_BLOCK = {
    ("pretrain", "enabled"): {("finetune", "loop", "epochs")},  # 3 epochs after P, 5 without
    ("pretrain", "drafter", "arch"): {("finetune", "optim", "lr")},  # lr by the drafter's arch
    ("finetune", "drafter", "arch"): {("finetune", "optim", "lr")},
    ("distill", "temperatures"): {
        ("finetune", "temperatures"),
        ("early_exit", "temperatures"),
        ("heads", "temperatures"),
        ("eagle3", "temperatures"),
    },
}
"""Documented cross-field defaults: setting the key changes these values too."""

EXPLICIT: dict[tuple[str, ...], list[Any]] = {
    ("target", "path"): ["other/target"],
    ("distill", "shard_index"): [],  # must stay below num_shards: checked with num_shards below
    ("distill", "openai", "endpoint"): [],  # `chat` needs prompt_format chat_template (a cross-field rule)
    ("distill", "prompt_format"): ["chat_template"],
    ("launch", "accelerate_config"): ["recipes/accelerate/ddp.yaml"],
    ("launch", "collective_timeout_s"): [3600],  # at least a minute
    ("measure", "medusa_tree"): [[[0], [0, 0]]],
    ("measure", "rsd_c_trees"): [[[2, 2]]],
    ("measure", "rsd_s_trees"): [[[2, 3]]],
}


def _bare(annotation: Any) -> Any:
    """The type under `Annotated[...]` constraints (ranges, no-duplicate lists)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _inner(annotation: Any) -> list[Any]:
    """The members of a union (X | None), or the annotation itself, without their constraints."""
    annotation = _bare(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [_bare(a) for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def candidates(annotation: Any, default: Any) -> list[Any]:
    """Values of this type to try, other than the default; the first valid one is used."""
    out: list[Any] = []
    for kind in _inner(annotation):
        origin, args = typing.get_origin(kind), typing.get_args(kind)
        if origin is Literal:
            out += [a for a in args if a != default]
        elif kind is bool:
            out.append(not default)
        elif kind is int:
            base = default if isinstance(default, int) else 1
            out += [base + 1, base + 2, 2, 1, 8]
        elif kind is float:
            base = default if isinstance(default, float) else 0.5
            out += [base / 2, base * 2, 0.5, 0.25, 0.9, 2.0]
        elif kind is str:
            out += ["x", "recipes/accelerate/ddp.yaml"]
        elif origin is list:
            item = _bare(args[0])
            if item is float:
                out += [[0.0, 0.5], [0.8, 0.9], [0.0], [1.0, 2.0]]
            elif item is int:
                out += [[1, 3], [5], [2, 2, 2]]
            elif typing.get_origin(item) is Literal:
                out += [[typing.get_args(item)[0]], list(typing.get_args(item))]
            elif item is str:
                out += [["x"]]
        elif origin is dict:
            out += [{"catalog": 2.0}, {"a": "b"}, {"x": "org/drafter"}]
    return [c for c in out if c != default]


def blocks(
    model: type[BaseModel], path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], type[BaseModel]]]:
    """Every block (a StrictModel field, directly or as `X | None`) below `model`, with its path."""
    found = []
    for name, field in model.model_fields.items():
        for kind in _inner(field.annotation):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found.append(((*path, name), kind))
                found += blocks(kind, (*path, name))
    return found


def nested(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def flatten(data: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(data, dict) and data:
        out: dict[tuple[str, ...], Any] = {}
        for key, value in data.items():
            out |= flatten(value, (*path, key))
        return out
    return {path: data}


LEAVES = [
    ((*block, name), field.annotation, field.get_default(call_default_factory=True))
    for block, model in blocks(Recipe)
    if block[0] != "data" or block == ("data", "offline")  # data's source lists are not partial blocks
    for name, field in model.model_fields.items()
    if not any(isinstance(k, type) and issubclass(k, BaseModel) for k in _inner(field.annotation))
]


def test_every_block_and_sub_block_is_covered():
    covered = {path[:-1] for path, _, _ in LEAVES}
    for expected in [("early_exit", "loop"), ("calibrate", "optim"), ("finetune", "drafter"), ("distill", "openai"),
                     ("target", "bootstrap"), ("data", "offline"), ("measure",), ("export",), ("tracking",)]:  # fmt: skip
        assert expected in covered


@pytest.mark.parametrize("path, annotation, default", LEAVES, ids=[".".join(p) for p, _, _ in LEAVES])
def test_setting_one_field_keeps_every_other_default(path, annotation, default):
    base = merge(BASE, F_ONLY) if path[0] == "finetune" else BASE
    if path[:2] == ("target", "bootstrap"):
        base = {**base, "target": {"bootstrap": {}}}
    if path == ("distill", "shard_index"):
        base = merge(base, {"distill": {"num_shards": 4}})
    values = EXPLICIT.get(path) if path in EXPLICIT else candidates(annotation, default)
    if path == ("distill", "shard_index"):
        values = [1, 3]
    if path == ("measure", "mixed"):  # interleaves the eval sets of two pairs or more
        pairs = ["de-en", "fr-en"]
        eval_sets = [{"kind": "offline", "split": "test", "pair": p} for p in pairs]
        base = merge(base, {"data": {"pairs": pairs, "eval": eval_sets}})
    if path == ("distill", "openai", "endpoint"):
        base = merge(base, {"distill": {"prompt_format": "chat_template"}})
        values = ["chat"]
    reference = Recipe.model_validate(base).model_dump(mode="json")
    changed = None
    for value in values:
        try:
            changed = Recipe.model_validate(merge(base, nested(path, value))).model_dump(mode="json")
            break
        except ValidationError:
            continue
    assert changed is not None, f"no valid non-default value for {'.'.join(path)} among {values}"
    assert get(changed, path) != get(reference, path)
    allowed = {path} | CROSS_BLOCK.get(path, set())
    before, after = flatten(reference), flatten(changed)
    moved = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    moved = {key for key in moved if not any(key[: len(a)] == a for a in allowed)}
    assert not moved, f"setting {'.'.join(path)} also changed {sorted('.'.join(k) for k in moved)}"
    # what `polydraft show` prints is what runs: the resolved recipe reloads to itself
    assert Recipe.model_validate(changed).model_dump(mode="json") == changed


def test_the_stage_defaults_of_the_issue():
    """The two cases that used to drop defaults silently."""
    early_exit = Recipe.model_validate(merge(BASE, {"early_exit": {"loop": {"max_length": 4096}}})).early_exit
    loop, optim = early_exit.loop, early_exit.optim
    assert (loop.epochs, loop.per_device_batch_size, loop.grad_accum_steps, optim.lr) == (4.0, 8, 8, 1e-3)
    calibrate = Recipe.model_validate(merge(BASE, {"calibrate": {"optim": {"lr": 2.0e-3}}})).calibrate
    assert calibrate.optim.warmup_ratio == 0.0 and calibrate.loop.checkpoint_every == 200

"""Checks before any stage starts: the run directory, every local model folder the recipe names, and
(`check_recipe`, `polydraft check` and the start of `polydraft run`) every data source and model
reference opened as the stages will open them. A failure is an InputError (exit 2) naming the recipe key
or option to change; `check_recipe` collects every problem before reporting them together."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from polydraft.data.sources import abridged, describe, peek_source
from polydraft.distill.engines import visible_gpus
from polydraft.models.folders import ModelFolderError, check_model_folder, is_local, mirrored
from polydraft.pipelines.schema import Recipe, ResolvedTarget
from polydraft.pipelines.schema.common import SourceConfig, reader_args


class InputError(ValueError):
    """A bad input found before work starts: the message names the key or option and what to do."""


def check_run_dir(run_dir: Path) -> None:
    """The run directory is a writable directory, or can be created as one (nothing is created here)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"--run-dir {run_dir}: a file, not a directory; give a directory")
    existing = run_dir.absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(existing))
        probe = existing / f".polydraft-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise InputError(
            f"--run-dir {run_dir}: cannot write there ({err.strerror}: {existing}); give a writable directory"
        ) from err


def model_folders(recipe: Recipe, target: ResolvedTarget) -> list[tuple[str, str]]:
    """(recipe key, path) of every local model folder the enabled stages load."""
    folders = [("target.path", target.path)]
    if recipe.pretrain.enabled and recipe.pretrain.drafter.init:
        folders.append(("pretrain.drafter.init", recipe.pretrain.drafter.init))
    if recipe.finetune.enabled and not recipe.pretrain.enabled and recipe.finetune.drafter.init:
        folders.append(("finetune.drafter.init", recipe.finetune.drafter.init))
    if recipe.measure.enabled:
        folders += [(f"measure.extra_drafters.{n}", p) for n, p in recipe.measure.extra_drafters.items()]
    return [(key, path) for key, path in folders if is_local(path)]


def check_model_folders(recipe: Recipe, target: ResolvedTarget) -> None:
    for key, path in model_folders(recipe, target):
        try:
            check_model_folder(path)
        except ModelFolderError as err:
            raise InputError(f"{key}: {err}") from err


# ----------------------------------------------------------------------------- polydraft check

OFFLINE = "not checked (offline)"


@dataclass(frozen=True)
class Finding:
    key: str
    """The recipe key (`data.eval.2`, `target.path`)."""
    what: str
    """The dataset and split, or the model reference."""
    status: str
    """`ok`, `problem` or `not checked (offline)`."""
    detail: str = ""


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers (HF_ENDPOINT's host, port 443, 3 s), unless HF_HUB_OFFLINE."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return False
    return True


class _Hub:
    """Asks the hub once whether it is reachable, and only when a reference needs it."""

    def __init__(self) -> None:
        self._reachable: bool | None = None

    def reachable(self) -> bool:
        if self._reachable is None:
            self._reachable = hub_reachable()
        return self._reachable


def recipe_sources(recipe: Recipe) -> list[tuple[str, SourceConfig]]:
    """(recipe key, source) of every data source an enabled stage reads."""
    blocks = []
    if recipe.distill.enabled:
        blocks += ["distill", "open"]
    if recipe.pretrain.enabled:
        blocks.append("pretrain")
    if recipe.measure.enabled or recipe.export.enabled:
        blocks.append("eval")
    return [(f"data.{b}.{i}", s) for b in blocks for i, s in enumerate(getattr(recipe.data, b))]


def check_source(key: str, source: SourceConfig, recipe: Recipe, hub: _Hub) -> Finding:
    from polydraft.pipelines.schema.inputs import offline_options

    args = reader_args(source, recipe.data.seed, offline_options(recipe, [source]))
    what = describe(source.kind, source.format, source.path, source.name, source.split, source.pair)
    what += f" at revision {source.revision}" if source.revision else ""
    unmirrored = source.kind == "hf" and mirrored(source.path or "", "datasets", source.revision) is None
    if unmirrored and not hub.reachable():
        return Finding(key, what, OFFLINE)
    try:
        peek = peek_source(**args)
    except Exception as err:  # datasets' own errors name the configs and splits that exist
        return Finding(key, what, "problem", _reason(err))
    fields = ", ".join(f"{role} <- {path}" for role, path in source.fields.items()) or "default fields"
    detail = f"{len(peek.rows.rows)} rows read ({fields}); columns {peek.columns}"
    return Finding(key, what, "ok", detail)


def _reason(err: Exception, limit: int = 600) -> str:
    """An error as one line: polydraft's own errors as they are (they name what and why), others with
    their type; cut at `limit` characters."""
    from polydraft.data.sources import SourceError
    from polydraft.models.drafters import DrafterMismatch

    text = " ".join(str(err).split())
    if not isinstance(err, (SourceError, ModelFolderError, DrafterMismatch)):
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[:limit] + " ..."


def model_references(recipe: Recipe, target: ResolvedTarget) -> list[tuple[str, str, str | None]]:
    """(recipe key, path or hub id, revision) of every model an enabled stage loads, the target first."""
    refs = [("target.path", target.path, target.revision)]
    if recipe.pretrain.enabled and recipe.pretrain.drafter.init:
        refs.append(("pretrain.drafter.init", recipe.pretrain.drafter.init, recipe.pretrain.drafter.revision))
    if recipe.finetune.enabled and not recipe.pretrain.enabled and recipe.finetune.drafter.init:
        refs.append(("finetune.drafter.init", recipe.finetune.drafter.init, recipe.finetune.drafter.revision))
    if recipe.measure.enabled:
        refs += [(f"measure.extra_drafters.{n}", p, None) for n, p in recipe.measure.extra_drafters.items()]
    return refs


def check_models(recipe: Recipe, target: ResolvedTarget, hub: _Hub) -> tuple[list[Finding], Any]:
    """Each model reference's config and tokenizer loaded, the drafters' vocabularies checked against the
    target's; returns the findings and the target's tokenizer (None when it was not loaded)."""
    from transformers import AutoConfig

    from polydraft.models.drafters import check_drafter
    from polydraft.models.loading import load_tokenizer

    findings, tokenizer, vocab = [], None, None
    for key, path, revision in model_references(recipe, target):
        if not is_local(path) and not hub.reachable():
            findings.append(Finding(key, path, OFFLINE))
            continue
        trust = target.trust_remote_code if key == "target.path" else False
        try:
            if is_local(path):
                check_model_folder(path)  # a missing config or a truncated weights file, in one line
            if key == "target.path":
                config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust)
                tokenizer = load_tokenizer(path, revision, trust)
                vocab = int(config.get_text_config().vocab_size)
                detail = f"{config.model_type}, vocabulary {vocab}, tokenizer {type(tokenizer).__name__}"
            elif tokenizer is None:
                AutoConfig.from_pretrained(path, revision=revision)
                detail = "config read; vocabulary not compared (the target's was not loaded)"
            else:
                check_drafter(path, revision, vocab, tokenizer)
                detail = f"config and tokenizer read; the target's vocabulary ({vocab})"
        except Exception as err:
            findings.append(Finding(key, path, "problem", _reason(err)))
            continue
        findings.append(Finding(key, path, "ok", detail))
    return findings, tokenizer


def check_prompt(recipe: Recipe, target: ResolvedTarget, tokenizer: Any) -> Finding:
    """One prompt rendered in the recipe's prompt format and encoded as the target will see it, with the
    token ids and strings its answers will stop at."""
    from polydraft.data.prompts import answer_stop_ids, build_prompt, encode_prompt, translation_messages

    pair = recipe.data.pairs[0] if recipe.data.pairs else "de-en"
    messages = translation_messages(pair, "Guten Morgen.")
    if recipe.distill.prompt_format == "raw":
        messages = [{"role": "user", "content": "Once upon a time"}]
    what = f"distill.prompt_format {recipe.distill.prompt_format}"
    try:
        prompt = build_prompt(messages, recipe.distill.prompt_format, tokenizer)
        ids = encode_prompt(tokenizer, prompt)
        eos, extra = answer_stop_ids(recipe.distill.stop_token_ids, target, tokenizer)
    except Exception as err:
        return Finding("distill.prompt_format", what, "problem", _reason(err))
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        return Finding("distill.prompt_format", what, "problem", f"two BOS tokens: {ids[:4]}...")
    stops = [f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in eos + extra]
    detail = f"{len(ids)} tokens, {abridged(prompt, 120)}; stops at token ids [{', '.join(stops)}]"
    detail += f" and strings {recipe.distill.stop}" if recipe.distill.stop else ""
    return Finding("distill.prompt_format", what, "ok", detail)


def check_eagle3(recipe: Recipe, target: ResolvedTarget, tokenizer: Any) -> Finding:
    """The EAGLE-3 heads' feature layers on this target (the default resolved) and their draft vocabulary
    against the tokens every one must keep."""
    from transformers import AutoConfig

    from polydraft.models.draft_vocab import always_kept
    from polydraft.models.eagle3 import aux_layers_problem, default_aux_layers

    block = recipe.eagle3
    text = AutoConfig.from_pretrained(
        target.path, revision=target.revision, trust_remote_code=target.trust_remote_code
    ).get_text_config(decoder=True)
    layers = list(block.aux_layers or default_aux_layers(text.num_hidden_layers))
    what = f"feature layers {layers}, draft vocabulary {block.draft_vocab_size}"
    problem = aux_layers_problem(layers, text.num_hidden_layers)
    if problem:
        return Finding("eagle3.aux_layers", what, "problem", f"{problem}; set eagle3.aux_layers")
    kept = len(always_kept(tokenizer))
    if kept > block.draft_vocab_size < text.vocab_size:
        detail = (
            f"below the {kept} special and byte tokens every draft vocabulary keeps: raise it above {kept}"
        )
        return Finding("eagle3.draft_vocab_size", what, "problem", detail)
    size = min(block.draft_vocab_size, text.vocab_size)
    detail = (
        f"a {text.num_hidden_layers}-layer target of width {text.hidden_size}; {size} of its {text.vocab_size} "
        f"tokens per head, {kept} of them special and byte tokens"
    )
    return Finding("eagle3", what, "ok", detail)


WANDB_HOST = "api.wandb.ai"


def wandb_credentials() -> str | None:
    """Where wandb would find an API key: `WANDB_API_KEY`, or the netrc entry `wandb login` writes."""
    import netrc

    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or f"https://{WANDB_HOST}").hostname or WANDB_HOST
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        found = netrc.netrc(path).authenticators(host)
    except (FileNotFoundError, netrc.NetrcParseError):
        found = None
    return f"{path} ({host})" if found and found[2] else None


def check_tracking(recipe: Recipe) -> Finding | None:
    """`tracking.mode: online` needs an API key and the wandb server, from the start: wandb starts lazily,
    so without them the first stage would fail at its end (after hours of distillation)."""
    tracking = recipe.tracking
    if tracking.mode != "online":
        return None
    what = f"wandb online, project {tracking.project}"
    fix = "run `wandb login` (or set WANDB_API_KEY), or set tracking.mode=offline and `wandb sync` the run later"
    credentials = wandb_credentials()
    if credentials is None:
        return Finding(
            "tracking.mode", what, "problem", f"no wandb API key (WANDB_API_KEY or ~/.netrc): {fix}"
        )
    url = urlparse(os.environ.get("WANDB_BASE_URL") or f"https://{WANDB_HOST}")
    host = url.hostname or WANDB_HOST
    try:
        socket.create_connection((host, url.port or 443), timeout=3).close()
    except OSError:
        return Finding("tracking.mode", what, "problem", f"{host} cannot be reached from this machine: {fix}")
    return Finding("tracking.mode", what, "ok", f"API key from {credentials}; {host} answers")


def check_disk(recipe: Recipe, run_dir: Path) -> Finding:
    """The run directory's free space against what the plan says the run will write (`pipelines.plan.disk.disk_estimate`)."""
    import shutil

    from polydraft.pipelines.plan.disk import disk_estimate
    from polydraft.pipelines.runtime.cluster import GIB, PlanError

    existing = run_dir.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    what = f"free space for {run_dir}"
    try:
        needed = disk_estimate(recipe)
    except PlanError as err:
        return Finding(
            "disk", what, "ok", f"{free / GIB:.1f} GiB free; the run's size is not estimated ({err})"
        )
    total = sum(needed.values())
    largest = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(needed.items(), key=lambda i: -i[1])[:3])
    detail = f"{free / GIB:.1f} GiB free at {existing}; the run will write about {total / GIB:.1f} GiB ({largest} GiB)"
    if total > free:
        return Finding("disk", what, "problem", f"{detail}: free some space or choose another --run-dir")
    return Finding("disk", what, "ok", detail)


def check_launch(recipe: Recipe, gpus: int) -> Finding | None:
    """`launch.num_processes` against this node's `gpus` (None without a GPU or a count): it counts the
    training processes of one node (accelerate's own --num_processes is the total over the nodes), so a
    count above the node's GPUs is a problem, most likely a total written for accelerate."""
    count = recipe.launch.num_processes
    if gpus == 0 or count is None:
        return None
    what = f"{count} training processes per node, {gpus} GPUs on this node"
    if count > gpus:
        return Finding("launch.num_processes", what, "problem", (
            f"{what}: launch.num_processes counts the processes of one node (polydraft passes accelerate the "
            f"total over the nodes); set it to at most {gpus}, one per GPU"
        ))  # fmt: skip
    return Finding("launch.num_processes", what, "ok")


def check_recipe(recipe: Recipe, target: ResolvedTarget, run_dir: Path | None = None) -> list[Finding]:
    """Every data source of every enabled stage peeked, every model reference loaded (config and
    tokenizer) and compared, one prompt rendered, the EAGLE-3 heads' layers and vocabulary checked against
    the target: all findings, problems included (nothing raises)."""
    hub = _Hub()
    findings = [check_source(key, source, recipe, hub) for key, source in recipe_sources(recipe)]
    models, tokenizer = check_models(recipe, target, hub)
    findings += models
    if tokenizer is not None and recipe.distill.enabled:
        findings.append(check_prompt(recipe, target, tokenizer))
    if tokenizer is not None and recipe.eagle3.enabled:
        findings.append(check_eagle3(recipe, target, tokenizer))
    tracking = check_tracking(recipe)
    if tracking is not None:
        findings.append(tracking)
    launch = check_launch(recipe, len(visible_gpus()))
    if launch is not None:
        findings.append(launch)
    if run_dir is not None:
        findings.append(check_disk(recipe, run_dir))
    return findings


def findings_table(findings: list[Finding]) -> str:
    """One line per input (`status key  what`), its detail indented below."""
    lines = []
    for f in findings:
        lines.append(f"{f.status:<8} {f.key}  {f.what}")
        if f.detail:
            lines.append(f"         {f.detail}")
    return "\n".join(lines)


def raise_problems(findings: list[Finding]) -> None:
    """InputError listing every problem (with its key, what was read and why), if any."""
    problems = [f for f in findings if f.status == "problem"]
    if problems:
        listed = "\n".join(
            f"- {f.key}: {f.detail}" if f.what in f.detail else f"- {f.key} ({f.what}): {f.detail}"
            for f in problems
        )
        raise InputError(
            f"{len(problems)} problem(s) in the recipe's inputs, found before any stage ran:\n{listed}"
        )

"""Model cards (`README.md` with Hub metadata) rendered from an exported folder's `results.json`.

`render_card(info, repo_id)` is a pure function of the record the export stage writes as `results.json`
(`pipelines.export.records.ExportResults`, built by `pipelines.export.info` from the run's files): every number in a card comes from there. The
measured tables are the measure stage's own (`decoding.measurement.tables.table`: methods x dataset x temperature,
mean ± std over seeds) restricted to this drafter and the `ar` baseline of the same groups.
`polydraft publish` renders the card again with the repo id it pushes to.
"""

from __future__ import annotations

from typing import Any

from polydraft.decoding.measurement.tables import domain_table, table
from polydraft.decoding.measurement.vllm_report import vllm_section
from polydraft.pipelines.export import eagle3
from polydraft.pipelines.export.records import ExportResults

PLOT_TITLES = {
    "block_efficiency.png": "Block efficiency per dataset and temperature",
    "speedup.png": "Speedup over autoregressive decoding per dataset and temperature",
    "speedup_vs_k.png": "Speedup against the draft length K",
}


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def front_matter(info: ExportResults) -> str:
    """The YAML metadata block the Hub reads (base model, languages, datasets, license, tags)."""
    from huggingface_hub import ModelCardData

    drafter = info.kind == "drafter"
    tags = ["speculative-decoding", "polydraft"]
    if info.kind == "heads":
        tags += ["medusa", "blockwise-parallel-decoding"]
    elif info.kind == "eagle3":
        tags += ["eagle3", "speculators"]
    else:
        tags += ["draft-model"] if drafter else ["early-exit", "self-speculative-decoding", "eesd"]
    if info.pair:
        tags.append("translation")
    data = ModelCardData(
        base_model=info.target.id,
        language=info.languages,
        datasets=info.datasets or None,
        library_name="transformers" if drafter else None,
        pipeline_tag="text-generation",
        license=info.license,
        tags=tags,
    )
    return f"---\n{data.to_yaml()}\n---\n"


def title(info: ExportResults) -> str:
    label = info.target.label
    of = f" of {label}" if label else ""
    if info.kind == "early_exit":
        return f"# Early-exit head (EESD){of}"
    if info.kind == "heads":
        return f"# {'Medusa-1' if info.heads.kind == 'medusa' else 'BPD'} proposal heads{of}"
    if info.kind == "eagle3":
        return f"# {info.pair or 'Multilingual'} EAGLE-3 head{of}"
    if info.pair:
        return f"# {info.pair} drafter{of}"
    return f"# Generic drafter{of} (pretrained only)"


def target_name(info: ExportResults) -> str:
    target = info.target
    if target.id is None:
        return "a local target model (not on the Hugging Face Hub)"
    return f"`{target.id}`" + (f" (revision `{target.revision}`)" if target.revision else "")


def intro(info: ExportResults) -> str:
    what = info.kind
    if what == "heads":
        heads = info.heads
        own = (
            "each with its own lm head (Medusa-1)"
            if heads.kind == "medusa"
            else "on the target's own lm head"
        )
        text = (
            f"{heads.num_heads} blockwise proposal heads (seed 000) for {target_name(info)}: on the target's "
            f"final hidden state at position t, head i predicts token t+2+i; each is {heads.num_layers} "
            f"residual SiLU layer(s) {own}, {_num(heads.parameters)} trained parameters, the target frozen. "
            "polydraft drafts with them as `bpd` (a chain of their argmaxes), `medusa` (a candidate tree of "
            "their top tokens) and, with a small drafter LM rescoring their top-k lattice, `bpd+rescore` and "
            "`medusa+rescore`; vLLM loads the folder as a `medusa` draft."
        )
    elif what == "eagle3":
        text = eagle3.intro(info, target_name(info))
    elif what == "early_exit":
        head = info.head
        text = (
            f"An early-exit drafter for self-speculative decoding of {target_name(info)} (EESD, seed 001): "
            f"the target's own first {head.num_shared_layers} of {head.num_hidden_layers} layers "
            f"(frozen, shared with the target at decoding time), then {head.num_exit_layers} trainable "
            "transformer layer(s), a norm and an lm head, trained by self-distillation."
        )
    else:
        arch = info.architecture
        purpose = (
            f"for {info.pair} translation prompts (seed 003's language-specific drafters)"
            if info.pair
            else "on generic text only (the pretraining stage of seed 003's pretrain-then-finetune)"
        )
        text = (
            f"A {_num(arch.parameters)}-parameter `{arch.class_name}` draft model for speculative decoding of "
            f"{target_name(info)}, trained {purpose}. It uses the target's tokenizer and vocabulary."
        )
    return (
        text + " Speculative decoding never changes what the target generates (it is lossless at every "
        "temperature); the drafter only makes it faster."
    )


def measured_section(info: ExportResults) -> list[str]:
    m = info.measurement
    if not m.measured:
        return [
            "## Measured speedups",
            "",
            "**No measurements.** The measure stage of this run did not measure this "
            f"{ {'early_exit': 'head', 'heads': 'set of heads', 'eagle3': 'head'}.get(info.kind, 'drafter') }, so the speedup it "
            "gives is unknown.",
            "",
        ]
    ctx, rows = m.context, m.rows
    assert ctx is not None, "a measured drafter has a measurement context"
    methods = list(dict.fromkeys(r.method for r in rows))
    lines = ["## Measured speedups", ""]
    best = m.headline
    if best is not None:
        lines += [
            f"At temperature {best.temperature:g}, `{best.method}` on `{best.dataset}` reached a block "
            f"efficiency of {best.block_efficiency.mean:.2f} and a wall-clock speedup of "
            f"{best.speedup.mean:.2f}x over autoregressive decoding (`ar`).",
            "",
        ]
    lines += [
        f"Measured on {', '.join(ctx.hardware)} ({', '.join(ctx.device)}) between {ctx.dates[0]} and "
        f"{ctx.dates[-1]} (UTC) with torch {', '.join(ctx.torch)} and transformers "
        f"{', '.join(ctx.transformers)}: batch size 1, {', '.join(map(str, ctx.prompts))} prompts per set, "
        f"up to {', '.join(map(str, ctx.max_new_tokens))} new tokens, seeds {ctx.seeds}. Cells are mean ± "
        "std over seeds; the speedup is the token rate over `ar`'s in the same process on the same prompts. "
        "Engine: polydraft's own decoders, except methods marked `(vLLM)`, measured inside vLLM (see below).",
        "",
        "### Block efficiency (tokens per target call)",
        "",
        table(rows, "block_efficiency", methods=methods),
        "",
        "### Speedup over autoregressive decoding",
        "",
        table(rows, "speedup", methods=methods),
        "",
        "### Methods",
        "",
        "| method | engine | decoder | control | K | tree |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for method in methods:
        row = next(r for r in rows if r.method == method)
        engine = row.engine_detail or row.engine
        cells = [engine, row.decoder, row.control or "-", row.draft_length or "-", row.tree or "-"]
        lines.append(f"| {method} | " + " | ".join(str(c) for c in cells) + " |")
    if any(r.in_domain is not None for r in rows):
        lines += ["", "### In-domain vs out-of-domain (seed 003 Fig. 5)", "", domain_table(rows)]
    greedy = [s for s in m.summary if s.temperature == 0]
    if greedy:
        differ = sorted({(s.method, s.dataset) for s in greedy if s.matches_ar is False})
        lines += [
            "",
            "At temperature 0 every method produced exactly `ar`'s tokens on every prompt."
            if not differ
            else "At temperature 0 these outputs differed from `ar`'s (numerical ties in low precision can "
            "cause this): " + ", ".join(f"{a} on {b}" for a, b in differ),
        ]
    lines.append("")
    lines += vllm_section(rows, "### vLLM beside polydraft's engine")
    for plot in info.plots:
        lines += [f"![{PLOT_TITLES.get(plot, plot)}]({plot})", ""]
    lines += [
        "All metrics (MBSU, token rate, acceptance rate, HM, engine overhead): [summary.md](summary.md); "
        "every row: [results.json](results.json).",
        "",
    ]
    return lines


def training_section(info: ExportResults) -> list[str]:
    training = info.training
    lines = ["## Training", ""]
    if info.kind == "early_exit":
        head, cal = info.head, info.calibration
        lines += [
            f"- Exit after layer {head.num_shared_layers} of {head.num_hidden_layers}; "
            f"{head.num_exit_layers} exit layer(s) initialised from the target's last layer(s), the norm "
            "and head from the target's (seed 001 eq. 1).",
            f"- {_num(head.steps)} optimizer steps, final train loss {_num(head.train_loss)}; held-out "
            f"top-1 agreement with the full target {_num(head.top1_target)} (at initialisation "
            f"{_num(head.initial_top1_target)}).",
        ]
        if cal is not None:
            h = cal.heldout
            lines.append(
                f"- Calibration model for Cali-TS (seed 001 eq. 5) over {cal.draft_length} draft steps, on "
                f"{_num(h.count)} held-out steps: accuracy {_num(h.accuracy)} (base rate "
                f"{_num(h.base_rate_accuracy)}), Brier score {_num(h.brier)} (base rate "
                f"{_num(h.base_rate_brier)}), ECE {_num(h.ece)}."
            )
        return [*lines, ""]
    if info.kind == "eagle3":
        return [*lines, *eagle3.training_lines(info), ""]
    if info.kind == "heads":
        heads = info.heads

        def per_head(values: list[float] | None) -> str:
            return ", ".join(f"{v:.3f}" for v in values) if values is not None else "-"

        lines += [
            f"- {'Medusa-1' if heads.kind == 'medusa' else 'BPD'} heads on the frozen target's last hidden "
            "states, trained on the target's own answers (self-distillation) and the run's open rows; "
            f"{_num(heads.steps)} optimizer steps, final train loss {_num(heads.train_loss)}.",
            "- Held-out top-1 agreement with the target's greedy token at each head's position, head by head: "
            f"{per_head(heads.top1_target)} (as initialised: {per_head(heads.initial_top1_target)}).",
        ]
        return [*lines, ""]
    pretrain, finetune = training.pretrain, training.finetune
    if pretrain is not None:
        lines.append(
            f"- **Pretrain (P)**: `{pretrain.arch}` on {'; '.join(pretrain.sources) or 'no corpus'}; "
            f"{_num(pretrain.tokens)} tokens seen (budget {_num(pretrain.token_budget)}), "
            f"{_num(pretrain.steps)} steps, final train loss {_num(pretrain.train_loss)}."
        )
    if finetune is not None:
        temps = ", ".join(f"{t:g}" for t in finetune.temperatures)
        lines.append(
            f"- **Finetune (F)** from {finetune.start}: the target's own answers (self-distillation, "
            f"`{finetune.prompt_format}` prompt format)"
            + (f" to prompts from {'; '.join(finetune.distill_sources)}" if finetune.distill_sources else "")
            + (f", mixed with {'; '.join(finetune.open_sources)}" if finetune.open_sources else "")
            + f", distilled at temperatures {temps}; loss `{finetune.loss}` on the answer tokens; "
            f"{_num(finetune.tokens)} tokens seen, {_num(finetune.steps)} steps, final train loss "
            f"{_num(finetune.train_loss)}; held-out top-1 agreement with the target's greedy tokens "
            f"{_num(finetune.top1_agreement)}."
        )
    if info.calibration is not None:
        lines.append(
            "- A calibration model for Cali-TS ships in `calibration/` "
            "(`models.calibration.CalibrationModel.load`)."
        )
    return [*lines, ""]


def smoke_section(info: ExportResults) -> list[str]:
    smoke = info.smoke
    verdict = "passed" if smoke.passed else "**FAILED** (do not use this export)"
    lines = [
        "## Smoke check",
        "",
        f"Checked on the machine that made it, before publishing: {verdict}.",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    for check in smoke.checks:
        detail = check.detail.replace("|", "\\|")
        lines.append(f"| {check.name} | {check.status} | {detail} |")
    return [*lines, ""]


def draft_length(info: ExportResults) -> tuple[int, str]:
    m = info.measurement
    if m.best_draft_length is not None:
        return m.best_draft_length, "the K that measured best"
    if m.measured:
        return info.draft_length_default, "no fixed K was measured: the recipe's `measure.draft_length`"
    return info.draft_length_default, "not measured: the recipe's `measure.draft_length`"


def usage_section(info: ExportResults, repo_id: str) -> list[str]:
    target = info.target.id or "path/to/the/target"
    k, why = draft_length(info)
    prompt = info.prompt
    if info.kind == "heads":
        return heads_usage(info, repo_id, target)
    if info.kind == "eagle3":
        return eagle3.usage_lines(info, repo_id, target)
    if info.kind == "early_exit":
        return [
            "## Usage",
            "",
            "The head attaches to the full target with polydraft's loader; its first layers ARE the "
            "target's modules (no copy), and polydraft's `eesd` decoder shares their KV cache between "
            "drafting and verification.",
            "",
            "```python",
            "import torch",
            "from huggingface_hub import snapshot_download",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "from decoding.control import FixedK",
            "from decoding.eesd import SelfSpeculative, self_speculative",
            "from decoding.sampling import Sampling",
            "from models.early_exit import attach_exit_head  # pip install polydraft",
            "",
            f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")',
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
            f'folder = snapshot_download("{repo_id}")',
            "head = attach_exit_head(target, folder)",
            "model = SelfSpeculative(target, head)",
            f"prompt = {prompt.example!r}",
            f"ids = torch.tensor(tokenizer(prompt, add_special_tokens={prompt.add_special_tokens})['input_ids'])",
            "out = self_speculative(",
            f"    model, ids, 256, Sampling(0.0), FixedK({k}), torch.Generator(target.device), {{tokenizer.eos_token_id}}",
            ")",
            "print(tokenizer.decode(out.tokens))",
            "```",
            "",
            f"K={k} is {why}. The calibration model (`calibration/`, when present) loads with "
            "`models.calibration.CalibrationModel.load(folder + '/calibration')` and drives Cali-TS "
            "(`decoding.control.CaliTS`).",
            "",
        ]
    return [
        "## Usage",
        "",
        f"Use the prompt format it was trained on (`{prompt.format}`). K={k} is {why}; the folder's "
        "`generation_config.json` makes transformers draft that many tokens per round.",
        "",
        "transformers (assisted generation):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")',
        f'drafter = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto", device_map="auto")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        f"prompt = {prompt.example!r}",
        f'inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens={prompt.add_special_tokens}).to(target.device)',
        "output = target.generate(**inputs, assistant_model=drafter, max_new_tokens=256, do_sample=False)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
        "vLLM (draft-model speculative decoding):",
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f"prompt = {prompt.example!r}",
        "llm = LLM(",
        f'    model="{target}",',
        f'    speculative_config={{"method": "draft_model", "model": "{repo_id}", "num_speculative_tokens": {k}}},',
        ")",
        "print(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=256))[0].outputs[0].text)",
        "```",
        "",
        "or `vllm serve " + target + " --speculative-config "
        f'\'{{"method": "draft_model", "model": "{repo_id}", "num_speculative_tokens": {k}}}\'`.',
        "",
    ]


def heads_usage(info: ExportResults, repo_id: str, target: str) -> list[str]:
    """vLLM's `medusa` method (the chain of the heads' argmaxes) and polydraft's own blockwise decoders."""
    prompt, heads = info.prompt, info.heads
    speculative = f'{{"method": "medusa", "model": "{repo_id}", "num_speculative_tokens": {heads.num_heads}}}'
    return [
        "## Usage",
        "",
        f"Use the prompt format it was trained on (`{prompt.format}`).",
        "",
        "vLLM (`medusa` speculative method: drafts each head's argmax, a chain, as polydraft's `bpd`):",
        "",
        "```python",
        "from vllm import LLM, SamplingParams",
        "",
        f"prompt = {prompt.example!r}",
        f'llm = LLM(model="{target}", speculative_config={speculative})',
        "print(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=256))[0].outputs[0].text)",
        "```",
        "",
        "polydraft (`bpd`, `medusa` trees and `+rescore` with a drafter LM; `models.heads.attach_heads`):",
        "",
        "```python",
        "import torch",
        "from huggingface_hub import snapshot_download",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from decoding.blockwise import HeadsDraft, blockwise_tree",
        "from decoding.lattice import CandidateTree",
        "from decoding.lm import CachedLM",
        "from decoding.sampling import Sampling",
        "from models.heads import attach_heads  # pip install polydraft",
        "",
        f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto", device_map="auto")',
        f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
        "target_lm = CachedLM(target)",
        f'heads = HeadsDraft(attach_heads(target, snapshot_download("{repo_id}")), target_lm)',
        "tree = CandidateTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])",
        f"prompt = {prompt.example!r}",
        f"ids = torch.tensor(tokenizer(prompt, add_special_tokens={prompt.add_special_tokens})['input_ids'])",
        "out = blockwise_tree(",
        "    target_lm, heads, ids, 256, Sampling(0.0), torch.Generator(target.device), {tokenizer.eos_token_id}, tree",
        ")",
        "print(tokenizer.decode(out.tokens))",
        "```",
        "",
    ]


def mixed_traffic_section(info: ExportResults) -> list[str]:
    """Routed per-language drafters against one multilingual drafter on this run's mixed traffic."""
    mixed = info.mixed_traffic
    if mixed is None:
        return []
    summary = mixed.summary.replace("\n### ", "\n#### ").replace("## Mixed-language traffic", "", 1).strip()
    return [
        "## Mixed-language traffic: one drafter per language behind a router, or one multilingual drafter?",
        "",
        *(f"- {decision[0].upper()}{decision[1:]}." for decision in mixed.decisions),
        "",
        f"Decision rule: {mixed.rule}.",
        "",
        summary.split("Decision rule:")[0].strip(),
        "",
    ]


def provenance(info: ExportResults) -> list[str]:
    git = info.polydraft
    commit = git.commit or "unknown"
    dirty = " (with uncommitted changes)" if git.dirty else ""
    return [
        "## Provenance",
        "",
        f"Made by polydraft at commit `{commit}`{dirty}; every number in this card is read from the run's "
        "files (`results.json`).",
        "",
    ]


def render_card(info: ExportResults, repo_id: str) -> str:
    """The README.md of an exported folder; `repo_id` is where the usage snippets load it from."""
    parts = [
        front_matter(info),
        title(info),
        "",
        intro(info),
        "",
        *measured_section(info),
        *mixed_traffic_section(info),
        *training_section(info),
        *smoke_section(info),
        *usage_section(info, repo_id),
        *provenance(info),
    ]
    return "\n".join(parts)

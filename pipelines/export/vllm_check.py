"""The export's real vLLM check: every exported drafter, Medusa heads folder and EAGLE-3 head, loaded by
vLLM as the target's speculative draft, must give the target's own greedy output (and a head, accepted
drafts).

All the folders of an export are checked in one subprocess (`python -m polydraft.pipelines.export.vllm_check`,
so that vLLM's memory is freed and its changes to the process stay there): it imports vLLM once, generates
with the target alone once on every prompt any folder is checked on, then builds one engine per folder
(`speculative_config={"method": ..., "model": folder, ...}`), one after the other, and prints one JSON line
per folder as it finishes. A folder whose engine kills the subprocess fails its check with what the
subprocess printed, and the folders after it are checked in a new one. On a GPU node the folders are
dealt to one such subprocess per copy of the target the node's GPUs hold, all at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from polydraft.decoding.measurement.vllm_measure import PER_POSITION, spec_counters
from polydraft.decoding.measurement.vllm_rows import vllm_subprocess, vllm_unavailable
from polydraft.pipelines.export.smoke import Check

VLLM_TIMEOUT_S = 1800
"""Per folder: the subprocess's limit is this times the folders it checks."""


@dataclass(frozen=True)
class VllmDraft:
    """One folder to check: vLLM's speculative `method` (`draft_model` for a drafter, `medusa` for a heads
    folder, `eagle3` for an EAGLE-3 head), its draft tokens per round and the prompts (token ids)."""

    folder: str
    method: str
    num_speculative_tokens: int
    prompts: list[list[int]]


def vllm_generation_checks(
    mode: str, target: dict[str, Any], drafts: list[VllmDraft], max_new_tokens: int, devices: list[str]
) -> list[Check]:
    """Per draft, in order: vLLM's greedy output with it equals the target's alone (and an EAGLE-3 head had
    drafts accepted). `target`: path, revision, trust_remote_code; `mode`: export.vllm_check; `devices`:
    the GPUs of each copy of the target (`vllm_generations`). The detail names the draft tokens accepted,
    in total and per draft position."""
    if mode == "off":
        return [Check("vllm_generation", "skipped", "export.vllm_check is off") for _ in drafts]
    why = vllm_unavailable()
    if why is not None:
        return [Check("vllm_generation", "fail" if mode == "require" else "skipped", why) for _ in drafts]
    results = vllm_generations(target, drafts, max_new_tokens, devices)
    return [check_of(result, draft) for result, draft in zip(results, drafts, strict=True)]


def check_of(result: dict[str, Any], draft: VllmDraft) -> Check:
    """The check of one draft's generations (`vllm_generations`)."""
    method = draft.method
    if "error" in result:
        where = f"vLLM {result['vllm']}: " if "vllm" in result else ""
        return Check("vllm_generation", "fail", where + result["error"])
    alone, drafted = result["alone"], result["drafted"]
    for index, (a, d) in enumerate(zip(alone, drafted, strict=True)):
        if a != d:
            at = next((i for i, (x, y) in enumerate(zip(a, d)) if x != y), min(len(a), len(d)))
            return Check(
                "vllm_generation",
                "fail",
                f"prompt {index}: vLLM {result['vllm']} with the {method} drafter differs from the "
                f"target alone from new token {at} on ({d[at : at + 5]} vs {a[at : at + 5]})",
            )
    if min(len(a) for a in alone) == 0:
        return Check("vllm_generation", "fail", f"vLLM generated no token for some prompt: {result}")
    if method == "eagle3" and not result["accepted"]:  # a head read another way than trained drafts nothing
        return Check(
            "vllm_generation",
            "fail",
            f"vLLM {result['vllm']} accepted none of {result['drafted_tokens']} draft tokens of the head: it "
            "does not read the head as polydraft trained it (vocabulary map, feature layers or norms)",
        )
    return Check(
        "vllm_generation",
        "pass",
        f"vLLM {result['vllm']} ({result['device']}): {sum(len(a) for a in alone)} greedy tokens for "
        f"{len(drafted)} prompts with the drafter as `{method}` draft (num_speculative_tokens="
        f"{draft.num_speculative_tokens}), identical to the target alone; {result['accepted']} of "
        f"{result['drafted_tokens']} draft tokens accepted (per position {result['accepted_per_position']})",
    )


def vllm_generations(
    target: dict[str, Any], drafts: list[VllmDraft], max_new_tokens: int, devices: list[str]
) -> list[dict[str, Any]]:
    """Per draft, greedy generations of vLLM with the target alone and with the draft (`main`, in a
    subprocess): `alone`, `drafted`, `accepted`, `drafted_tokens`, `accepted_per_position`, `vllm`,
    `device`; or an `error` saying why none came back (with `vllm`, the version, when the subprocess got
    that far). `devices`: one `CUDA_VISIBLE_DEVICES` value per copy of the target this node's GPUs hold;
    the drafts are dealt round-robin to one subprocess per copy, all running at once (none: one
    subprocess that sees what this process sees, a CPU's)."""
    copies = devices[: len(drafts)] or [None]
    results: list[dict[str, Any]] = [{} for _ in drafts]

    def check_share(copy: int) -> None:
        indices = list(range(copy, len(drafts), len(copies)))
        for index, result in zip(indices, _one_copy(target, [drafts[i] for i in indices], max_new_tokens, copies[copy]), strict=True):  # fmt: skip
            results[index] = result

    with ThreadPoolExecutor(len(copies)) as pool:
        list(pool.map(check_share, range(len(copies))))
    return results


def _one_copy(
    target: dict[str, Any], drafts: list[VllmDraft], max_new_tokens: int, device: str | None
) -> list[dict[str, Any]]:
    """`drafts` in subprocesses on one copy of the target: a subprocess that dies fails the draft it was
    on, and a new one goes on with the rest."""
    results: list[dict[str, Any]] = []
    while len(results) < len(drafts):
        remaining = drafts[len(results) :]
        found, error = _subprocess(target, remaining, max_new_tokens, device)
        results += found
        if len(found) < len(remaining):  # the subprocess died on this draft: it fails, the rest go on
            results.append({"error": error})
    return results


def _subprocess(
    target: dict[str, Any], drafts: list[VllmDraft], max_new_tokens: int, device: str | None
) -> tuple[list[dict[str, Any]], str]:
    """The results of the drafts one subprocess finished (a prefix of `drafts`), and what it said when it
    ended (the reason, when it stopped before the last draft)."""
    request = {"target": target, "drafts": [asdict(d) for d in drafts], "max_new_tokens": max_new_tokens}
    timeout = VLLM_TIMEOUT_S * len(drafts)
    try:
        done = vllm_subprocess(__name__, request, timeout, device)
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        return _lines(stdout), f"vLLM did not finish within {timeout} s"
    found = _lines(done.stdout)
    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
    return found, f"vLLM exited with {done.returncode}: {' | '.join(tail)}"


def _lines(stdout: str) -> list[dict[str, Any]]:
    """The result lines `main` printed (each a JSON object naming the vLLM version), whatever else vLLM
    printed between them."""
    found = []
    for line in stdout.splitlines():
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "vllm" in parsed:
            found.append(parsed)
    return found


def main() -> None:
    """Subprocess side: read the request on stdin, generate greedily with the target alone on every prompt,
    then with each draft in turn, printing one JSON line per draft (its outputs, or the error that stopped
    vLLM from loading it)."""
    from polydraft.distill.engines import die_with_parent

    die_with_parent()  # no vLLM process outlives a killed export stage
    import gc

    import vllm

    from polydraft.distill.vllm_backend import engine_kwargs, on_cpu

    request = json.loads(sys.stdin.read())
    target, drafts = request["target"], [VllmDraft(**d) for d in request["drafts"]]
    prompts = list(dict.fromkeys(tuple(p) for d in drafts for p in d.prompts))
    cpu = on_cpu()
    kwargs = engine_kwargs(
        target["path"],
        target["revision"],
        "auto",
        target["trust_remote_code"],
        tensor_parallel_size=1,
        max_model_len=max(len(p) for p in prompts) + request["max_new_tokens"] + 16,
        gpu_memory_utilization=0.5,
        seed=0,
        cpu_kv_cache_gib=1.0 if cpu else None,
    )
    kwargs.update(enforce_eager=True, disable_log_stats=False)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"])
    answer: dict[str, Any] = {"vllm": vllm.__version__, "device": "CPU build" if cpu else "GPU"}
    llm = vllm.LLM(**kwargs)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    alone = {p: list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)}
    del llm
    gc.collect()
    for draft in drafts:
        print(json.dumps({**answer, **_drafted(vllm, kwargs, params, draft, alone)}), flush=True)
        gc.collect()


def _drafted(vllm: Any, kwargs: dict[str, Any], params: Any, draft: VllmDraft, alone: dict) -> dict[str, Any]:
    """One draft's generations beside the target's alone, or the error that stopped vLLM loading it."""
    speculative = {
        "method": draft.method,
        "model": draft.folder,
        "num_speculative_tokens": draft.num_speculative_tokens,
    }
    try:
        llm = vllm.LLM(**kwargs, speculative_config=speculative)
    except Exception as err:  # noqa: BLE001 - whatever vLLM raises while loading the drafter is the finding
        reason = f"{type(err).__name__}: {err}"[:600]  # vLLM may append its whole list of architectures
        return {"error": f"the drafter does not load: {reason}"}
    outputs = llm.generate([{"prompt_token_ids": p} for p in draft.prompts], params, use_tqdm=False)
    counters = spec_counters(llm)
    del llm
    return {
        "alone": [alone[tuple(p)] for p in draft.prompts],
        "drafted": [list(o.outputs[0].token_ids) for o in outputs],
        "accepted": counters["vllm:spec_decode_num_accepted_tokens"],
        "drafted_tokens": counters["vllm:spec_decode_num_draft_tokens"],
        "accepted_per_position": counters[PER_POSITION],
    }


if __name__ == "__main__":
    main()

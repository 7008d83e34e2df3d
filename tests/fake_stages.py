"""Stand-in stages for runner tests: each writes a small output and records that it ran."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipelines.runner import Stage
from pipelines.stage import StageResult

TOPOLOGY = {  # the real pipeline's blocks and upstream edges
    "distill": (("distill",), ()),
    "pretrain": (("pretrain", "launch"), ()),
    "finetune": (("finetune", "launch"), ("distill", "pretrain")),
    "early_exit": (("early_exit", "launch"), ("distill",)),
    "calibrate": (("calibrate", "launch"), ("early_exit", "finetune")),
    "measure": (("measure",), ("finetune", "early_exit", "calibrate")),
    "export": (("export",), ("finetune", "early_exit", "calibrate", "measure")),
}


def _make(name: str):
    def run(recipe, ctx):
        log = Path(os.environ["FAKE_STAGE_LOG"])
        with open(log, "a") as handle:
            handle.write(name + "\n")
        inputs = {u: (p / "out.json").read_text() for u, p in sorted(ctx.upstream.items())}
        (ctx.work_dir / "part-1.txt").write_text("first half")
        if os.environ.get("FAKE_STAGE_HANG") == name and not (ctx.work_dir / "part-2.txt").exists():
            (ctx.work_dir / "hanging").write_text("")
            time.sleep(600)  # the test kills us here
        (ctx.work_dir / "part-2.txt").write_text("second half")
        resumed = (ctx.work_dir / "hanging").exists()
        (ctx.work_dir / "out.json").write_text(json.dumps({"stage": name, "inputs": sorted(inputs)}))
        if os.environ.get("FAKE_STAGE_FAIL") == name:
            raise RuntimeError(f"{name} failed on purpose")
        return StageResult(metrics={"resumed": resumed, "value": 1.5})

    return run


def fake_stages() -> list[Stage]:
    return [Stage(name, _make(name), blocks, upstream) for name, (blocks, upstream) in TOPOLOGY.items()]

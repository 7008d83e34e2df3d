"""`routing.json`, the export stage's routing table: which exported drafter serves which language.

A serving process reads it with `pipelines.export.routing.load_router(folder)` and calls
`router.route(text)` per request (docs/serving.md shows a deployment behind an OpenAI-compatible router).
"""

from __future__ import annotations

from pathlib import Path

from polydraft.data.prompts import MULTILINGUAL
from polydraft.pipelines.export.records import ExportIndex
from polydraft.pipelines.export.routing import (
    ROUTING_FILE,
    RoutingTable,
    routing_table_for,
    write_routing_table,
)


def export_routing_table(work_dir: Path, index: ExportIndex, threshold: float) -> RoutingTable | None:
    """`routing.json` beside the exported folders (`pipelines.export.routing`): each pair drafter
    and each pair's EAGLE-3 head serves its pair's source language; the fallbacks are the multilingual
    drafter (else the generic pretrained one, else none: plain decoding) and the multilingual head. None,
    and no file, when no pair drafter or head was exported."""
    drafters = {i.name: i.folder for i in index.items if i.kind == "drafter"}
    pairs = {i.pair: i.folder for i in index.items if i.kind == "drafter" and i.pair is not None}
    heads = {i.pair: i.folder for i in index.items if i.kind == "eagle3" and i.pair is not None}
    if not pairs and not heads:
        return None
    multilingual_head = next((i.folder for i in index.items if i.kind == "eagle3" and i.pair is None), None)
    table = routing_table_for(
        pairs, drafters.get(MULTILINGUAL, drafters.get("pretrain")), threshold, heads, multilingual_head
    )
    write_routing_table(work_dir / ROUTING_FILE, table)
    return table

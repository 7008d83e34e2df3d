"""Export, smoke checks, model cards and publishing: what turns a run's drafters into Hub folders.

- `info`, `records`: what an exported folder is and the records the export stage writes about it.
- `smoke`, `smoke_heads`: the checks an exported drafter, early-exit head or heads folder must pass.
- `cards`: model cards rendered from the measured rows.
- `publish`: `polydraft publish`, one Hub repo and commit per folder.
"""

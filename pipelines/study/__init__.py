"""`polydraft study`: the seeds' findings reproduced by the pipeline itself, with error bars.

A study runs variants of one recipe (`variants`: the recipe plus overrides, each in its own run
directory under the study directory), sharing every stage folder whose key is equal between variants
(`pipelines.run.runner.reuse_outputs`), computes each finding of the seeds from the variants' measure rows
(`findings`, on the types and row selection of `model`) under one stated rule (`verdicts`), and writes
`report.md`, its plots and `study.json` (`report`). `run` ties them together.
"""

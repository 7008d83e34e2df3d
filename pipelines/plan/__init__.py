"""`polydraft plan`: what a recipe will cost before it runs, stage by stage (`estimate`), printed as a table
(`printing`), with what the run writes to disk (`disk`). The devices' rates are `pipelines.runtime.cluster`'s."""

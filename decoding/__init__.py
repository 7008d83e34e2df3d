"""The measurement engine: lossless speculative decoders at batch size 1, their metrics, the measure stage.

- `sampling`: logits processing shared by drafter and target; chain and recursive rejection sampling,
  Gumbel-top-k, stochastic beam search.
- `lm`: a causal LM with its own KV cache, head applied only to the rows needed.
- `engine`: the output buffer, generation records, `ar`.
- `sd`, `rsd` + `tree`, `eesd`: chain, tree (RSD-C / RSD-S) and early-exit self-speculative decoding.
- `control`: fixed K, Beta-TS, Cali-TS draft-length control.
- `metrics`, `report`: the seeds' metrics, summary tables and plots.
- `assisted`: transformers' assisted generation as a reference.
- `inputs`, `measure`: the measure stage (`decoding.measure.run`).
"""

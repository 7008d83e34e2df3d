"""The decoding engines: lossless speculative decoders at batch size 1 and what they are built from.

- `sampling`: logits processing shared by drafter and target; chain and recursive rejection sampling,
  Gumbel-top-k, stochastic beam search.
- `lm`: a causal LM with its own KV cache, head applied only to the rows needed.
- `engine`: the output buffer, generation records, `ar`.
- `sd`, `rsd` + `tree`, `eesd`, `blockwise` + `lattice`: chain, tree (RSD-C / RSD-S), early-exit
  self-speculative and blockwise (BPD / Medusa, with local rescoring) decoding.
- `control`: fixed K, Beta-TS, Cali-TS draft-length control.
- `assisted`: transformers' assisted generation as a reference.

The measurement harness that times and reports them is the `measurement` subpackage.
"""

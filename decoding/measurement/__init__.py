"""The measurement harness around the decoding engines: eval-set inputs, decoding groups and their result
rows, latency probes and the speedups a latency model predicts, the seeds' metrics, summary tables and plots, and
the rows measured inside vLLM.

- `inputs`: the drafters of a run and the eval sets' prompts.
- `measure`: decoding one group of prompts with every method, the rows and headline metrics.
- `latency`: timed forward calls of each model, round costs, predicted speedups.
- `results`: the typed `results.jsonl` rows.
- `metrics`, `report`: the seeds' metrics, summary tables and plots.
- `vllm_rows`, `vllm_measure`: the same drafters measured inside vLLM (a subprocess).
"""

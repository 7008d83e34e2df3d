"""The data every stage reads: prompt formats (`prompts`), data sources (`sources`), the offline corpus
(`offline`) and the distillation mix (`mix`). Below `distill/`, `train/` and `decoding/`, which import it."""

"""Write the recorded study's counts and summary table into the docs: docs/study.md's first line (the
report's heading) and the block between its `SUMMARY` markers (the tally and the summary table of
`bench/results/study.md`), and the README's study line, all from `bench/results/study.json`.
`tests/pipelines/test_study.py` holds the docs to that file.

    python -m bench.study_docs
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from polydraft.pipelines.study.model import Finding
from polydraft.pipelines.study.report import headline, summary_table, tally

ROOT = Path(__file__).resolve().parents[1]
STUDY_JSON = ROOT / "bench" / "results" / "study.json"
BEGIN, END = "<!-- SUMMARY: python -m bench.study_docs -->", "<!-- /SUMMARY -->"
README_LINE = r"\| \[The study\]\(docs/study\.md\) \| .* \|"


def summary_block(study: dict) -> str:
    """The tally and the summary table of the recorded study, as the report prints them."""
    findings = [Finding.model_validate(f) for f in study["findings"]]
    return "\n".join([tally(findings), "", *summary_table(findings, 1)])


def readme_line(study: dict) -> str:
    return f"| [The study](docs/study.md) | the seeds' findings re-measured on the demo target: {headline(study['findings'])} |"


def main() -> None:
    study = json.loads(STUDY_JSON.read_text(encoding="utf-8"))
    docs = ROOT / "docs" / "study.md"
    text = docs.read_text(encoding="utf-8")
    lines = text.split("\n")
    lines[0] = f"# Study: {headline(study['findings'])}"
    text = "\n".join(lines)
    before, rest = text.split(BEGIN)
    _, after = rest.split(END)
    docs.write_text(f"{before}{BEGIN}\n{summary_block(study)}\n{END}{after}", encoding="utf-8")
    readme = ROOT / "README.md"
    new, n = re.subn(README_LINE, readme_line(study), readme.read_text(encoding="utf-8"))
    if n != 1:
        raise SystemExit(f"README.md: {n} lines match {README_LINE!r}, expected 1")
    readme.write_text(new, encoding="utf-8")
    print(f"docs/study.md and README.md: {headline(study['findings'])}")


if __name__ == "__main__":
    main()

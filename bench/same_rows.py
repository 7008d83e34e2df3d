"""Do two measure runs decode the same? Their polydraft rows' block efficiencies compared group by group.

A refactoring, a dependency upgrade or a thread-count change must leave the decoded tokens as they were:
at the same recipe, the block efficiency of every (method, eval set, temperature, repetition) row is then
equal, and every row still matches `ar` at T=0.

    python -m bench.same_rows RESULTS_A.jsonl RESULTS_B.jsonl [--record FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(path: Path) -> dict[tuple, tuple[float, bool | None]]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["engine"] == "polydraft":
            key = (row["method"], row["dataset"], row["temperature"], row["seed"])
            out[key] = (row["block_efficiency"], row["matches_ar"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    a, b = rows(args.first), rows(args.second)
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k][0] != b[k][0]]
    lines = [
        f"{args.first} ({len(a)} rows) against {args.second} ({len(b)} rows): {len(common)} rows in both, "
        f"{len(differ)} with another block efficiency; {len(set(a) ^ set(b))} in one only; "
        f"rows of the second not matching ar at T=0: {sum(1 for k in b if k[2] == 0 and b[k][1] is False)}",
        *(f"- {k}: {a[k][0]:.4f} -> {b[k][0]:.4f}" for k in differ),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.record:
        args.record.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()

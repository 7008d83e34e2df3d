"""`make test-newest`'s check of the layer it lays over the test environment: the transformers release in it, and
every package that release requires and those packages require in turn (outside their extras) installed at a
version the requirement allows, so a release that adds a requirement fails here, naming it, and not later as a
confusing test failure.

Run with the layer on PYTHONPATH: `PYTHONPATH=.newest python -m tests.newest_layer`."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement


def unmet(package: str) -> list[str]:
    """The requirements below `package` (extras left out) that the environment does not meet, as sentences."""
    problems = []
    pending, seen = [package], {package}
    while pending:
        for line in requires(pending.pop()) or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = version(requirement.name)
            except PackageNotFoundError:
                problems.append(f"{requirement} is not installed")
                continue
            if not requirement.specifier.contains(found, prereleases=True):
                problems.append(f"{requirement} is not met by {requirement.name} {found}")
            if requirement.name not in seen:
                seen.add(requirement.name)
                pending.append(requirement.name)
    return problems


if __name__ == "__main__":
    print("transformers", version("transformers"))
    problems = unmet("transformers")
    for problem in problems:
        print(
            f"the newest layer lacks a requirement: {problem}; add it to the Makefile's test-newest install"
        )
    sys.exit(1 if problems else 0)

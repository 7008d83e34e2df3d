"""The code a stage runs, as a fingerprint its manifest records: the stage's module and every polydraft
module it imports, directly or through others (read from the source, so nothing is imported or run).

A stage folder that is up to date with the recipe but was made by other code is told apart from one made
by this code: the runner names the stage and the modules that differ, and `polydraft status` shows it.
Imports inside functions count (the stages import their engines lazily), so the closure of `measure`
holds the decoders and that of `distill` its backends.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "polydraft"


@dataclass(frozen=True)
class CodeFingerprint:
    digest: str
    """sha256 over the sorted (module, file digest) pairs."""
    modules: dict[str, str]
    """Module name -> sha256 of its source file."""

    def record(self) -> dict[str, object]:
        return {"fingerprint": self.digest, "modules": self.modules}


def _origin(module: str) -> Path | None:
    """The source file of `module`, found without importing it (None when the name is no module, e.g. a
    function imported with `from module import name`)."""
    parts = module.split(".")
    if parts[0] != ROOT_PACKAGE:
        spec = importlib.util.find_spec(module)  # a stage module outside polydraft (tests' stand-ins)
        return Path(spec.origin) if spec is not None and spec.origin else None
    if len(parts) < 2:
        return None
    spec = importlib.util.find_spec(".".join(parts[:2]))  # a top-level folder; imports nothing of it
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts[2:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(module: str, tree: ast.AST, is_package: bool) -> set[str]:
    """Modules named by the import statements anywhere in `tree` (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            # `from polydraft.decoding import sd` names a module too
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


@functools.lru_cache(maxsize=1024)
def _read(module: str, origin: str, mtime_ns: int, size: int) -> tuple[str, frozenset[str]]:
    """(sha256, imported names) of a source file; cached per file version (the runner fingerprints every
    stage on every run, and the stages share most of their modules)."""
    source = Path(origin).read_bytes()
    tree = ast.parse(source, filename=origin)
    return hashlib.sha256(source).hexdigest(), frozenset(
        _imports(module, tree, origin.endswith("__init__.py"))
    )


def code_fingerprint(start: str) -> CodeFingerprint:
    """The fingerprint of module `start` and every `polydraft` module it imports, transitively, plus the
    `__init__` of each package they sit in."""
    modules: dict[str, str] = {}
    todo, parents = [start], set()
    while todo:
        module = todo.pop()
        if module in modules:
            continue
        origin = _origin(module)
        if origin is None:
            continue
        stat = origin.stat()
        modules[module], named = _read(module, str(origin), stat.st_mtime_ns, stat.st_size)
        parents |= {".".join(module.split(".")[:i]) for i in range(2, module.count(".") + 1)}
        todo += [m for m in named if m.split(".")[0] == ROOT_PACKAGE and m not in modules]
    # a package's __init__ runs when any module under it is imported: its own source counts, but what it
    # imports does not become the stage's code (`pipelines.stages` names every stage)
    for package in parents - set(modules):
        origin = _origin(package)
        if origin is not None:
            modules[package] = hashlib.sha256(origin.read_bytes()).hexdigest()
    pairs = sorted(modules.items())
    digest = hashlib.sha256("\n".join(f"{m} {h}" for m, h in pairs).encode()).hexdigest()
    return CodeFingerprint(digest=digest, modules=dict(pairs))


def code_changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """`module (changed|new|gone)` for each module whose source differs between two fingerprints."""
    changes = []
    for module in sorted(set(recorded) | set(current)):
        if module not in recorded:
            changes.append(f"{module} (new)")
        elif module not in current:
            changes.append(f"{module} (gone)")
        elif recorded[module] != current[module]:
            changes.append(f"{module} (changed)")
    return changes

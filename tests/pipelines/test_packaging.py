"""The installed distribution: one `polydraft` namespace, every package listed, nothing generic in
site-packages (a wheel is built from the checkout and installed into a folder of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("pipelines", "data", "distill", "train", "models", "decoding")


def _setuptools() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (CI's); 3.10 has no TOML reader
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_the_polydraft_namespace():
    config = _setuptools()
    assert config["package-dir"] == {f"polydraft.{folder}": folder for folder in FOLDERS}
    on_disk = sorted(
        "polydraft." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    )
    assert sorted(config["packages"]) == on_disk


def test_the_wheel_installs_only_polydraft_and_import_models_fails_outside_the_checkout(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("polydraft-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {name.split("/")[0] for name in names} == {"polydraft", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "polydraft = polydraft.pipelines.cli.main:main" in entry_points
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    code = (
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import polydraft.models, polydraft.pipelines.cli.main, polydraft.decoding.measurement.tables\n"
        "print(polydraft.models.__file__)\n"
        "print([name for name in ('models', 'train', 'pipelines', 'distill', 'decoding')"
        " if importlib.util.find_spec(name) is not None])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=outside, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    models_file, generic = done.stdout.splitlines()
    assert Path(models_file).is_relative_to(site)
    assert generic == "[]"


STAGE_NAMES = {"distill", "early_exit", "calibrate", "heads", "eagle3", "measure"}
"""A stage's name is the one file name several folders share: its model (`models/`), trainer (`train/`),
proposer (`decoding/`), recipe block (`pipelines/schema/`), stage (`pipelines/stages/`) and export
(`pipelines/export/`), each the same feature at its own layer."""


def test_no_two_modules_share_a_file_name_but_a_stage_s_and_none_is_over_500_lines():
    by_name: dict[str, list[str]] = {}
    for folder in FOLDERS:
        for module in (ROOT / folder).rglob("*.py"):
            if module.name != "__init__.py":
                by_name.setdefault(module.stem, []).append(module.relative_to(ROOT).as_posix())
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in STAGE_NAMES}
    assert shared == {}
    long = {
        path: n
        for paths in by_name.values()
        for path in paths
        if (n := len((ROOT / path).read_text().splitlines())) > 500
    }
    assert long == {}


def module_level_imports(path: Path) -> set[str]:
    """The top-level names a module imports when it is imported (not inside a function, a class body's
    method or an `if TYPE_CHECKING:` block), relative imports left out."""
    import ast

    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return names


def test_every_package_imported_at_module_level_is_a_core_dependency():
    """`make demo` installs the core dependencies and the offline extra only: a package a module imports
    when it is imported (scipy in the measurement harness) must be a core dependency, or the import moved
    into the function that needs it. The dev extra's packages are only in the test environment."""
    import importlib.metadata
    import re

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    declared = {
        re.split(r"[\[<>=;! ]", spec, maxsplit=1)[0].lower().replace("_", "-")
        for spec in project["dependencies"]
    }
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for folder in FOLDERS:
        for module in (ROOT / folder).rglob("*.py"):
            for name in module_level_imports(module) - set(sys.stdlib_module_names) - {"polydraft"}:
                distributions = {d.lower().replace("_", "-") for d in providers.get(name, [name])}
                if not distributions & declared:
                    missing.setdefault(name, []).append(module.relative_to(ROOT).as_posix())
    assert missing == {}

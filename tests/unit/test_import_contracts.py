"""The floors of docs/architecture.md hold, and the check that says so can fail.

``lint-imports`` reads the contracts in pyproject.toml.  The second test
copies the packages, plants one upward import (the bottom floor importing the
controller) and expects the same check to refuse it: a contract that cannot
fail would prove nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serving_harness", "model_store", "handlers", "archiver", "windtunnel", "packrat_plugin", "bench")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: the copy's packages, not the installed ones, are the ones analysed.
    env = {**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def copy_packages(target: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, target / package, ignore=shutil.ignore_patterns("__pycache__", "archives"))
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    return target


@pytest.fixture(scope="module")
def clean_copy(tmp_path_factory) -> Path:
    return copy_packages(tmp_path_factory.mktemp("floors"))


def test_the_floors_are_kept(clean_copy):
    result = lint_imports(clean_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, planted, contract",
    [
        # the bottom floor reaching the top: the floors contract
        ("serving_harness/topology.py", "import packrat_plugin.cli", "Floors"),
        # a function-local import counts as much as one at the top
        ("model_store/catalog.py", "def _dodge():\n    import handlers.registry", "Floors"),
        # one paper's folder reaching into another's: the handlers' own floors
        ("handlers/ebird/pool.py", "import handlers.reef.preemption", "Inside handlers"),
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path, module, planted, contract):
    copy = copy_packages(tmp_path)
    path = copy / module
    path.write_text(path.read_text() + f"\n\n{planted}  # planted by the test\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and module.replace("/", ".").removesuffix(".py") in broken

"""The CUDA-only tests skip on this machine before their fixtures are set up, so a fixture they cannot
reach (one defined in the CPU twin's module and not imported) shows only on a GPU, where time is scarce:
the lent H100 of 2026-11-27 lost two of its tests to that.  Collection resolves every test's fixture
closure without CUDA, so it is checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COLLECT = """
import json, sys
import pytest

class Unresolved:
    def __init__(self):
        self.found = {}

    def pytest_collection_modifyitems(self, items):
        for item in items:
            info = getattr(item, "_fixtureinfo", None)
            if info is None:
                continue
            missing = [n for n in info.names_closure if n not in info.name2fixturedefs and n != "request"]
            if missing:
                self.found[item.nodeid] = missing

plugin = Unresolved()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[plugin])
print("UNRESOLVED " + json.dumps(plugin.found))
sys.exit(int(code))
"""


def unresolved_fixtures(*paths: str) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", COLLECT, *paths], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("UNRESOLVED "))
    return json.loads(line.removeprefix("UNRESOLVED "))


@pytest.mark.slow
def test_every_cuda_only_test_reaches_its_fixtures():
    assert unresolved_fixtures("tests/gpu") == {}

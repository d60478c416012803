"""What TorchServe's frontend (the JVM) still holds, read with the JDK's ``jcmd``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from serving_harness.torchserve import TorchServeProcess


def frontend_pid(server: TorchServeProcess) -> int:
    """The JVM's pid: ``torchserve --foreground`` runs it as a child of the launcher."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    for child in children:
        if "java" in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
            return int(child)
    raise AssertionError(f"no java process under TorchServe's launcher {server.proc.pid}")


def requests_held(server: TorchServeProcess) -> int:
    """Live ``RestJob`` objects in the frontend's heap after a full collection: HTTP requests it still holds."""
    jcmd = shutil.which("jcmd")
    assert jcmd is not None, "jcmd not found: the JDK's tools come with the Java 17 the frontend needs"
    histogram = subprocess.run(
        [jcmd, str(frontend_pid(server)), "GC.class_histogram"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    match = re.search(r"^\s*\d+:\s+(\d+)\s+\d+\s+org\.pytorch\.serve\.job\.RestJob\s*$", histogram, re.MULTILINE)
    return int(match.group(1)) if match else 0

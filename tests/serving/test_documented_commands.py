"""The benchmarks README.md and docs/ give run: each documented ``python -m bench.…`` line is started as
written and must get past its set-up without failing.

A run of a benchmark takes minutes to hours, so each is run for a few
seconds (``RUN_S``): it passes when it is still running then, or finished
with exit 0; it fails when it exited non-zero, with its output.  That is
where ``bench.packrat_e2e --model resnet50 --batches 2,4,8`` broke unseen
(its parser lacked an option the shared code read, so it crashed before its
first request).  Results go to a temporary ``--out-dir``, never to
docs/benchmarks.  Commands that cannot run here are listed in ``EXCUSED``
with the reason, so the list stays visible and short; ``packrat`` lines name
the reader's own files (``mymodel.mar``) and are parsed by
``tests/unit/test_documented_commands.py`` instead.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.documented_commands import REPO, DocumentedCommand, documented_commands
from tests.unit.test_documented_commands import parse

ARGPARSE_PARSE_ARGS = argparse.ArgumentParser.parse_args  # as imported, before any command was parsed
RUN_S = 6.0  # past the imports (~3 s of torch) and into the run
AT_ONCE = 2  # commands run side by side: each is mostly one Python thread (its imports) or a TorchServe starting
# A command's brief run: its exit code (None: still running at ``RUN_S``; "not started" where it could not be
# started), and its output or why it was not started.
BriefRun = tuple[int | str | None, str]
EXCUSED = {
    # entry point: why it is not started here
    "python -m bench.ebird_direct --device cuda": "needs CUDA",
}


def runnable() -> list[DocumentedCommand]:
    return [c for c in documented_commands() if c.argv[:2] == ["python", "-m"] and c.argv[2].startswith("bench.")]


def excuse(command: DocumentedCommand) -> str | None:
    for prefix, reason in EXCUSED.items():
        if command.line.startswith(prefix) and not (reason == "needs CUDA" and torch.cuda.is_available()):
            return reason
    return None


def _interruptible() -> None:
    """In the child before exec: SIGINT back to its default.  A shell without job control starts background
    jobs with SIGINT ignored, every child inherits that, and Python then installs no KeyboardInterrupt: the
    interrupt did nothing and each command ran to the SIGKILL, its TorchServe left behind (CI, 2026-11-28)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(argv: list[str], log: Path, tmp: Path) -> subprocess.Popen:
    # Output to a file, not a pipe that nobody reads until the end: a full pipe blocks the command.
    # TMPDIR under the test's folder: whatever the command starts there can be found and stopped after it.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *argv[1:]], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, preexec_fn=_interruptible)  # fmt: skip


def stop_leftovers(tmp: Path) -> list[int]:
    """SIGKILL the process groups of anything still running whose command line names ``tmp`` (a TorchServe a
    command started in a session of its own, with its java.io.tmpdir there); their pids."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(tmp) in cmdline and int(entry.name) != os.getpid():
            try:
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)
                killed.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def argv_for(command: DocumentedCommand, out_dir: Path) -> list[str]:
    """The command as documented, with ``--out-dir out_dir`` where it takes one and does not name one.

    ``parse`` patches ``argparse`` for the whole process while it reads the command: call it from one thread at
    a time (two at once leave the patch in place, and every later parser in the session raises)."""
    argv = command.argv
    if "out_dir" in vars(parse(command)) and "--out-dir" not in argv:
        argv = [*argv, "--out-dir", str(out_dir)]
    return argv


def run_briefly(
    command: DocumentedCommand, out_dir: Path, seconds: float = RUN_S, argv: list[str] | None = None
) -> tuple[int | None, str]:
    """Start the command (``argv``: as ``argv_for`` gives it); its exit code if it ended within ``seconds``
    (else None, and it is interrupted as a user's Ctrl-C would, so its TorchServe stops too), and its output."""
    argv = argv_for(command, out_dir) if argv is None else argv
    log = out_dir / "output.log"
    # Short: TorchServe's workers put their unix sockets under it, and a socket path has 107 bytes at most.
    tmp = Path(tempfile.mkdtemp(prefix="doc-", dir="/tmp"))
    proc = start(argv, log, tmp)
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    code = proc.poll()
    if code is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # anything of its own session still running
        os.killpg(proc.pid, signal.SIGKILL)
    left = stop_leftovers(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    if left:
        warnings.warn(f"{command} left processes running after it ended (killed): {left}", stacklevel=2)
    return code, log.read_text(errors="replace")


def test_the_docs_name_benchmarks_to_run_and_few_are_excused():
    commands = runnable()
    excused = [c for c in commands if excuse(c)]
    assert len(commands) >= 10, [str(c) for c in commands]
    assert len(excused) <= 2, [str(c) for c in excused]


@pytest.fixture(scope="module")
def brief_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BriefRun]:
    """Every documented command that is not excused, run briefly, ``AT_ONCE`` at a time, by its id.  One at a
    time they took ~100 s of the suite's ~20 minutes, most of it waiting on imports and on TorchServe's start and
    stop, which one core each covers.  A command that cannot be parsed or started fails its own test only."""

    def not_started(exc: BaseException) -> BriefRun:
        return "not started", f"{type(exc).__name__}: {exc}"

    results: dict[str, BriefRun] = {}
    planned: list[tuple[DocumentedCommand, Path, list[str]]] = []
    for command in (c for c in runnable() if not excuse(c)):  # parsed one at a time (``argv_for``)
        out_dir = tmp_path_factory.mktemp("doc")
        try:
            planned.append((command, out_dir, argv_for(command, out_dir)))
        except (Exception, SystemExit) as exc:
            results[str(command)] = not_started(exc)

    def one(plan: tuple[DocumentedCommand, Path, list[str]]) -> BriefRun:
        command, out_dir, argv = plan
        try:
            return run_briefly(command, out_dir, argv=argv)
        except Exception as exc:
            return not_started(exc)

    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        results |= dict(zip((str(c) for c, _, _ in planned), pool.map(one, planned), strict=True))
    return results


@pytest.mark.parametrize("command", runnable(), ids=str)
def test_a_documented_benchmark_gets_past_its_set_up(command: DocumentedCommand, brief_runs: dict[str, BriefRun]):
    reason = excuse(command)
    if reason:
        pytest.skip(f"excused: {reason}")
    code, output = brief_runs[str(command)]
    assert code in (None, 0), f"{command} exited {code}:\n{output[-3000:]}"


def test_running_them_leaves_argparse_as_it_was(brief_runs: dict[str, BriefRun]):
    """``parse`` patches ``argparse`` while it reads a command; a patch left behind (two threads patching at once
    did that, 2026-11-30) makes every later parser in the session raise, in tests far from this one."""
    assert brief_runs
    assert argparse.ArgumentParser.parse_args is ARGPARSE_PARSE_ARGS


def test_a_benchmark_that_crashes_at_start_is_caught(tmp_path: Path):
    planted = DocumentedCommand("planted", "python -m bench.packrat_e2e --model no-such-model --batches 2")
    code, output = run_briefly(planted, tmp_path)
    assert code not in (None, 0), output[-2000:]

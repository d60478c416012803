"""The ``packrat`` command line builds only the subcommand it is given, so ``status`` and ``stop`` start at once."""

from __future__ import annotations

import subprocess
import sys

from packrat_plugin.cli import BUILDERS, build_parser


def test_a_named_subcommand_parses_as_in_the_full_parser_and_the_full_one_lists_every_command():
    full = build_parser()
    choices = full._subparsers._group_actions[0].choices
    assert set(choices) == set(BUILDERS)
    for argv in (["stop", "--workdir", "w"], ["status", "--json"], ["optimize", "--profile", "p.json", "-T", "2",
                                                                   "-B", "4"]):  # fmt: skip
        assert vars(build_parser(argv[0]).parse_args(argv)) == vars(full.parse_args(argv))


def test_packrat_stop_imports_neither_torch_nor_the_controller(tmp_path):
    """``packrat stop`` on a workdir with no TorchServe: its one-line answer, from a process that never
    imported torch or the controller (they cost ~2.5 s before the command could run)."""
    probe = (
        "import sys; from packrat_plugin.cli import main; code = main(['stop', '--workdir', sys.argv[1]]); "
        "print(sorted(m for m in ('torch', 'packrat_plugin.controller', 'packrat_plugin.serve') if m in sys.modules));"
        "sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    said, imported = done.stdout.strip().splitlines()
    assert said == f"packrat stop: no TorchServe started from {tmp_path} is running"
    assert imported == "[]"


def test_packrat_serve_reaches_its_arguments_without_importing_torch():
    """The controller never runs a model: ``packrat serve`` on archives with profiles given imports no
    torch (~2.5 s, paid at every start and every restart onto a running TorchServe).  Archive building
    and profiling import it where they run."""
    probe = (
        "import sys; from packrat_plugin.cli import build_parser; "
        "build_parser('serve').parse_args(['serve', '--models', 'm=m.mar']); "
        "import packrat_plugin.serve, packrat_plugin.controller; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"

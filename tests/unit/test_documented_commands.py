"""Every project command in README.md and docs/ code blocks parses with the real parser of its entry point.

Parsing is where a command and its docs drift apart first (a flag renamed,
a choice dropped); ``tests/serving/test_documented_commands.py`` then runs
the benchmarks among them for a few seconds each.
"""

from __future__ import annotations

import argparse
import importlib
import re
from unittest import mock

import pytest

from tests.documented_commands import REPO, DocumentedCommand, documented_commands

COMMANDS = documented_commands()


class _Parsed(Exception):
    """Raised by the patched parser once the command line parsed: nothing past parsing runs."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse(command: DocumentedCommand) -> argparse.Namespace:
    """The namespace the command's own entry point builds from it; SystemExit where its parser refuses it."""
    argv = command.argv
    if argv[0] == "packrat":
        from packrat_plugin.cli import build_parser

        return build_parser().parse_args(argv[1:])
    module = importlib.import_module(argv[2])
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            module.main(argv[3:])
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{argv[2]}.main never parsed its arguments")


def test_the_docs_give_commands_for_every_kind_of_entry_point():
    kinds = {c.entry_point.split()[0] for c in COMMANDS}
    assert {"make", "packrat", "python"} <= kinds, kinds
    assert len(COMMANDS) >= 40, len(COMMANDS)  # README + docs held 45 when this test was written


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[0] != "make"], ids=str)
def test_a_documented_command_parses(command: DocumentedCommand):
    try:
        parse(command)
    except SystemExit as exc:
        pytest.fail(f"{command}: its parser refused it (exit {exc.code})")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.argv[0] == "make"], ids=str)
def test_a_documented_make_target_exists(command: DocumentedCommand):
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    assert command.argv[1] in targets, f"{command}: no such target in the Makefile ({sorted(targets)})"


def test_a_command_the_parser_refuses_is_caught():
    bad = DocumentedCommand("planted", "packrat serve --models resnet50=x.mar --no-such-flag")
    with pytest.raises(SystemExit):
        parse(bad)

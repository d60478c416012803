"""``bench.ebird_direct --base REV``: the handler served a second time by another commit's code, read side by side."""

from __future__ import annotations

import subprocess

import pytest

from bench.direct_systems import at_commit, decode_setting, label
from bench.ebird_direct import REPOSITORY, base_of, checkout, resolve_commit


def test_a_system_at_a_commit_is_named_read_and_labelled_as_that_commits_system() -> None:
    assert at_commit("ebird@1baf14b") == ("ebird", "1baf14b")
    assert at_commit("nowait") == ("nowait", None)
    assert label("ebird@1baf14b") == "Ebird at 1baf14b"
    assert label("dvabatch@abc1234") == "DVABatch at abc1234"
    assert decode_setting("ebird-decode2@abc1234") == 2


def test_the_column_of_a_change_pairs_a_system_with_itself_at_the_base_only() -> None:
    names = ["ebird", "ebird@abc1234", "nowait-twin", "nowait"]
    assert base_of("ebird", names) == "ebird@abc1234"
    assert base_of("ebird@abc1234", names) is None
    assert base_of("nowait", names) is None


def test_a_revision_resolves_to_its_short_hash_and_a_bad_one_is_refused() -> None:
    head = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert resolve_commit("HEAD") == head
    with pytest.raises(ValueError, match="names no commit"):
        resolve_commit("no-such-revision-anywhere")


def test_the_base_checkout_holds_that_commits_tree_and_is_gone_after_the_run(tmp_path) -> None:
    where = tmp_path / "base"
    with checkout(resolve_commit("HEAD"), where) as tree:
        assert (tree / "bench" / "direct_systems.py").is_file()
    assert not where.exists()
    listed = subprocess.run(
        ["git", "-C", str(REPOSITORY), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert str(where) not in listed
    with checkout(None, where) as nothing:
        assert nothing is None

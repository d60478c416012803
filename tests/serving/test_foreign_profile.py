"""``packrat profile`` on archives users build themselves with ``torch-model-archiver``.

The archives are made by the real archiver from a TorchScript model defined
in ``tests/user_archives.py``, with TorchServe's stock ``image_classifier`` handler or
a handler file of the test's own; each point runs that handler through
TorchServe's model loader in a pinned process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from packrat_plugin.cli import main
from packrat_plugin.foreign import ArchiveError, read_archive, read_samples
from packrat_plugin.profiler import cores_for
from serving_harness.topology import CpuTopology
from tests.user_archives import build_user_archives


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("foreign")
    build_user_archives(root)
    return root


def test_a_users_archive_is_read_as_foreign_and_bad_files_get_one_line(workdir: Path, tmp_path: Path):
    info = read_archive(workdir / "tiny.mar")
    assert (info.model_name, info.handler, info.serialized_file, info.config) == ("tiny", "image_classifier",
                                                                                  "tiny.pt", {})  # fmt: skip
    assert not info.ours
    (tmp_path / "junk.mar").write_bytes(b"not a zip")
    with pytest.raises(ArchiveError, match="not a zip file"):
        read_archive(tmp_path / "junk.mar")
    with pytest.raises(ValueError, match="--sample FILE"):
        read_samples([])
    with pytest.raises(ValueError, match="no such file"):
        read_samples([str(tmp_path / "missing.jpg")])


@pytest.mark.parametrize(
    "archive, sample",
    [("tiny.mar", "cat.jpg"), ("tinycustom.mar", "grid.json")],
    ids=["stock-image-classifier", "custom-handler-file"],
)
def test_packrat_profile_times_the_archives_own_handler_pinned(workdir: Path, tmp_path: Path, archive, sample):
    out = tmp_path / "profile.json"
    argv = ["profile", str(workdir / archive), "--sample", str(workdir / sample), "--threads", "1",
            "--batches", "1,2", "--iters", "2", "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    profile = json.loads(out.read_text())
    assert profile["model"] == archive.removesuffix(".mar") and profile["complete"] is True
    assert profile["source"]["samples"] == [sample] and profile["handler_included"] is True
    expected = list(cores_for(1, CpuTopology.from_system()))
    assert [(p["threads"], p["batch"]) for p in profile["points"]] == [(1, 1), (1, 2)]
    for point in profile["points"]:
        assert point["cores"] == expected and point["threads_seen"] == 1 and point["latency_ms"] > 0


def test_profiling_a_users_archive_says_what_is_missing_or_wrong(workdir: Path, tmp_path: Path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", str(workdir / "tiny.mar"), "--threads", "1", "--out", str(out)]) == 2
    assert "pass --sample FILE" in capsys.readouterr().err
    # A text body to an image handler: the handler's own failure, in one line, and no profile.
    (tmp_path / "words.txt").write_text("not an image")
    argv = ["profile", str(workdir / "tiny.mar"), "--sample", str(tmp_path / "words.txt"), "--threads", "1",
            "--batches", "1", "--iters", "1", "--warmup", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("packrat profile: error")]
    assert len(errors) == 1 and "failed on the samples" in errors[0] and "UnidentifiedImageError" in errors[0]
    assert not out.exists()

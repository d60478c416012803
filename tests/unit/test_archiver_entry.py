"""The entry module an archive names, and archives built before a handler moved."""

from __future__ import annotations

import zipfile

from archiver.build import is_current
from archiver.entry import entry_module_text
from archiver.options import ServingOptions
from handlers.plain_handler import PlainModelHandler


def test_the_entry_module_defines_one_class_that_is_the_registered_handler():
    # TorchServe loads the one class a handler module defines (its __module__ is the module's own).
    namespace: dict = {"__name__": "plain_handler"}
    exec(compile(entry_module_text(PlainModelHandler), "plain_handler.py", "exec"), namespace)
    defined = [v for v in namespace.values() if isinstance(v, type) and v.__module__ == "plain_handler"]
    assert len(defined) == 1 and issubclass(defined[0], PlainModelHandler)


def test_an_archive_whose_entry_names_a_module_that_moved_is_not_reused(tmp_path, capsys):
    options = ServingOptions()
    stale = tmp_path / "old.mar"
    with zipfile.ZipFile(stale, "w") as mar:
        mar.writestr("plain_handler.py", "from handlers.cpu_handler import CPUModelHandler\n")
    current = tmp_path / "new.mar"
    with zipfile.ZipFile(current, "w") as mar:
        mar.writestr("plain_handler.py", entry_module_text(PlainModelHandler))
    assert not is_current(tmp_path / "missing.mar", options)
    assert is_current(current, options)
    assert not is_current(stale, options)
    assert "old.mar was built by an earlier version" in capsys.readouterr().err

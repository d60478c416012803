"""The one-class entry module an archive names as its handler.

TorchServe loads a handler module and uses the one class it defines, so an
archive cannot name a class inside an installed package directly.  The
archiver writes, into each archive, a module that subclasses the registered
handler class and nothing else; the handler itself stays in the installed
``handlers`` package, where it is tested and versioned.
"""

from __future__ import annotations

from pathlib import Path


def entry_module_text(handler: type) -> str:
    """The source of an entry module whose one class is ``handler``, unchanged."""
    name = handler.__name__
    return (
        f'"""Archive entry module written by the archiver: TorchServe loads the one class defined here."""\n\n'
        f"from {handler.__module__} import {name}\n\n\n"
        f"class Archived{name}({name}):\n"
        f'    """{name} ({handler.__module__}), as TorchServe loads it from this archive."""\n'
    )


def write_entry_module(handler: type, directory: Path, file_name: str) -> Path:
    """Write the entry module for ``handler`` as ``directory/file_name``; returns its path."""
    path = directory / file_name
    path.write_text(entry_module_text(handler))
    return path

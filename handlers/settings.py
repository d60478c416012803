"""What every handler's settings section shares: refusing names it does not know."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def known_settings(cls: type, raw: dict[str, Any] | None, section: str, error: type[Exception]) -> dict[str, Any]:
    """A copy of ``raw`` (None: empty), or ``error`` naming the settings the dataclass ``cls`` lacks.

    A misspelt setting must not silently fall back to its default: the user
    would measure a configuration they did not ask for.
    """
    raw = dict(raw or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise error(f"unknown {section} settings {unknown}; known: {sorted(known)}")
    return raw

"""Archive entry point for the Nimble handler (see handlers/entry/packrat_handler.py for why a file of its own)."""

from handlers.nimble.handler import NimbleHandler


class NimbleArchiveHandler(NimbleHandler):
    """Nimble, as TorchServe loads it from an archive."""

"""Archive entry point for the REEF handler (see handlers/entry/packrat_handler.py for why a file of its own)."""

from handlers.reef.handler import ReefHandler


class ReefArchiveHandler(ReefHandler):
    """REEF, as TorchServe loads it from an archive."""

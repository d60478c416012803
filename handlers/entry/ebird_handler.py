"""Archive entry point for the Ebird handler (see handlers/entry/packrat_handler.py for why a file of its own)."""

from handlers.ebird.handler import EbirdHandler


class EbirdArchiveHandler(EbirdHandler):
    """Ebird, as TorchServe loads it from an archive."""

"""Archive entry point for the Orca handler (see handlers/entry/packrat_handler.py for why a file of its own)."""

from handlers.orca.handler import OrcaHandler


class OrcaArchiveHandler(OrcaHandler):
    """Orca, as TorchServe loads it from an archive."""

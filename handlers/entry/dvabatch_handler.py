"""Archive entry point for the DVABatch handler (see handlers/entry/packrat_handler.py for why a file of its own)."""

from handlers.dvabatch.handler import DvaBatchHandler


class DvaBatchArchiveHandler(DvaBatchHandler):
    """DVABatch, as TorchServe loads it from an archive."""

"""Archive entry point for Packrat's mixed-plan handler (see handlers/entry/packrat_handler.py for why a file)."""

from handlers.plan_handler import PackratPlanHandler


class PackratPlanArchiveHandler(PackratPlanHandler):
    """Packrat's plan handler, as TorchServe loads it from an archive copy the swapper writes."""

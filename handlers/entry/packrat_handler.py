"""Archive entry point for the project's CPU handler.

torch-model-archiver copies this file into every archive the model store
builds.  TorchServe requires a handler module to define exactly one class,
so the class lives in the installed ``handlers`` package and this file only
names it.
"""

from handlers.cpu_handler import CPUModelHandler


class PackratHandler(CPUModelHandler):
    """The catalog model handler, as TorchServe loads it from an archive."""

"""Archive entry point that runs a user's own handler inside a Packrat slot (handlers/wrapped.py).

The swapper adds this file to its copy of an archive the user built with
torch-model-archiver and names it as the copy's handler; TorchServe needs one
class in the module, which only names the installed one.
"""

from handlers.wrapped import PackratWrappedHandler


class PackratWrappedArchiveHandler(PackratWrappedHandler):
    """A user's handler under Packrat, as TorchServe loads it from the swapper's archive copy."""

"""Archive entry point for WindTunnel's scikit-learn pipeline handler (see the packrat handler's entry)."""

from handlers.windtunnel_handler import WindTunnelModelHandler


class WindTunnelHandler(WindTunnelModelHandler):
    """A translated scikit-learn pipeline, as TorchServe loads it from an archive."""

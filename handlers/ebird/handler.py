"""The Ebird handler: the async runtime plus Ebird's engine, configured from the archive."""

from __future__ import annotations

from typing import Any

from handlers.codecs import ModelInput
from handlers.ebird.config import EbirdConfig
from handlers.ebird.engine import EbirdEngine
from handlers.runtime.async_handler import AsyncModelHandler


class EbirdHandler(AsyncModelHandler):
    def __init__(self) -> None:
        super().__init__()
        self.config = EbirdConfig()

    def configure(self, handler_config: dict[str, Any]) -> None:
        self.config = EbirdConfig.from_dict(handler_config.get("ebird"))

    def cpu_lane_count(self) -> int:
        return self.config.cpu_lanes

    def create_engine(self, layout_example: ModelInput) -> EbirdEngine:
        return EbirdEngine(
            self.model, layout_example, self.device, self.config, self.metrics, self.lanes, self.arrivals
        )

"""WindTunnel: scikit-learn pipelines as tensor programs, served and fine-tuned end to end.

``translate`` turns a fitted pipeline into one ``nn.Module`` whose hard
mode gives the pipeline's own predictions; its trees switch to soft splits
for fine-tuning the whole network with backpropagation (the WindTunnel
chapter of the seed dissertation, an extension of Hummingbird).
"""

from windtunnel.translate import RowError, TranslatedPipeline, UntranslatableError, translate

__all__ = ["RowError", "TranslatedPipeline", "UntranslatableError", "translate"]

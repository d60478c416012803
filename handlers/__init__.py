"""TorchServe handlers of this project.

``plain_handler`` serves one catalog model with TorchServe's own batching;
one folder per scheduling system (``ebird/``, ``dvabatch/``, ``reef/``,
``nimble/``, ``orca/``, ``mixed_plan/`` for Packrat's mixed plans) holds
everything only that system uses; ``runtime/`` holds what two or more share;
``pinning/`` is the worker side of Packrat (claim a slot, pin, set threads);
``registry.py`` names each system's handler for the archiver; ``codecs``
turns request payloads into tensors with clear 4xx errors.
"""

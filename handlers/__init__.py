"""TorchServe handlers of this project.

``cpu_handler`` is the base handler for the catalog's vision and text models;
``codecs`` turns request payloads into tensors with clear 4xx errors;
``entry/`` holds the one-class files that torch-model-archiver puts into
archives (TorchServe loads a handler module that defines exactly one class).
"""

"""The archiver: models into TorchServe archives (.mar), each with an entry module naming its registered handler.

It sits above the handlers (it reads ``handlers/registry.py``) and below Packrat's controller side.
"""

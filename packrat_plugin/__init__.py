"""Packrat: CPU auto-reconfiguration for TorchServe.

Profiles a model at (threads, batch) points, chooses how many worker
instances, threads each and batch each minimise latency for the current load,
and reshapes TorchServe's workers to match.
"""

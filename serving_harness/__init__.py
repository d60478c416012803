"""The serving harness: what any part of the project uses to run and measure TorchServe.

The isolated TorchServe process, its three API clients, the open-loop load
generator, the machine's usable cores and fingerprint, atomic JSON files.
It is the bottom floor: it imports nothing of this project
(docs/architecture.md).
"""

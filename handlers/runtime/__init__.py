"""Shared runtime for handlers that schedule requests themselves.

TorchServe's async worker mode hands each request to the handler on its own
and sends each answer as soon as it exists.  This layer does what every such
handler needs: decode and validate on arrival (4xx per request), admit the
input into an engine with backpressure, await a per-request future, turn
errors into per-request statuses, report metrics, and pick a device.  A
paper's policy and mechanism live in its own package (``handlers/ebird``…).
"""

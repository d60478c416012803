"""Shared runtime for handlers that schedule requests themselves.

TorchServe's async worker mode hands each request to the handler on its own
and sends each answer as soon as it exists.  This layer does what every such
handler needs: decode and validate on arrival (4xx per request), admit the
input into an engine with backpressure, await a per-request future, turn
errors into per-request statuses, report metrics, and pick a device.  It
also holds the mechanisms more than one paper needs: a model cut into
segments (``segments.py``: DVABatch's stages, REEF's preemption units), the
preemption gate (``preemption.py``), and Nimble's stream assignment
(``stream_assignment.py``), its execution on CUDA streams or CPU threads
(``multistream.py``) and CUDA graphs per batch-size bucket
(``cuda_graphs.py``).  A paper's policy lives in its own package
(``handlers/ebird``…).
"""

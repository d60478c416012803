"""Ebird (input memory pool + elastic multi-granularity batching).

``scheduler`` holds the paper's scheduling rule as a pure policy; ``pool``
the ring buffer inputs are copied into on arrival.  The TorchServe handler
that runs them (async worker mode, engine threads / CUDA streams) is built
on top of these; see issue 4.
"""

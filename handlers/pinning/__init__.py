"""Worker side of Packrat: the plan and slot files a handler reads to claim its cores and pin itself.

It imports no controller code, so any handler can pin itself without depending on Packrat.
"""

"""REEF (OSDI'22): real-time requests preempt best-effort batches at segment boundaries; several models, one worker."""

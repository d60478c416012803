"""DVABatch (USENIX ATC'22): multi-entry multi-exit batching over a model's stages."""

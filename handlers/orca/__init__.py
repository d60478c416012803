"""Orca (OSDI'22): iteration-level scheduling and selective batching for generative transformers."""

"""Nimble (NeurIPS'20): ahead-of-time scheduled execution and automatic multi-stream assignment."""

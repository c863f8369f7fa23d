"""One-off studies with their own command line, beside the benchmark: the fused LM head's chunk
size and its projection to GPU shapes (`python -m bench.studies.lm_head_chunks`), and the SFC
staleness demonstration (`python -m bench.studies.sfc_staleness`)."""

"""One-off studies with their own command line, beside the benchmark: the fused LM head's chunk
size and its projection to GPU shapes (`python -m bench.studies.lm_head_chunks`), the SFC
staleness demonstration on a bandit (`python -m bench.studies.sfc_staleness`), and the same
comparison through slime's own training loop, SGLang's server and megatron-core on CPU
(`python -m bench.studies.stale_rollouts`)."""

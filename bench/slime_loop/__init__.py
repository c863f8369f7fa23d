"""slime's training loop on CPU and what it stands on, shared by the stale-rollouts study
(bench/studies/stale_rollouts.py) and the tests (tests/test_slime/, tests/test_sglang/, which import
it through tests/bench_package.py's `import_bench()`):

- `loop`: slime's own train.py, end to end in one process, with the experiment's lag hook; one run
  per fresh process (`python -m bench.slime_loop.loop`, `run_in_subprocess`).
- `fork_server`: runs in one environment forked from one process that imported slime's stack once.
- `target_task`: the contextual target-token task (its model, prompts and reward).
- `sglang_server`: SGLang's real HTTP server on CPU (a test setup, not a way to serve models).
- `upstream_slime`: slime's source from FUSEDRL_SLIME_SRC, importable, and its argument parsing.
- `stand_ins`: every test-only stand-in (for Ray, the GPU, Megatron-LM's training package, ...),
  each saying what real part it replaces.

The package (kernels/, slime_ext/, sglang_plugin/) imports none of these (tests/test_import_graph.py).
"""

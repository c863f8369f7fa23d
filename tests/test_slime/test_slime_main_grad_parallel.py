"""The one-pass LM head under pipeline, virtual-pipeline and tensor x context parallelism, through
megatron-core's real schedules on gloo (tests/test_slime/megatron_step.py runs the step; slime's real
`loss_function` and model provider, FUSEDRL_SLIME_SRC).

- Pipeline parallelism 2 with tied embeddings: a two-layer megatron-core GPTModel split over two
  stages, the last stage's output weight a copy of the first stage's embedding (`shared_embedding`),
  through `forward_backward_pipelining_without_interleaving` (1F1B) and `finalize_model_grads`, which
  all-reduces the two `main_grad`s over the embedding group.
- Two virtual stages per pipeline rank through `forward_backward_pipelining_with_interleaving`: each
  chunk has its own config, the loss scale (4) is set on `model[0]`'s only, as slime sets it, and the
  output layer sits on the last chunk: the scale must come from the schedule's config.
- tp = 2 x cp = 2 with megatron-core's DDP over the data-parallel-with-context group: the vocabulary
  split over tp, the sequence zigzag over cp.
Every parameter's `main_grad` on every rank and the hidden-state gradients equal the unfused path's
within 1e-5 (fp32); the output weight's gradient went into `main_grad` in the forward, or on the
recompute path (GSPO: virtual pipeline stages with tied embeddings, tp x cp) in the backward.
"""

import pytest
from bench_package import import_bench
from distributed import get_pool
from megatron_step import CP_STEPS, PIPELINE_STEPS, Setup, assert_fused_matches_unfused, step_results

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

CASES = {  # name: (tp, cp, pp, vp, setup)
    "pp2-tied-1f1b": (1, 1, 2, None, Setup(model="gpt", tied=True, steps=PIPELINE_STEPS)),
    "pp2-vp2-tied-interleaved": (1, 1, 2, 2, Setup(model="gpt", tied=True, steps=PIPELINE_STEPS)),
    "pp2-vp2-untied-interleaved-token_mean": (1, 1, 2, 2, Setup(model="gpt", aggregation="token_mean", steps=PIPELINE_STEPS)),
    "tp2-cp2": (2, 2, 1, None, Setup(overlap=True, distributed_optimizer=True, steps=CP_STEPS)),
    # GSPO's sequence-level ratio: the recompute path, its weight gradient into main_grad in the backward
    "pp2-vp2-tied-interleaved-recompute_path": (1, 1, 2, 2, Setup(model="gpt", tied=True, steps=PIPELINE_STEPS,
                                                                  estimator="gspo")),  # fmt: skip
    "tp2-cp2-recompute_path": (2, 2, 1, None, Setup(overlap=True, distributed_optimizer=True, steps=CP_STEPS,
                                                    estimator="gspo")),  # fmt: skip
}


@pytest.mark.parametrize("name", list(CASES))
def test_main_grad_equals_the_unfused_path(name):
    tp, cp, pp, vp, setup = CASES[name]
    rank_results = get_pool(tp, cp, pp=pp, vp=vp).run(step_results, setup)
    assert_fused_matches_unfused(rank_results, 1e-5)
    last_stage = [results for results in rank_results if results[True]["weight dtype"] is not None]
    assert len(last_stage) == tp * cp
    one_pass = setup.estimator != "gspo"
    for results in last_stage:
        assert not bool(results[False]["after first loss"].any())
        assert bool(results[True]["after first loss"].any()) == one_pass  # the recompute path adds in the backward
        assert results[True]["grad_added_to_main_grad"] is True
        assert all(bool(grad.any()) for grad in results[True]["hidden_grads"])  # every rank holds response rows
        if pp == 1 and one_pass:  # a pipeline's first stage would wait forever for the last stage that raised
            assert "grad_scale" in results[True]["scale error"]

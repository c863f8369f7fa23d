"""The one-pass LM head's weight gradient straight into megatron-core's `main_grad`
(`slime_ext/main_grad.py`), at dp = 2 on gloo, through megatron-core's real schedule
(`forward_backward_no_pipelining`), DistributedDataParallel and `finalize_model_grads`, with slime's
real `loss_function` (FUSEDRL_SLIME_SRC; tests/test_slime/megatron_step.py runs the step).

Every parameter's `main_grad` after the step and the gradient of the hidden states entering the
output layer equal the unfused output layer's (its weight gradient through autograd and DDP's hook):
megatron-core's DDP with overlap_grad_reduce on and off, tied (GPTModel's way, `zero_out_wgrad`) and
untied, the sample-mean and per-token (--calculate-per-token-loss) scalings, a one-layer GPTModel
built by slime's real model provider through `install`; the distributed optimizer (reduce-scatter,
overlap on and off, tied and untied); bf16 parameters with an fp32 and with a bf16 grad buffer
(--grad-reduce-in-bf16: the op's buffer, `.grad` through DDP's hook); fp16 with a loss scale of 2^16 and
per-token weights of 1 / 4000, with an fp32 `main_grad` (--accumulate-allreduce-grads-in-fp32) and
without (slime's default: the fp16 grad buffer, the op's buffer at the provisional scale); dynamic
batch size (micro-batches packed by slime's own `build_dp_schedule`, two steps of different sizes).
The output weight's gradient went into `main_grad` during the forward where an fp32 `main_grad` is
there (its `.grad` only carried megatron's dummy), except under --recompute-loss-function (slime's
checkpoint runs the loss twice: the per-call buffer); on the recompute path (GSPO's sequence-level
ratio needs the whole micro-batch first; bf16, and fp16 at a loss scale of 2^16) it goes there in the
backward, that flag or not; a loss the schedule scales by other than slime's
chain raises naming both on the main_grad path; forward-only passes leave every `main_grad` untouched.
Pipeline and virtual-pipeline stages, and tp x cp: tests/test_slime/test_slime_main_grad_parallel.py.
"""

import pytest
import torch
from bench_package import import_bench
from distributed import get_pool
from megatron_step import Setup, assert_fused_matches_unfused, step_results

from fusedrl.slime_ext import main_grad

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

FP16 = dict(dtype="fp16", loss_scale=2.0**16, aggregation="constant", divisor=4000.0, regularised=False)
CASES = {
    **{
        f"{'overlap' if overlap else 'no_overlap'}-{'tied' if tied else 'untied'}-{aggregation}": Setup(
            overlap=overlap, tied=tied, aggregation=aggregation
        )
        for overlap in (False, True)
        for tied in (False, True)
        for aggregation in ("sample_mean", "token_mean")
    },
    "gpt-overlap-tied": Setup(model="gpt", overlap=True, tied=True),
    "gpt-no_overlap-untied": Setup(model="gpt"),
    "recompute_loss_function": Setup(overlap=True, recompute=True),
    "recompute_path-overlap-tied": Setup(estimator="gspo", overlap=True, tied=True),
    "recompute_path-distributed_optimizer-recompute_loss_function": Setup(
        estimator="gspo", distributed_optimizer=True, overlap=True, recompute=True
    ),
    "recompute_path-bf16-fp32_main_grad": Setup(estimator="gspo", dtype="bf16", overlap=True),
    "recompute_path-fp16-fp32_main_grad": Setup(estimator="gspo", **FP16),
    # M2PO's trust region needs the whole micro-batch first too: the recompute path, in bf16 and fp16
    "m2po-bf16-fp32_main_grad": Setup(m2po_tau=2.0, dtype="bf16", overlap=True),
    "m2po-fp16-fp32_main_grad": Setup(m2po_tau=2.0, **FP16),
    **{
        f"distributed_optimizer-{'overlap' if overlap else 'no_overlap'}-{'tied' if tied else 'untied'}": Setup(
            distributed_optimizer=True, overlap=overlap, tied=tied
        )
        for overlap in (False, True)
        for tied in (False, True)
    },
    "bf16-fp32_main_grad": Setup(dtype="bf16", overlap=True, distributed_optimizer=True),
    "bf16-bf16_main_grad": Setup(dtype="bf16", main_grad_fp32=False, overlap=True, distributed_optimizer=True),
    "fp16-fp32_main_grad": Setup(**FP16),
    "fp16-fp16_main_grad": Setup(**FP16, main_grad_fp32=False, tied=True),
    "dynamic_batch_size": Setup(dynamic=True, overlap=True, distributed_optimizer=True, aggregation="token_mean"),
}
# fp32 throughout: the unfused path's own rounding; bf16 / fp16 grad buffers: one rounding of a sum of
# micro-batches apart. Errors are relative to the largest entry (element-wise) and to the norm.
TOLERANCES = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}


@pytest.mark.parametrize("name", list(CASES))
def test_main_grad_equals_the_unfused_path(name):
    setup = CASES[name]
    rank_results = get_pool(1, 1, dp=2).run(step_results, setup)
    assert_fused_matches_unfused(rank_results, TOLERANCES[setup.dtype])
    recompute_path = setup.estimator == "gspo" or setup.m2po_tau is not None
    in_forward = setup.main_grad_fp32 and not setup.recompute and not recompute_path
    param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[setup.dtype]
    for results in rank_results:
        unfused, fused = results[False], results[True]
        assert fused["weight dtype"] == (param_dtype, torch.float32 if setup.main_grad_fp32 else param_dtype)
        assert not bool(unfused["after first loss"].any())
        # the one-pass forward added the weight gradient into an fp32 main_grad, else the op's buffer
        assert bool(fused["after first loss"].any()) == in_forward
        # the recompute path's backward adds it there, --recompute-loss-function or not
        assert fused["grad_added_to_main_grad"] == (setup.main_grad_fp32 and (recompute_path or not setup.recompute))
        if in_forward:
            assert "grad_scale" in fused["scale error"] and "incoming gradient" in fused["scale error"]
        else:
            assert fused["scale error"] is None  # a provisional scale: the backward rescales by what arrives


def test_a_gradient_into_main_grad_then_into_grad_in_one_step_raises():
    """Micro-batch 1 inside slime's wrapped loss_function (main_grad), the next ones outside it (the
    op's buffer, a .grad): megatron's DDP hook would drop that .grad, so the step raises instead."""
    with pytest.raises(RuntimeError, match="grad_added_to_main_grad is set"):
        get_pool(1, 1, dp=2).run(step_results, Setup(unwrapped_from=1))


def test_the_placeholder_gradient_is_one_buffer_zeroed_for_tied_weights():
    weight = torch.nn.Parameter(torch.randn(6, 4))
    first = main_grad.placeholder_gradient(weight)
    first.fill_(3.0)  # autograd may accumulate the lookup's gradient into it in place
    weight.zero_out_wgrad = True
    again = main_grad.placeholder_gradient(weight)
    assert again.data_ptr() == first.data_ptr() and not bool(again.any())

"""The rivals run on the LM-head workload (`bench/workloads/linear_token_stats.py`): hidden states
[T, H] and weight [V, H] in, the sampled token's log-prob [T, 1] and the entropy [T] (or None)
out, differentiable in both inputs like the package's own paths. Each takes one id per row, so
J = 1 + K is theirs to refuse (`Subject.refuses`).

- verl's `linear_cross_entropy`: log-probs and entropy in Triton (the entropy always computed),
  the logits recomputed in the backward; temperature fused.
- `verl_main_grad`: verl's, its weight gradient then added into the workload's fp32 main_grad the
  way megatron-core's data-parallel hook does for a layer that returns its own gradient
  (`main_grad.add_(grad)`): the bytes and memory verl costs a megatron trainer, beside the package's
  own path into main_grad.
- Liger's fused linear cross entropy with `reduction="none"`: per-token cross entropy (the
  log-prob's negative), its gradient made in the backward by recomputing the chunked logits; no
  entropy, no temperature.
- Liger's fused linear scaled cross entropy (`LigerFusedLinearScaledCrossEntropyFunction`):
  per-token NLL and entropy at a temperature; on sm_90 a CuTe DSL kernel, elsewhere (CPU
  included) its 512-row chunked torch path.

`LigerFusedLinearGRPOLoss` is not one of them: it returns a GRPO loss of its own (advantages,
clipping, KL) and its gradient, not the per-token log-prob and entropy the workload's upstream
gradients apply to.
"""

import gc


def _sampled_ids(workload):
    return workload.ids[:, 0].contiguous()


def _free_interpreter_cycles(layer):
    if layer.device.type == "cpu":
        gc.collect()  # as in workloads.linear_token_stats.run_fused: the interpreter's reference cycles


def one_id_per_row(case):
    """Why a rival cannot run `case` (J > 1), or None."""
    return None if case.ids_per_row == 1 else "takes one id per row (J = 1 + K needs K more)"


def verl_refusal(case):
    """Why verl's kernel cannot run `case`, or None."""
    if case.ids_per_row != 1:
        return one_id_per_row(case)
    if case.hidden % 128:
        return f"asserts hidden % 128 == 0 (hidden {case.hidden})"
    return None


def verl_run(linear_cross_entropy):
    """run(layer, workload) with verl's `linear_cross_entropy` (`verl_import`)."""

    def run(layer, workload):
        case = workload.case
        logp, entropy = linear_cross_entropy(*layer, _sampled_ids(workload), float(case.temperature), "none")
        _free_interpreter_cycles(layer)
        return logp.unsqueeze(1), entropy if case.entropy else None

    return run


def verl_main_grad_run(linear_cross_entropy):
    """run(layer, workload) with verl's kernel, its weight gradient added into the workload's main_grad
    as megatron-core's DistributedDataParallel hook adds a `.grad`."""
    from fusedrl.kernels.linear_token_stats import grad_into_main_grad

    run = verl_run(linear_cross_entropy)

    def run_into_main_grad(layer, workload):
        hidden, weight = layer
        return run(type(layer)(hidden, grad_into_main_grad(weight, workload.main_grad)), workload)

    return run_into_main_grad


def run_liger_linear_cross_entropy(layer, workload):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(*layer, _sampled_ids(workload), reduction="none")
    _free_interpreter_cycles(layer)
    return -loss.float().unsqueeze(1), None


def run_liger_scaled_cross_entropy(layer, workload):
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    case = workload.case
    outputs = LigerFusedLinearScaledCrossEntropyFunction.apply(
        *layer, _sampled_ids(workload), float(case.temperature), -100, 1, case.entropy
    )
    nll, entropy = outputs if case.entropy else (outputs, None)
    _free_interpreter_cycles(layer)
    return -nll.float().unsqueeze(1), entropy

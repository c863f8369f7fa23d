"""Layers, gradients and the float64 truth shared by the fused-LM-head tests (tp = 1 and tp > 1);
for the one-pass path, a separable loss and its paths (one pass, recompute, unfused, truth)."""

import torch
import torch.distributed as dist
from device import to_cpu, to_device
from token_stats_cases import loss_of, upstream_grads

from fusedrl.kernels import TokenStats, linear_token_loss, linear_token_stats, token_stats, token_stats_reference


EXACT_STEP = 2.0**-4  # exact layers: every entry a multiple of this


def random_layer(num_rows, width, vocab, dtype, generator, logit_scale=3.0, exact=False):
    """hidden [T, H] and weight [V, H] whose product has entries of about `logit_scale`.

    exact: every entry a multiple of 2^-4, so products are multiples of 2^-8 and every partial sum
    of the product (under 2^15) is exact in fp32: the logits GEMM gives the float64 product in any
    summation order, on any machine, also as a bf16 GEMM accumulating in fp32 (then rounded once).
    For verdicts between paths that differ only in how a GEMM library blocks its sums."""
    hidden = torch.randn(num_rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) * (logit_scale / width**0.5)
    if exact:
        hidden, weight = (torch.round(t / EXACT_STEP) * EXACT_STEP for t in (hidden, weight))
        check_exact(hidden, weight, dtype)
    return hidden.to(dtype), weight.to(dtype)


def check_exact(hidden, weight, dtype):
    """hidden @ weight.T sums exactly in fp32 and both are exact in `dtype` (a test's own inputs)."""
    for tensor in (hidden, weight):
        if not torch.equal(tensor.to(dtype).double(), tensor.double()):
            raise ValueError(f"an exact layer's entries must be exact in {dtype}: lower the logit scale")
    if not (hidden.double().abs() @ weight.double().abs().t()).max() < 2.0**15:
        raise ValueError("an exact layer's partial sums must stay under 2^15: lower the logit scale")


def head_with_grad(fn, hidden, weight, ids, grads=None, device=None, **kwargs):
    """Outputs, upstream gradients and (d hidden, d weight) of fn(hidden, weight, ids, **kwargs).

    device: where fn runs (the `device` fixture, for the LM head under test): hidden, weight, ids
    and the tensors among kwargs are moved there. None: fn runs on the tensors as given (the
    float64 truth, on CPU). Outputs and gradients come back on CPU."""
    if device is not None:
        hidden, weight, ids, kwargs = to_device((hidden, weight, ids, kwargs), device)
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    stats = fn(hidden, weight, ids, **kwargs)
    grads = grads or upstream_grads(stats, torch.Generator().manual_seed(7))
    grad_hidden, grad_weight = torch.autograd.grad(loss_of(stats, grads), [hidden, weight])
    return to_cpu(stats), grads, (grad_hidden.cpu(), grad_weight.cpu())


def truth_head(hidden, weight, ids, **kwargs):
    """The float64 truth: the full logits in float64, then the eager reference."""
    kwargs.pop("chunk_rows", None)
    return token_stats_reference(hidden.double() @ weight.double().t(), ids, **kwargs)


class SeparableLoss:
    """A per-token RL loss of the kind the one-pass path serves, its per-row inputs fixed before the
    forward and sliced by `slots`: PPO's clipped ratio on slot 0 (old log-probs near the truth, so
    some ratios clip), a squared log-ratio on every slot, score and entropy terms, a loss mask.
    Nonlinear in the statistics, so its coefficients come from autograd on the chunk's tensors."""

    def __init__(self, truth_logp, generator, clip=0.2):
        num_rows, num_ids = truth_logp.shape
        self.old_logp = (truth_logp.detach().float() + 0.3 * torch.randn(num_rows, num_ids, generator=generator))
        self.advantages = torch.randn(num_rows, generator=generator)
        self.mask = (torch.rand(num_rows, generator=generator) > 0.2).float()
        self.score_weights = torch.randn(num_rows, num_ids, generator=generator)
        self.entropy_weights = torch.randn(num_rows, generator=generator)
        self.clip = clip

    def to(self, device):
        moved = object.__new__(SeparableLoss)
        moved.__dict__ = to_device(dict(self.__dict__), device)
        return moved

    def __call__(self, stats, slots):
        logp, old, mask = stats.logp, self.old_logp[slots], self.mask[slots]
        ratio = torch.exp(logp[:, 0] - old[:, 0])
        advantages = self.advantages[slots]
        clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
        policy = -torch.minimum(ratio * advantages, clipped * advantages)
        loss = (policy * mask).sum() + 0.5 * ((logp - old) ** 2 * mask[:, None]).sum()
        loss = loss + (stats.scores * self.score_weights[slots]).sum()
        if stats.entropy is not None:
            loss = loss + (stats.entropy * self.entropy_weights[slots]).sum()
        return loss


def one_pass_head(hidden, weight, ids, row_loss, **kwargs):
    """(loss, stats) of the one-pass path."""
    return tuple(linear_token_loss(hidden, weight, ids, row_loss, **kwargs))


def recompute_head(hidden, weight, ids, row_loss, **kwargs):
    """(loss, stats) of the recompute path: linear_token_stats, then the loss over all rows."""
    stats = linear_token_stats(hidden, weight, ids, **kwargs)
    return row_loss(stats, slice(0, ids.shape[0])), stats


def unfused_loss_head(hidden, weight, ids, row_loss, **kwargs):
    """(loss, stats) of the unfused path: the logits in the layer's dtype, then token_stats."""
    kwargs.pop("chunk_rows", None)
    stats = token_stats(hidden @ weight.t(), ids, **kwargs)
    return row_loss(stats, slice(0, ids.shape[0])), stats


def truth_loss_head(hidden, weight, ids, row_loss, **kwargs):
    """(loss, stats) of the float64 truth: the full logits in float64, the eager reference, the loss."""
    stats = truth_head(hidden, weight, ids, **kwargs)
    return row_loss(stats, slice(0, ids.shape[0])), stats


def loss_with_grad(fn, hidden, weight, ids, row_loss, device=None, **kwargs):
    """(loss, stats, (d hidden, d weight)) of fn, a path above, as `head_with_grad` does for the
    statistics: fn runs on `device` (None: on the tensors as given); results come back on CPU."""
    if device is not None:
        hidden, weight, ids, kwargs = to_device((hidden, weight, ids, kwargs), device)
        row_loss = row_loss.to(device)
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    loss, stats = fn(hidden, weight, ids, row_loss, **kwargs)
    grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
    stats = TokenStats(*(None if t is None else t.detach() for t in stats))
    return loss.detach().cpu(), to_cpu(stats), (grad_hidden.cpu(), grad_weight.cpu())


def rank_layer(rank, world_size, hidden, weight, through_megatron):
    """On a tensor-parallel rank: (hidden as a leaf, the layer's input, this rank's weight shard as a
    leaf, the group to pass). Through megatron: megatron-core's parallel state over the world, the
    input through `copy_to_tensor_model_parallel_region` (what ColumnParallelLinear does: identity
    forward, all-reduce of d hidden backward) and group None (the op finds megatron's)."""
    width = weight.shape[0] // world_size
    shard = weight[rank * width : (rank + 1) * width].clone().requires_grad_(True)
    leaf = hidden.clone().requires_grad_(True)
    if not through_megatron:
        return leaf, leaf, shard, dist.group.WORLD
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    return leaf, copy_to_tensor_model_parallel_region(leaf), shard, None

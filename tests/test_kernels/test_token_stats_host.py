"""The host functions compose into `token_stats`: what a fused LM head builds on.

row_partials -> all_rank_partials -> combine_partials gives the forward; logits_grad gives the
backward into any buffer (zeros for unselected rows).
"""

import torch
from device import to_device

from fusedrl.kernels import token_stats
from fusedrl.kernels._tp import resolve_tp
from fusedrl.kernels.token_stats import all_rank_partials, combine_partials, logits_grad, row_partials


def test_host_functions_compose_to_token_stats(device):
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(10, 999, generator=gen) * 3
    rows = torch.tensor([7, 0, 3, 8])
    ids = torch.randint(0, 999, (4, 3), generator=gen)
    tau = 0.8
    logits, ids, rows = to_device((logits, ids, rows), device)
    logits_leaf = logits.clone().requires_grad_(True)
    stats = token_stats(logits_leaf, ids, rows=rows, temperature=tau, with_entropy=True)
    grads = to_device([torch.randn(t.shape, generator=gen) for t in stats], device)
    (expected_grad,) = torch.autograd.grad(sum((t * g).sum() for t, g in zip(stats, grads)), logits_leaf)

    partials = row_partials(logits, ids, rows, 0, tau, True)
    logp, entropy, scores, softmax_state = combine_partials(all_rank_partials(partials, resolve_tp()), tau)
    assert torch.equal(logp, stats.logp)
    assert torch.equal(entropy, stats.entropy) and torch.equal(scores, stats.scores)

    grad_out = torch.full_like(logits, float("nan"))  # every element must be written
    returned = logits_grad(grad_out, logits, ids, rows, softmax_state, grads[0], grads[1], grads[2], 0, tau)
    assert returned is grad_out
    assert torch.equal(grad_out, expected_grad)
    assert torch.equal(grad_out[[1, 2, 4, 5, 6, 9]].cpu(), torch.zeros(6, 999))

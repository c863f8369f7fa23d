"""The eager path slime runs today for per-token log-probs and entropy, written from its semantics
once: the benchmark's `eager` subject and the tests' bar for low precision.

slime (`calculate_log_probs_and_entropy`) divides the logits by the rollout temperature, computes
log-softmax and gathers the sampled token's entry, and for the entropy builds a softmax of the
same logits; autograd keeps the full `[T, V/tp]` buffers for backward. Here J ids per row are
gathered at once (J = 1 is slime's case). The copies slime makes of the logits before each part
are left out, so this baseline is, if anything, flattering to the eager path. Everything is
computed in the logits' own dtype, as eager torch does.
"""

import torch


def _tempered(logits, temperature, rows=None):
    selected = logits if rows is None else logits[rows]
    selected = selected.contiguous()
    return selected / temperature if temperature != 1.0 else selected


def eager_token_logprobs(logits, ids, *, temperature=1.0, with_entropy=False, rows=None):
    """(logp [N, J] fp32, entropy [N] fp32 or None) of the ids on the selected rows (all by default)."""
    z = _tempered(logits, temperature, rows)
    log_probs = torch.log_softmax(z, dim=-1)
    logp = log_probs.gather(-1, ids)
    entropy = None
    if with_entropy:
        probs = torch.softmax(z, dim=-1)
        entropy = -(probs * log_probs).sum(dim=-1).float()
    return logp.float(), entropy


def eager_token_stats(logits, ids, temperature=1.0, with_entropy=False, rows=None):
    """`fusedrl.kernels.token_stats`' outputs in its order, eagerly: (logp, entropy or None, scores
    = the tempered logits at the ids)."""
    logp, entropy = eager_token_logprobs(logits, ids, temperature=temperature, with_entropy=with_entropy, rows=rows)
    return logp, entropy, _tempered(logits, temperature, rows).gather(-1, ids).float()

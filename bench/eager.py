"""The eager path slime runs today for per-token log-probs and entropy, written from its semantics.

slime (`calculate_log_probs_and_entropy`) divides the logits by the rollout temperature, computes
log-softmax and gathers the sampled token's entry, and for the entropy builds a softmax of the
same logits; autograd keeps the full `[T, V/tp]` buffers for backward. Here J ids per row are
gathered at once (J = 1 is slime's case). The copies slime makes of the logits before each part
are left out, so this baseline is, if anything, flattering to the eager path.
"""

import torch


def eager_token_logprobs(logits, ids, *, temperature=1.0, with_entropy=False):
    """(logp [T, J] fp32, entropy [T] fp32 or None), computed in the logits' dtype as eager torch does."""
    logits = logits.contiguous()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, ids)
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = -(probs * log_probs).sum(dim=-1).float()
    return logp.float(), entropy

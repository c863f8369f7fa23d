"""slime's own loss code as a float64 truth: its log-prob function replaced by a float64 one.

slime's `calculate_log_probs_and_entropy` computes in float32 whatever its input, so the tests
that take slime's loss code as the truth (`test_upstream_slime_*.py`) swap in fusedrl's float64
eager reference under the same contract; everything else of slime's loss runs unchanged.
"""


def float64_log_probs_and_entropy(
    logits, tokens, tp_group, with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True
):
    """slime's `calculate_log_probs_and_entropy` contract ([T, 1] log-probs, [T] entropy over the
    tensor-parallel vocabulary) in float64, by fusedrl's float64 eager reference (slime's own
    function computes in float32 whatever its input)."""
    from fusedrl.kernels import token_logprobs_reference

    assert log_prob_keep_mask is None  # no top-p replay in these runs
    return token_logprobs_reference(logits.double(), tokens.view(-1, 1), with_entropy=with_entropy, tp_group=tp_group)


class Float64LogProbs:
    """The float64 log-prob function in place of slime's, in slime's loss module."""

    def __enter__(self):
        from slime.backends.megatron_utils import loss

        self.original = loss.calculate_log_probs_and_entropy
        loss.calculate_log_probs_and_entropy = float64_log_probs_and_entropy

    def __exit__(self, *exc):
        from slime.backends.megatron_utils import loss

        loss.calculate_log_probs_and_entropy = self.original

"""The fused replacements of slime's log-prob functions against eager float64 implementations of
their documented semantics: temperature, top-p replay (renormalised over the kept ids plus the
sampled token, entropy over the full vocabulary), zigzag and allgather CP, tp = 1 and 2.

Prompt and padding rows are NaN in every distributed case: the results and gradients stay finite
and right, so those rows are never read.
"""

from argparse import Namespace

import pytest
import torch

from fusedrl.slime_ext.logprobs import calculate_log_probs_and_entropy, get_log_probs_and_entropy
from distributed import get_pool
from numerics import assert_parity
from slime_harness import (
    fill_non_response_rows,
    gather_grad_reference,
    make_logits,
    make_samples,
    rank_logits,
    rank_response_positions,
    reference_response_stats,
    top_p_replay,
)

VOCAB = 24
TOTALS = [9, 4, 13, 6]
RESPONSES = [5, 1, 7, 3]
PAD = 8


def _rank_log_probs(info, full_logits, tokens, weights, args, replay):
    logits = rank_logits(
        [fill_non_response_rows(x, r, float("nan")) for x, r in zip(full_logits, RESPONSES)],
        info,
        allgather_cp=args.allgather_cp,
        pad_multiple=PAD,
    )
    kwargs = {} if replay is None else dict(top_p_token_ids=replay[0], top_p_token_offsets=replay[1])
    empty, res = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=tokens, total_lengths=TOTALS, response_lengths=RESPONSES,
        with_entropy=True, **kwargs,
    )
    loss = 0
    for i, (lp, ent) in enumerate(zip(res["log_probs"], res["entropy"])):
        pos = rank_response_positions(TOTALS[i], RESPONSES[i], info.cp_rank, info.cp_size)
        loss = loss + (lp * weights[0][i][pos]).sum() + (ent * weights[1][i][pos]).sum()
    loss.backward()
    return empty.shape, res["log_probs"], res["entropy"], logits.grad[0], info


@pytest.mark.parametrize(
    "tp,cp,allgather,temperature,top_p",
    [
        (1, 1, False, 1.0, False),
        (2, 1, False, 0.7, True),
        (1, 2, False, 1.3, True),
        (2, 2, False, 0.7, False),
        (1, 2, True, 0.7, True),
        (2, 2, True, 1.0, False),
    ],
)
def test_get_log_probs_and_entropy_matches_eager_semantics(tp, cp, allgather, temperature, top_p):
    samples = make_samples(5, TOTALS, RESPONSES, VOCAB)
    tokens = [s.tokens for s in samples]
    full_logits = make_logits(5, TOTALS, VOCAB)
    replay = top_p_replay(6, RESPONSES, VOCAB) if top_p else None
    gen = torch.Generator().manual_seed(7)
    weights = [[torch.randn(r, generator=gen, dtype=torch.float64) for r in RESPONSES] for _ in range(2)]
    args = Namespace(rollout_temperature=temperature, allgather_cp=allgather, entropy_coef=0.01, log_probs_chunk_size=-1)

    ref_logits = [x.clone().requires_grad_() for x in full_logits]
    ref_lp, ref_ent = reference_response_stats(ref_logits, tokens, TOTALS, RESPONSES, temperature, replay)
    total = sum((lp * w).sum() for lp, w in zip(ref_lp, weights[0])) + sum((h * u).sum() for h, u in zip(ref_ent, weights[1]))
    ref_grads = torch.autograd.grad(total, ref_logits)

    for empty_shape, log_probs, entropies, grad, info in get_pool(tp, cp).run(
        _rank_log_probs, full_logits, tokens, weights, args, replay
    ):
        assert empty_shape == (0,)
        for i in range(len(TOTALS)):
            pos = rank_response_positions(TOTALS[i], RESPONSES[i], info.cp_rank, info.cp_size)
            assert log_probs[i].dtype == torch.float32 and log_probs[i].shape == (len(pos),)
            assert_parity(log_probs[i], ref_lp[i][pos].detach(), 1e-5)
            assert_parity(entropies[i], ref_ent[i][pos].detach(), 1e-5)
        expected = gather_grad_reference(ref_grads, info, allgather_cp=allgather, pad_multiple=PAD)
        assert bool(torch.isfinite(grad).all())
        assert_parity(grad, expected, 1e-5)


def test_entropy_carries_no_gradient_without_entropy_coef():
    samples = make_samples(8, TOTALS, RESPONSES, VOCAB)
    logits = torch.cat(make_logits(8, TOTALS, VOCAB)).float().unsqueeze(0).requires_grad_()
    args = Namespace(rollout_temperature=1.0, allgather_cp=False, entropy_coef=0.0, log_probs_chunk_size=-1)
    _, res = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=[s.tokens for s in samples], total_lengths=TOTALS,
        response_lengths=RESPONSES, with_entropy=True,
    )
    assert not any(e.requires_grad for e in res["entropy"])
    assert all(lp.requires_grad for lp in res["log_probs"])


def test_get_log_probs_rejects_loss_data_and_bad_shapes():
    args = Namespace(rollout_temperature=1.0, allgather_cp=False, entropy_coef=0.0)
    logits = torch.zeros(1, 4, 8)
    common = dict(args=args, unconcat_tokens=[torch.arange(4)], total_lengths=[4], response_lengths=[2])
    with pytest.raises(ValueError, match="non_loss_data"):
        get_log_probs_and_entropy(logits, non_loss_data=False, **common)
    with pytest.raises(ValueError, match="logits"):
        get_log_probs_and_entropy(logits[0], **common)


def _keep_mask(num_rows, vocab, gen):
    keep = torch.rand(num_rows, vocab, generator=gen) < 0.3
    keep[0] = True  # a row kept whole: full-vocabulary log-prob
    keep[2] = False  # nothing kept: only the target remains, log-prob 0
    return keep


def reference_calculate(logits, tokens, keep):
    """slime's documented semantics: log-prob renormalised over the kept ids plus the target."""
    z = logits
    if keep is not None:
        keep = keep.clone()
        keep[torch.arange(len(tokens)), tokens] = True
        z = z.masked_fill(~keep, float("-inf"))
    log_probs = torch.log_softmax(z, -1).gather(1, tokens.unsqueeze(1))
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return log_probs, entropy


def _rank_calculate(info, logits, tokens, keep, weights):
    from megatron.core import parallel_state

    shard = logits.chunk(info.tp_size, -1)[info.tp_rank].float().contiguous().requires_grad_()
    local_keep = None if keep is None else keep.chunk(info.tp_size, -1)[info.tp_rank]
    log_probs, entropy = calculate_log_probs_and_entropy(
        shard, tokens, parallel_state.get_tensor_model_parallel_group(), with_entropy=True,
        chunk_size=3, log_prob_keep_mask=local_keep,
    )
    ((log_probs.squeeze(1) * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return log_probs, entropy, shard.grad


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_calculate_log_probs_and_entropy_matches_eager_semantics(tp, masked):
    gen = torch.Generator().manual_seed(11 + tp)
    num_rows = 7
    logits = torch.randn(num_rows, VOCAB, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, VOCAB, (num_rows,), generator=gen)
    tokens[3] = tokens[4]  # a repeated target
    keep = _keep_mask(num_rows, VOCAB, gen) if masked else None
    weights = torch.randn(2, num_rows, generator=gen, dtype=torch.float64)
    ref_logits = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference_calculate(ref_logits, tokens, keep)
    (ref_grad,) = torch.autograd.grad((ref_lp.squeeze(1) * weights[0]).sum() + (ref_ent * weights[1]).sum(), ref_logits)
    for rank, (log_probs, entropy, grad) in enumerate(get_pool(tp, 1).run(_rank_calculate, logits, tokens, keep, weights)):
        assert log_probs.shape == (num_rows, 1) and entropy.shape == (num_rows,)
        assert_parity(log_probs, ref_lp.detach(), 1e-5)
        assert_parity(entropy, ref_ent.detach(), 1e-5)
        assert_parity(grad, ref_grad.chunk(tp, -1)[rank], 1e-5)


def test_calculate_on_empty_logits_and_without_entropy():
    log_probs, entropy = calculate_log_probs_and_entropy(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), None)
    assert log_probs.shape == (0, 1) and entropy is None
    logits = torch.randn(3, 8)
    log_probs, entropy = calculate_log_probs_and_entropy(logits, torch.tensor([1, 2, 3]), None, with_entropy_grad=False)
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(3), torch.tensor([1, 2, 3])]
    assert entropy is None
    assert_parity(log_probs.squeeze(1), expected, 1e-6)

"""A slime whose `get_log_probs_and_entropy` grows an optional keyword still installs: slime PR
#2310 ("compact actor logits before projection", branch commit 8d80215b) adds
`full_loss_masks=None`. At its default the call runs fused (checked against float64); any other
value runs slime's own function for that call, or, with the fused LM head (hidden states where
slime expects logits), is refused naming the keyword. A new parameter without a default is still
refused at install."""

import argparse
import inspect
import logging
import sys
import types

import pytest
import torch
from numerics import assert_parity
from slime_harness import make_logits, make_samples, reference_response_stats

import fusedrl.slime_ext as slime_ext
from fusedrl.slime_ext import lm_head, patching

LOSS = "slime.backends.megatron_utils.loss"
VOCAB = 24
TOTALS = [9, 4, 13]
RESPONSES = [5, 1, 7]
SLIME_CALLS = []


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args: argparse.Namespace,
    unconcat_tokens: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool = False,
    non_loss_data: bool = True,
    top_p_token_ids: list[list[int]] | None = None,
    top_p_token_offsets: list[list[int]] | None = None,
    full_loss_masks: torch.Tensor | None = None,
) -> dict[str, list[torch.Tensor]]:
    """PR #2310's signature, to the letter; its body records that slime's own function ran."""
    SLIME_CALLS.append(full_loss_masks)
    return torch.empty((0,)), {"log_probs": ["slime's own"]}


def calculate_log_probs_and_entropy(
    logits, tokens, tp_group, with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True
):
    raise AssertionError("replaced at install")


@pytest.fixture
def newer_slime(monkeypatch):
    """slime's loss and ppo_utils modules, the loss module with the newer signature."""
    SLIME_CALLS.clear()
    loss = types.ModuleType(LOSS)
    loss.get_log_probs_and_entropy = get_log_probs_and_entropy
    loss.calculate_log_probs_and_entropy = calculate_log_probs_and_entropy
    ppo_utils = types.ModuleType("slime.utils.ppo_utils")
    ppo_utils.calculate_log_probs_and_entropy = calculate_log_probs_and_entropy
    data = types.ModuleType("slime.backends.megatron_utils.data")
    data.get_batch = lambda data_iterator, keys: {}
    for module in (loss, ppo_utils, data):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    yield loss
    patching.uninstall()


def _call(loss, logits, **extra):
    samples = make_samples(3, TOTALS, RESPONSES, VOCAB)
    args = argparse.Namespace(rollout_temperature=0.7, allgather_cp=False, entropy_coef=0.01, log_probs_chunk_size=-1)
    return loss.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=[s.tokens for s in samples], total_lengths=TOTALS,
        response_lengths=RESPONSES, with_entropy=True, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("passed", [{}, {"full_loss_masks": None}])
def test_at_its_default_the_newer_keyword_runs_fused_and_trains(newer_slime, passed):
    slime_ext.install(argparse.Namespace())
    full_logits = make_logits(3, TOTALS, VOCAB)
    logits = torch.cat(full_logits).float().unsqueeze(0).requires_grad_()
    _, result = _call(newer_slime, logits, **passed)
    assert SLIME_CALLS == []
    samples = make_samples(3, TOTALS, RESPONSES, VOCAB)
    reference = [x.clone().requires_grad_() for x in full_logits]
    ref_lp, ref_ent = reference_response_stats(reference, [s.tokens for s in samples], TOTALS, RESPONSES, 0.7)
    for ours, truth in zip(result["log_probs"] + result["entropy"], ref_lp + ref_ent):
        assert_parity(ours, truth.detach(), 1e-5)
    sum(lp.sum() for lp in result["log_probs"]).backward()
    ref_grads = torch.autograd.grad(sum(lp.sum() for lp in ref_lp), reference)
    assert_parity(logits.grad[0], torch.cat(ref_grads), 1e-5)


def test_another_value_runs_slimes_own_function_and_says_so(newer_slime, caplog):
    slime_ext.install(argparse.Namespace())
    logits = torch.cat(make_logits(3, TOTALS, VOCAB)).float().unsqueeze(0)
    masks = torch.ones(1, sum(TOTALS))
    with caplog.at_level(logging.WARNING, logger="fusedrl.slime_ext.callables"):
        _, first = _call(newer_slime, logits, full_loss_masks=masks)
        _call(newer_slime, logits, full_loss_masks=masks)
    assert first == {"log_probs": ["slime's own"]} and len(SLIME_CALLS) == 2 and SLIME_CALLS[0] is masks
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and "full_loss_masks" in said[0] and f"{LOSS}.get_log_probs_and_entropy" in said[0]


def test_another_value_with_the_fused_lm_head_is_refused_naming_the_keyword(newer_slime, monkeypatch):
    slime_ext.install(argparse.Namespace())
    monkeypatch.setattr(lm_head, "output_weight", lambda: torch.zeros(VOCAB, 4))  # a hand-off happened
    hidden = torch.zeros(1, sum(TOTALS), 4)
    with pytest.raises(ValueError, match=r"full_loss_masks=<tensor of shape \(1, 26\).*--fusedrl-fused-lm-head"):
        _call(newer_slime, hidden, full_loss_masks=torch.ones(1, sum(TOTALS)))
    assert SLIME_CALLS == []


def test_the_adapted_replacement_shows_slimes_newer_signature(newer_slime):
    slime_ext.install(argparse.Namespace())
    parameters = inspect.signature(newer_slime.get_log_probs_and_entropy).parameters
    assert parameters["full_loss_masks"].default is None
    assert parameters["full_loss_masks"].kind is inspect.Parameter.KEYWORD_ONLY


def test_a_new_parameter_without_a_default_is_still_refused_at_install(newer_slime, monkeypatch):
    def newest(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False, required_now):
        raise AssertionError

    monkeypatch.setattr(newer_slime, "get_log_probs_and_entropy", newest)
    with pytest.raises(ValueError, match="required_now"):
        slime_ext.install()

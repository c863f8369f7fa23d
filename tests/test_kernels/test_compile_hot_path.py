"""slime's per-micro-batch kernel calls check ids and rows values once per process (and on every
call only under FUSEDRL_VALIDATE=1), so later micro-batches make no host sync that would stand in
the way of CUDA-graph capture; the first call still refuses bad ids with the kernel's ValueError."""

import pytest
import torch

from fusedrl.kernels import TokenStats
from fusedrl.slime_ext import logprobs, responses
from fusedrl.slime_ext.losses.centering import center


@pytest.fixture
def fresh_process(monkeypatch):
    """A process whose slime path has not checked anything yet, without the debug switch."""
    monkeypatch.setattr(responses, "_values_checked", False)
    monkeypatch.delenv("FUSEDRL_VALIDATE", raising=False)
    return monkeypatch


def test_values_are_checked_on_the_first_call_only(fresh_process):
    assert [responses.check_values() for _ in range(3)] == [True, False, False]


def test_debug_switch_checks_every_call(fresh_process):
    fresh_process.setenv("FUSEDRL_VALIDATE", "1")
    assert [responses.check_values() for _ in range(3)] == [True, True, True]


def test_both_slime_paths_pass_the_switch_to_the_kernel(fresh_process):
    calls = []

    def recording_token_stats(logits, ids, **kwargs):
        calls.append(kwargs["validate"])
        return torch.zeros(0)

    fresh_process.setattr(responses, "token_stats", recording_token_stats)
    fresh_process.setattr(logprobs, "token_stats", recording_token_stats)
    fresh_process.setattr(logprobs, "logprobs_and_entropy", lambda stats, **kwargs: (torch.zeros(2), None))
    tokens = responses.ResponseTokens([], torch.zeros(0, dtype=torch.long), [], [], 0, 1, False)
    for _ in range(2):
        tokens.token_stats(torch.zeros(1, 2, 4), torch.zeros(0, 1, dtype=torch.long))
        logprobs.calculate_log_probs_and_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), None)
    assert calls == [True, False, False, False]


def test_first_call_refuses_ids_outside_the_vocabulary(fresh_process):
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\), got ids\[1, 0\] = 7"):
        logprobs.calculate_log_probs_and_entropy(logits, torch.tensor([1, 7, 2]), None)


def test_sfc_draw_weights_finiteness_is_checked_only_when_values_are():
    """The SFC loss passes the same switch to `center`, whose finiteness check is a host sync too;
    shapes are checked either way."""
    stats = TokenStats(torch.randn(4, 3), None, torch.randn(4, 3))
    weights = torch.full((4, 2), 0.5)
    weights[1, 0] = float("nan")
    with pytest.raises(ValueError, match="draw_weights must be finite"):
        center(stats, weights)
    assert torch.isnan(center(stats, weights, validate=False).centered_score[1])
    with pytest.raises(ValueError, match=r"draw_weights must have shape \[4, 2\]"):
        center(stats, weights[:3], validate=False)

"""--fusedrl-keep-slime-log-probs (the bitwise A/B switch): parsed, and refused where the fused
kernel is needed anyway. That it keeps slime's numbers bit for bit, through slime's real code:
tests/test_slime/test_upstream_slime_train.py."""

import argparse

import pytest
from slime_harness import slime_args

from fusedrl.slime_ext.arguments import add_fusedrl_arguments, validate_fusedrl_args
from fusedrl.slime_ext.flags import log_probs


def test_switch_parses_off_by_default():
    parser = add_fusedrl_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).fusedrl_keep_slime_log_probs is False
    assert parser.parse_args([log_probs.FLAG]).fusedrl_keep_slime_log_probs is True


def test_switch_is_accepted_with_slimes_policy_loss():
    args = slime_args(loss_type="policy_loss", custom_loss_function_path=None, fusedrl_keep_slime_log_probs=True,
                      fusedrl_fused_lm_head=False)
    validate_fusedrl_args(args)
    assert args.custom_pg_loss_reducer_function_path is None  # sample_mean: slime's own reducer


@pytest.mark.parametrize("overrides, named", [
    (dict(custom_loss_function_path="fusedrl.slime_ext.losses.policy_loss"), "--custom-loss-function-path fusedrl.slime_ext.losses.policy_loss"),
    (dict(loss_type="policy_loss", custom_loss_function_path=None, fusedrl_fused_lm_head=True), "--fusedrl-fused-lm-head"),
])
def test_switch_is_refused_where_the_fused_kernel_runs_anyway(overrides, named):
    args = slime_args(**{"fusedrl_keep_slime_log_probs": True, "fusedrl_fused_lm_head": False, **overrides})
    with pytest.raises(ValueError, match=f"--fusedrl-keep-slime-log-probs keeps slime's log-prob path, .*{named}"):
        log_probs.validate_args(args)

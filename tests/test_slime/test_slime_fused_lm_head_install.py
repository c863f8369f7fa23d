"""--fusedrl-fused-lm-head at the door: the flag on slime's parser and its startup refusals, the
init hook wrapping slime's model provider only when the flag is on (actor role only), and the
output-layer hand-off on a real megatron-core `ColumnParallelLinear`: what it refuses, what it
returns, and that `restore` gives the layer its logits back."""

import argparse
import sys
import types
from argparse import Namespace

import pytest
import torch

from distributed import get_pool
from fusedrl.slime_ext import patching
from fusedrl.slime_ext.arguments import add_fusedrl_arguments
from fusedrl.slime_ext.flags import lm_head as flags

FLAG = "--fusedrl-fused-lm-head"
POLICY_PATH = "fusedrl.slime_ext.losses.policy_loss"


def _args(**overrides):
    args = dict(fusedrl_fused_lm_head=True, loss_type="policy_loss", custom_loss_function_path=None)
    args.update(overrides)
    return Namespace(**args)


def test_the_flag_is_registered_off_by_default():
    parser = add_fusedrl_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).fusedrl_fused_lm_head is False
    assert parser.parse_args([FLAG]).fusedrl_fused_lm_head is True


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(mtp_num_layers=1), "--mtp-num-layers"),
        (dict(enable_mtp_training=True), "--enable-mtp-training"),
        (dict(loss_type="value_loss"), "--loss-type value_loss"),
        (dict(loss_type="custom_loss", custom_loss_function_path="my.loss"), "--custom-loss-function-path"),
        (dict(defer_embedding_wgrad_compute=True), "--defer-embedding-wgrad-compute"),
        (dict(tensor_parallel_num_weight_shards=4, tensor_model_parallel_size=2), "--tensor-parallel-num-weight-shards 4"),
        (dict(fp8_output_proj=True), "--fp8-output-proj"),
    ],
)
def test_configurations_that_need_real_logits_are_refused_naming_the_flag(overrides, named):
    with pytest.raises(ValueError, match=FLAG) as error:
        flags.validate_args(_args(**overrides))
    assert named in str(error.value)
    flags.validate_args(_args(fusedrl_fused_lm_head=False, **overrides))  # flag off: not this check's business


@pytest.mark.parametrize(
    "loss_type,path",
    [("policy_loss", None), ("sft_loss", None), ("custom_loss", POLICY_PATH), ("custom_loss", "fusedrl.slime_ext.losses.sfc_loss")],
)
def test_losses_computed_from_log_probs_are_accepted(loss_type, path):
    flags.validate_args(_args(loss_type=loss_type, custom_loss_function_path=path, mtp_num_layers=None))


@pytest.mark.parametrize("shards", [None, 2])
def test_weight_shards_no_more_than_tensor_parallelism_are_accepted(shards):
    """megatron-core 0.17+: as many weight shards as tensor-parallel ranks is plain tensor parallelism."""
    flags.validate_args(_args(tensor_parallel_num_weight_shards=shards, tensor_model_parallel_size=2))


def _slime_function():
    def function(*args, **kwargs):
        raise AssertionError("not called by these tests")

    return function


def _get_model_provider_func(args, role="actor"):
    return ("provider", role)


@pytest.fixture
def fake_slime(monkeypatch):
    """slime's defining modules of every install target, and a consumer of the model provider."""
    modules = {
        "slime.backends.megatron_utils.loss": dict(
            get_log_probs_and_entropy=_slime_function(), loss_function=_slime_function()
        ),
        "slime.utils.ppo_utils": dict(calculate_log_probs_and_entropy=_slime_function()),
        "slime.backends.megatron_utils.data": dict(get_batch=_slime_function()),
        "slime.backends.megatron_utils.model_provider": dict(get_model_provider_func=_get_model_provider_func),
        "slime.backends.megatron_utils.model": dict(get_model_provider_func=_get_model_provider_func),
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    yield sys.modules["slime.backends.megatron_utils.model"]
    patching.uninstall()


def test_install_wraps_the_model_provider_only_with_the_flag(fake_slime):
    # (install rebinds this module's own name too, so the functions are told apart by module)
    patching.install(Namespace(loss_type="policy_loss", fusedrl_fused_lm_head=False))
    assert fake_slime.get_model_provider_func.__module__ == __name__
    patching.install(Namespace(loss_type="policy_loss", fusedrl_fused_lm_head=True))
    wrapped = fake_slime.get_model_provider_func
    assert wrapped.__module__ == "fusedrl.slime_ext.patching"
    assert getattr(sys.modules["slime.backends.megatron_utils.loss"].loss_function, "_fusedrl_publishes_schedule", False)
    assert wrapped(None, "critic") == ("provider", "critic")  # other roles: slime's provider itself
    patching.uninstall()
    assert fake_slime.get_model_provider_func.__module__ == __name__


def test_install_refuses_a_provider_signature_it_does_not_know(fake_slime, monkeypatch):
    def get_model_provider_func(args, role="actor", vp_stage=None):
        return None

    for name in ("model_provider", "model"):
        monkeypatch.setattr(sys.modules[f"slime.backends.megatron_utils.{name}"], "get_model_provider_func", get_model_provider_func)
    with pytest.raises(ValueError, match="vp_stage"):
        patching.install(Namespace(loss_type="policy_loss", fusedrl_fused_lm_head=True))


def _layer(**kwargs):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    options = dict(bias=False, gather_output=False)
    options.update(kwargs)
    config = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True)
    return ColumnParallelLinear(4, 6, config=config, init_method=torch.nn.init.normal_, **options)


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


def _hand_off_observations(info):
    """What the hand-off does on this worker's real megatron-core layers (tp = 1)."""
    from fusedrl.slime_ext import lm_head

    seen = {}
    seen["not a ColumnParallelLinear"] = _error(lm_head.hand_off, torch.nn.Linear(4, 6))
    seen["bias"] = _error(lm_head.hand_off, _layer(bias=True))
    seen["gather_output"] = _error(lm_head.hand_off, _layer(gather_output=True))

    class Model(torch.nn.Module):
        def __init__(self, post_process, with_layer=True, vp_stage=None):
            super().__init__()
            self.config = ("config of chunk", vp_stage)  # each chunk its own, as slime's provider builds them
            if post_process and with_layer:
                self.output_layer = _layer()

    def get_model_provider_func(args, role="actor"):
        def provider(pre_process=True, post_process=True, vp_stage=None):
            return Model(post_process, with_layer=args != "no layer", vp_stage=vp_stage)

        return provider

    get_provider = patching.handing_off_provider_func(get_model_provider_func)
    actor = get_provider(None, "actor")(pre_process=True, post_process=True)
    critic = get_provider(None, "critic")(pre_process=True, post_process=True)
    middle = get_provider(None, "actor")(pre_process=True, post_process=False)
    seen["no output layer"] = _error(get_provider("no layer", "actor"), pre_process=True, post_process=True)
    seen["middle stage has no layer"] = not hasattr(middle, "output_layer")

    x = torch.randn(5, 1, 4)
    hidden, bias = actor.output_layer(x)
    seen["hands off"] = bias is None and torch.equal(hidden, x) and lm_head.output_weight() is actor.output_layer.weight
    tied = torch.nn.Parameter(torch.randn(6, 4))
    actor.output_layer(x, weight=tied)
    seen["records a tied weight"] = lm_head.output_weight() is tied
    seen["critic untouched"] = critic.output_layer(x)[0].shape == (5, 1, 6)
    seen["gathered logits"] = _error(actor.output_layer, x, runtime_gather_output=True)
    seen["wrong weight"] = _error(actor.output_layer, x, weight=torch.randn(7, 4))
    seen["wrong output"] = _error(lm_head.hidden_rows, torch.randn(1, 5, 6), tied)
    sharded = get_provider(None, "actor")(pre_process=True, post_process=True)
    sharded.output_layer.weight = torch.nn.Parameter(torch.randn(3, 4))  # half of the rank's vocabulary slice
    seen["sharded weight"] = _error(sharded.output_layer, x)
    seen["one chunk: its config"] = lm_head.schedule_config() == ("config of chunk", None)
    for vp_stage in (0, 1):  # virtual pipeline stages, the output layer on the last
        get_provider(None, "actor")(pre_process=vp_stage == 0, post_process=vp_stage == 1, vp_stage=vp_stage)
    actor.output_layer(x)
    seen["virtual stages: model[0]'s config"] = lm_head.schedule_config() == ("config of chunk", 0)
    seen["rows in weight dtype"] = lm_head.hidden_rows(torch.randn(1, 5, 4), tied.bfloat16()).dtype
    lm_head.hand_off(actor.output_layer)  # again: harmless
    lm_head.restore()
    seen["restored"] = actor.output_layer(x)[0].shape == (5, 1, 6) and lm_head.output_weight() is None
    return seen


def test_hand_off_on_megatron_core_output_layers():
    seen = get_pool(1, 1).run(_hand_off_observations)[0]
    refused = ("not a ColumnParallelLinear", "bias", "gather_output", "no output layer", "gathered logits", "wrong weight",
               "wrong output", "sharded weight")  # fmt: skip
    for case in refused:
        assert FLAG in seen[case], (case, seen[case])
    assert "has a bias" in seen["bias"] and "gather_output=True" in seen["gather_output"]
    assert "[1, T, H = 4]" in seen["wrong output"] and "(7, 4)" in seen["wrong weight"]
    assert "(3, 4)" in seen["sharded weight"] and "--tensor-parallel-num-weight-shards" in seen["sharded weight"]
    for case in ("middle stage has no layer", "hands off", "records a tied weight", "critic untouched", "restored",
                 "one chunk: its config", "virtual stages: model[0]'s config"):  # fmt: skip
        assert seen[case] is True, case
    assert seen["rows in weight dtype"] == torch.bfloat16

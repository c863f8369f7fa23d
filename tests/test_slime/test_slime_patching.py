"""The init hook (`fusedrl.slime_ext.install`) and the wrapper entry point (`slime_ext.train`)
against stand-in slime modules registered in sys.modules (slime itself is not importable here):
every module that imported the targets is patched, installing twice is harmless, uninstall
restores the originals; bad configurations stop at startup with a message naming the flag."""

import argparse
import importlib.util
import re
import subprocess
import sys
import types

import pytest
import torch
from slime_harness import slime_args

import fusedrl.slime_ext as slime_ext
from fusedrl.slime_ext import age, arguments, logprobs, patching
from fusedrl.slime_ext import train as entry
from fusedrl.slime_ext.arguments import add_fusedrl_arguments
from fusedrl.slime_ext.flags.aggregation import REDUCER_PATH


def _get_log_probs_and_entropy(
    logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False, non_loss_data=True,
    top_p_token_ids=None, top_p_token_offsets=None,
):
    raise AssertionError("slime's eager path must not run once installed")


def _calculate_log_probs_and_entropy(
    logits, tokens, tp_group, with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True
):
    raise AssertionError("slime's eager path must not run once installed")


def _get_batch(data_iterator, keys, pad_multiplier=128, qkv_format="thd", allgather_cp=False):
    return {"multimodal_train_inputs": {"fusedrl_draws": torch.ones(2), "pixel_values": torch.zeros(1)}}


def _policy_loss_function(args, batch, logits, sum_of_sample_mean):
    from fusedrl.slime_ext import micro_batch

    return micro_batch.current()


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def fake_slime(monkeypatch):
    """slime's three defining modules plus a consumer that did `from ... import` of each."""
    originals = dict(
        get_log_probs_and_entropy=_get_log_probs_and_entropy,
        calculate_log_probs_and_entropy=_calculate_log_probs_and_entropy,
        get_batch=_get_batch,
    )
    modules = {
        "slime.backends.megatron_utils.loss": _module(
            "loss", get_log_probs_and_entropy=_get_log_probs_and_entropy,
            calculate_log_probs_and_entropy=_calculate_log_probs_and_entropy, policy_loss_function=_policy_loss_function,
        ),
        "slime.utils.ppo_utils": _module("ppo_utils", calculate_log_probs_and_entropy=_calculate_log_probs_and_entropy),
        "slime.backends.megatron_utils.data": _module("data", get_batch=_get_batch),
        "slime.backends.megatron_utils.model": _module("model", **originals),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield modules, originals
    patching.uninstall()


def test_install_patches_every_module_that_imported_the_targets(fake_slime):
    modules, originals = fake_slime
    slime_ext.install(argparse.Namespace())
    for module in modules.values():
        for name, original in originals.items():
            if name not in vars(module):
                continue
            patched = getattr(module, name)
            assert patched is not original
            if name == "get_batch":
                assert patched.__wrapped__ is original
            else:
                assert patched is getattr(logprobs, name)


def test_installed_get_batch_keeps_carried_tensors_out_of_the_forward(fake_slime):
    modules, _ = fake_slime
    slime_ext.install()
    batch = modules["slime.backends.megatron_utils.model"].get_batch(None, ["tokens"])
    assert set(batch["multimodal_train_inputs"]) == {"pixel_values"}
    assert set(batch["fusedrl_carried"]) == {"fusedrl_draws"}


def test_install_twice_is_harmless_and_reaches_modules_loaded_since(fake_slime, monkeypatch):
    modules, originals = fake_slime
    slime_ext.install()
    first = {name: getattr(modules["slime.backends.megatron_utils.model"], name) for name in originals}
    late = _module("late_consumer", **originals)  # captured the originals before install
    monkeypatch.setitem(sys.modules, "late_consumer", late)
    slime_ext.install()
    for name in originals:
        assert getattr(modules["slime.backends.megatron_utils.model"], name) is first[name]
        assert getattr(late, name) is first[name]
    assert set(patching.installed()) == {f"{t.module}.{t.name}" for t in patching.TARGETS}


def test_keep_slime_log_probs_leaves_the_log_prob_path_alone(fake_slime):
    modules, originals = fake_slime
    slime_ext.install(argparse.Namespace(fusedrl_keep_slime_log_probs=True))
    model = modules["slime.backends.megatron_utils.model"]
    assert model.get_log_probs_and_entropy is originals["get_log_probs_and_entropy"]
    assert model.calculate_log_probs_and_entropy is originals["calculate_log_probs_and_entropy"]
    assert model.get_batch.__wrapped__ is originals["get_batch"]  # carried data still kept out of the model


def test_slimes_policy_loss_publishes_its_batch_only_for_the_packages_reducer(fake_slime):
    modules, _ = fake_slime
    loss = modules["slime.backends.megatron_utils.loss"]
    original = loss.policy_loss_function  # (install rebinds this test module's name for it too)
    slime_ext.install(argparse.Namespace(custom_pg_loss_reducer_function_path=None))
    assert loss.policy_loss_function is original
    slime_ext.install(slime_args(loss_type="policy_loss", custom_loss_function_path=None, loss_aggregation="constant",
                                 loss_aggregation_divisor=8.0, custom_pg_loss_reducer_function_path=REDUCER_PATH))
    batch = {"loss_masks": []}
    assert loss.policy_loss_function(None, batch, None, None) is batch
    assert loss.policy_loss_function.__wrapped__ is original


@pytest.mark.parametrize("argv, named", [
    (["--loss-aggregation", "prompt_mean"], "--loss-aggregation on the command line"),
    (["--sfc-kl-beta=0.3", "--fusedrl-keep-slime-log-probs"], "--fusedrl-keep-slime-log-probs, --sfc-kl-beta on the command line"),
])
def test_install_refuses_package_flags_slimes_parser_dropped(fake_slime, monkeypatch, argv, named):
    monkeypatch.setattr(sys, "argv", ["train.py", "--custom-megatron-init-path", "fusedrl.slime_ext.install", *argv])
    with pytest.raises(ValueError, match=rf"{named} never reached slime's args: .*python -m fusedrl.slime_ext.train"):
        slime_ext.install(argparse.Namespace(loss_type="policy_loss"))
    assert patching.installed() == {}
    parsed_by_the_entry_point = argparse.Namespace(loss_aggregation="prompt_mean", sfc_kl_beta=0.3, fusedrl_keep_slime_log_probs=True)
    arguments.refuse_dropped_flags(parsed_by_the_entry_point, sys.argv[1:])  # nothing dropped


def test_uninstall_restores_every_original(fake_slime, monkeypatch):
    modules, originals = fake_slime
    slime_ext.install()
    slime_ext.install()
    slime_ext.uninstall()
    for module in modules.values():
        for name, original in originals.items():
            if name in vars(module):
                assert getattr(module, name) is original
    assert patching.installed() == {}


def test_install_calls_the_user_init_hook_after_patching(fake_slime, monkeypatch):
    modules, _ = fake_slime
    seen = []
    monkeypatch.setitem(sys.modules, "user_hooks", _module("user_hooks", init=lambda args: seen.append(
        modules["slime.backends.megatron_utils.loss"].get_log_probs_and_entropy)))
    args = argparse.Namespace(fusedrl_user_init_path="user_hooks.init")
    slime_ext.install(args)
    assert seen == [logprobs.get_log_probs_and_entropy]


@pytest.mark.parametrize("loss_path,counts_ages", [
    ("fusedrl.slime_ext.losses.sfc_loss", True),
    ("fusedrl.slime_ext.losses.policy_loss", False),
])
def test_install_starts_age_bookkeeping_only_for_the_sfc_loss(fake_slime, monkeypatch, loss_path, counts_ages):
    updaters = types.ModuleType(age.UPDATER_PACKAGE)  # slime's weight updater package, empty here
    updaters.__path__ = []
    monkeypatch.setitem(sys.modules, updaters.__name__, updaters)
    sfc_flags = dict(sfc_num_auxiliary_token_samples=2, sfc_kl_beta=0.1) if counts_ages else {}
    args = slime_args(custom_loss_function_path=loss_path, custom_megatron_before_train_step_hook_path=None, **sfc_flags)
    slime_ext.install(args)
    expected = age.HOOK_PATH if counts_ages else None
    assert args.custom_megatron_before_train_step_hook_path == expected


def test_package_import_stays_light():
    assert slime_ext.__getattr__("install") is patching.install
    with pytest.raises(AttributeError, match="nothing"):
        slime_ext.__getattr__("nothing")


# ----------------------------------------------------------------------------- entry point


def _slime_parse_args(add_custom_arguments=None):
    """Stand-in for slime.utils.arguments.parse_args with the slime flags the validators read."""
    parser = argparse.ArgumentParser(prog="slime")
    for flag, default in (
        ("--loss-type", "policy_loss"), ("--custom-loss-function-path", None), ("--custom-megatron-init-path", None),
        ("--advantage-estimator", "grpo"), ("--rollout-function-path", "slime.rollout.sglang_rollout.generate_rollout"),
        ("--custom-pg-loss-reducer-function-path", None), ("--kl-loss-type", "k1"),
    ):
        parser.add_argument(flag, default=default)
    for flag, default in (
        ("--eps-clip-c", None), ("--rollout-top-p", 1.0), ("--entropy-coef", 0.0), ("--rollout-temperature", 1.0),
        ("--tis-clip", 2.0), ("--tis-clip-low", 0.0), ("--opsm-delta", 1e-4),
    ):
        parser.add_argument(flag, type=float, default=default)
    parser.add_argument("--rollout-top-k", type=int, default=-1)
    for flag in ("--calculate-per-token-loss", "--use-kl-loss", "--use-tis", "--use-opsm"):
        parser.add_argument(flag, action="store_true")
    if add_custom_arguments is not None:
        parser = add_custom_arguments(parser)
    return parser.parse_args(sys.argv[1:])


@pytest.fixture
def slime_entry(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(
        "CALLS = []\n\n\ndef train(args):\n    CALLS.append(args)\n\n\n"
        "if __name__ == '__main__':\n    raise SystemExit('the __main__ block must not run')\n"
    )
    monkeypatch.setitem(sys.modules, "slime", _module("slime"))
    monkeypatch.setitem(sys.modules, "slime.utils", _module("slime.utils"))
    monkeypatch.setitem(sys.modules, "slime.utils.arguments", _module("arguments", parse_args=_slime_parse_args))
    monkeypatch.setattr(sys, "argv", ["entry"])
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(*flags):
        module = {}
        original_load = entry.load_script

        def load(path):
            module["script"] = original_load(path)
            return module["script"]

        monkeypatch.setattr(entry, "load_script", load)
        entry.main([str(script), *flags])
        return module["script"].CALLS

    return run


FUSED_LOSS = ("--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss")


def test_entry_point_parses_package_flags_and_runs_slime_train(slime_entry):
    (args,) = slime_entry(*FUSED_LOSS, "--loss-aggregation", "constant", "--loss-aggregation-divisor", "4096")
    assert args.loss_aggregation == "constant" and args.loss_aggregation_divisor == 4096.0
    assert args.custom_megatron_init_path == entry.INSTALL_PATH


def test_entry_point_keeps_a_user_init_hook(slime_entry):
    (args,) = slime_entry("--custom-megatron-init-path", "my.hooks.init")
    assert args.custom_megatron_init_path == entry.INSTALL_PATH
    assert args.fusedrl_user_init_path == "my.hooks.init"


@pytest.mark.parametrize(
    "flags,named",
    [
        (("--loss-aggregation", "constant"), "--loss-aggregation-divisor"),
        (("--loss-aggregation", "constant", "--loss-aggregation-divisor", "0"), "--loss-aggregation-divisor"),
        (FUSED_LOSS + ("--use-tis", "--tis-clip-low", "3"), "--tis-clip-low"),
        (FUSED_LOSS + ("--use-opsm", "--opsm-delta", "nan"), "--opsm-delta"),
        (FUSED_LOSS + ("--eps-clip-c", "0.5"), "--eps-clip-c"),
        (FUSED_LOSS + ("--custom-pg-loss-reducer-function-path", "my.reducer"), "--custom-pg-loss-reducer-function-path"),
    ],
)
def test_bad_configuration_stops_at_startup_naming_the_flag(slime_entry, flags, named):
    with pytest.raises(ValueError, match=named):
        slime_entry(*flags)


def test_unknown_aggregation_mode_is_rejected_by_the_parser(slime_entry, capsys):
    with pytest.raises(SystemExit):
        slime_entry("--loss-aggregation", "median")
    assert "--loss-aggregation" in capsys.readouterr().err


def _usage_error(capsys, argv) -> str:
    """What `main(argv)` prints for a usage error, checked to exit with argparse's status 2."""
    with pytest.raises(SystemExit) as stopped:
        entry.main(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_entry_point_needs_slime_entry_script(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "slime", _module("slime"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert "no slime entry script given" in _usage_error(capsys, [])
    assert re.search("entry script .*missing.py", _usage_error(capsys, [str(tmp_path / "missing.py")]))
    (tmp_path / "lib.py").write_text("X = 1\n")
    assert "train" in _usage_error(capsys, [str(tmp_path / "lib.py")])


def test_entry_point_without_slime_says_so_before_loading_the_script(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text("raise AssertionError('the script must not be loaded')\n")
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "slime", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "slime" else find_spec(name, *a))
    assert "slime is not importable" in _usage_error(capsys, [str(script)])


def run_entry_point(*argv):
    return subprocess.run(
        [sys.executable, "-m", "fusedrl.slime_ext.train", *argv], capture_output=True, text=True, timeout=120
    )


def test_help_lists_the_package_flags():
    result = run_entry_point("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: python -m fusedrl.slime_ext.train path/to/slime/train.py")
    parser = argparse.ArgumentParser()
    add_fusedrl_arguments(parser)
    flags = [option for action in parser._actions for option in action.option_strings if option != "-h" and option != "--help"]
    assert flags and all(flag in result.stdout for flag in flags)


def test_a_missing_script_is_a_one_line_error(tmp_path):
    result = run_entry_point(str(tmp_path / "missing.py"), "--loss-aggregation", "token_mean")
    assert result.returncode == 2 and result.stdout == ""  # argparse's status for a usage error
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("python -m fusedrl.slime_ext.train: error: the first argument must be slime's entry script")

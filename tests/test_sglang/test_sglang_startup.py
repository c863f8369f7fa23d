"""Start-up: settings the token-sample mode cannot serve, and hooks SGLang failed to apply,
stop the server (main process and every scheduler process) instead of serving wrong draws."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.layers.sampler import Sampler

from fusedrl.sglang_plugin import plugin
from fusedrl.sglang_plugin.constraints import MAX_SAMPLES_ENV_VAR
from sglang_harness import hooks_enabled, publish_cpu_runtime


def _registered(target: str, hook_type: HookType):
    (registered_type, hook, _source), = HookRegistry._hooks[target]
    assert registered_type is hook_type
    return hook


def _server_check():
    return _registered(plugin.SERVER_ARGS_TARGET, HookType.AFTER)


def _server_args(**overrides):
    """SGLang's real ServerArgs (CPU, placeholder model path) with `overrides` set."""
    server_args = publish_cpu_runtime()
    return SimpleNamespace(**{**vars(server_args), **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(speculative_algorithm="EAGLE"), r"speculative decoding \(speculative_algorithm=EAGLE"),
        (dict(speculative_algorithm="NGRAM"), "speculative_algorithm=NGRAM"),
        (dict(enable_watermark=True), "watermarking"),
    ],
)
def test_server_start_refused_under_unservable_settings(monkeypatch, overrides, message):
    with hooks_enabled(monkeypatch):
        check = _server_check()
        assert check(None, _server_args()) is None
        with pytest.raises(ValueError, match=f"refusing to start: .*{message}"):
            check(None, _server_args(**overrides))


def test_original_logprobs_env_disables_patching_and_refuses_start(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    forward = Sampler.__dict__["forward"]
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert list(HookRegistry._hooks) == [plugin.SERVER_ARGS_TARGET]
        assert Sampler.__dict__["forward"] is forward
        with pytest.raises(ValueError, match="refusing to start: SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
            _server_check()(None, _server_args())
    assert "NOT enabled" in caplog.text


def test_sglang_without_a_known_target_is_left_alone_and_refused(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "find_draw_target", lambda: None)
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert list(HookRegistry._hooks) == [plugin.SERVER_ARGS_TARGET]
        with pytest.raises(ValueError, match="has neither .*compute_logprobs .*to hook"):
            _server_check()(None, _server_args())
    assert "NOT enabled" in caplog.text


def _fail_to_apply(monkeypatch, failing_target: str):
    """Make SGLang's HookRegistry fail on one target, as it does for a renamed method: it logs
    the failure and carries on."""
    apply_target = HookRegistry._apply_target.__func__

    def apply_or_fail(cls, target, hooks):
        if target == failing_target:
            raise AttributeError(f"no attribute {target.rsplit('.', 1)[1]!r}")
        return apply_target(cls, target, hooks)

    monkeypatch.setattr(HookRegistry, "_apply_target", classmethod(apply_or_fail))


@pytest.mark.parametrize(
    "failing_target",
    [plugin.SAMPLER_FORWARD_TARGET, plugin.COMPUTE_LOGPROBS_TARGET, plugin.ADMISSION_TARGET,
     plugin.SCHEDULER_ADMISSION_TARGET],
)
def test_start_refused_in_main_process_when_a_hook_did_not_land(monkeypatch, caplog, failing_target):
    _fail_to_apply(monkeypatch, failing_target)
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert failing_target not in HookRegistry._patched
        with pytest.raises(ValueError, match=f"did not apply the plugin's hooks on {failing_target}"):
            _server_check()(None, _server_args())
    assert f"Failed to apply hooks to {failing_target}" in caplog.text


@pytest.mark.parametrize(
    "failing_target",
    [plugin.SAMPLER_FORWARD_TARGET, plugin.COMPUTE_LOGPROBS_TARGET,
     plugin.SCHEDULER_ADMISSION_TARGET],
)
def test_scheduler_refuses_to_start_when_its_hooks_did_not_land(monkeypatch, failing_target):
    """Scheduler processes load plugins on their own; the check runs before Scheduler.__init__
    does anything, and a raise there fails the server's start-up."""
    _fail_to_apply(monkeypatch, failing_target)
    with hooks_enabled(monkeypatch):
        assert plugin.SCHEDULER_INIT_TARGET in HookRegistry._patched
        with pytest.raises(ValueError, match=f"did not apply the plugin's hooks on {failing_target}"):
            Scheduler(None, None)


def test_scheduler_start_passes_the_check_when_every_hook_landed(monkeypatch):
    with hooks_enabled(monkeypatch):
        check = _registered(plugin.SCHEDULER_INIT_TARGET, HookType.BEFORE)
        assert check(object(), None, None) is None


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_a_bad_draw_bound_leaves_sglang_alone_and_refuses_start_naming_it(monkeypatch, caplog, value):
    monkeypatch.setenv(MAX_SAMPLES_ENV_VAR, value)
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert list(HookRegistry._hooks) == [plugin.SERVER_ARGS_TARGET]
        with pytest.raises(ValueError, match=rf"refusing to start: {MAX_SAMPLES_ENV_VAR}='{re.escape(value)}' is not a positive integer"):
            _server_check()(None, _server_args())
    assert "NOT enabled" in caplog.text

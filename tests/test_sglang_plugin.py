"""The token-sample plugin against SGLang's real Sampler.forward, hook registry and params."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.logprob_processor import OutputLogprobProcessor, get_top_logprobs
import sglang.srt.layers.sampler as sampler_module
from sglang.srt.layers.sampler import Sampler
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

from fusedrl.sglang_plugin import constraints, hooks, plugin
from fusedrl.sglang_plugin.client import parse_token_samples
from sglang_harness import (
    chi_square_p_value,
    hooks_enabled,
    run_sampler,
    sampling_info,
    tempered_logprobs,
)

TEMPERATURES = [0.7, 1.0, 1.3, 0.5, 2.0]
NUMS = [3, 0, 5, 1, 4]  # row 1 asks for nothing


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 2.0


def test_registers_through_hook_registry_and_returns_sampled_then_draws(monkeypatch, caplog):
    logits = _logits(len(TEMPERATURES), 37, seed=0)
    with caplog.at_level(logging.INFO), hooks_enabled(monkeypatch):
        assert plugin.COMPUTE_LOGPROBS_TARGET in HookRegistry._patched
        assert plugin.SAMPLER_FORWARD_TARGET in HookRegistry._patched
        assert set(HookRegistry._hooks) >= {plugin.ADMISSION_TARGET, plugin.SERVER_ARGS_TARGET}
        assert hasattr(OutputLogprobProcessor.compute_logprobs, "__wrapped__")
        torch.manual_seed(1)
        next_ids, output = run_sampler(logits, sampling_info(TEMPERATURES), NUMS)
    assert f"patching {plugin.COMPUTE_LOGPROBS_TARGET}" in caplog.text

    _assert_sampled_then_draws(output, next_ids, tempered_logprobs(logits, TEMPERATURES))


def _assert_sampled_then_draws(output, next_ids, truth):
    """Row r (K = NUMS[r]): 1 + K entries, its sampled token first, logprobs = truth[r, ids]."""
    for row, k in enumerate(NUMS):
        ids = output.next_token_top_logprobs_idx[row]
        vals = output.next_token_top_logprobs_val[row]
        assert ids.numel() == vals.numel() == (1 + k if k else 0)
        if k:
            assert int(ids[0]) == int(next_ids[row])
            _assert_logprobs_close(vals, truth[row, ids])
    _assert_logprobs_close(
        output.next_token_logprobs, truth[torch.arange(len(NUMS)), next_ids.long()]
    )


def _assert_logprobs_close(fp32_values, float64_truth):
    torch.testing.assert_close(fp32_values.double(), float64_truth, rtol=1e-5, atol=1e-5)


def test_draw_frequencies_match_tempered_softmax_and_reject_wrong_distributions(monkeypatch):
    vocab, rows, k, temperature = 8, 2000, 10, 0.6
    base = torch.linspace(-2.0, 2.0, vocab) + 0.3 * _logits(1, vocab, seed=3)[0]
    logits = base.expand(rows, vocab).contiguous()
    with hooks_enabled(monkeypatch):
        torch.manual_seed(4)
        _, output = run_sampler(logits, sampling_info([temperature] * rows), [k] * rows)
    draws = torch.stack(output.next_token_top_logprobs_idx)[:, 1:]
    counts = torch.bincount(draws.flatten(), minlength=vocab)

    true_probs = torch.softmax(base.double() / temperature, dim=-1)
    assert chi_square_p_value(counts, true_probs) > 1e-3
    # The same statistic rejects what a wrong implementation would sample from.
    untempered = torch.softmax(base.double(), dim=-1)
    slightly_off = torch.softmax(base.double() / (temperature * 1.1), dim=-1)
    top_k_shortcut = true_probs.clone()
    top_k_shortcut[true_probs.argsort()[:2]] = 0.0
    top_k_shortcut /= top_k_shortcut.sum()
    for wrong in (untempered, slightly_off):
        assert chi_square_p_value(counts, wrong) < 1e-6
    assert counts[true_probs.argsort()[:2]].sum() > 0  # a top-k shortcut never draws these
    assert chi_square_p_value(counts, top_k_shortcut.clamp_min(1e-12)) < 1e-6


def test_variable_unset_leaves_sglang_top_k_identical(monkeypatch, caplog):
    logits = _logits(len(TEMPERATURES), 37, seed=5)
    forward = Sampler.__dict__["forward"]
    compute = OutputLogprobProcessor.__dict__["compute_logprobs"]
    torch.manual_seed(6)
    plain_ids, plain = run_sampler(logits, sampling_info(TEMPERATURES), NUMS)
    for env_value in (None, "0", "yes"):
        with caplog.at_level(logging.INFO), hooks_enabled(monkeypatch, env_value):
            assert not HookRegistry._hooks
            assert Sampler.__dict__["forward"] is forward
            assert OutputLogprobProcessor.__dict__["compute_logprobs"] is compute
            torch.manual_seed(6)
            ids, output = run_sampler(logits, sampling_info(TEMPERATURES), NUMS)
        assert torch.equal(ids, plain_ids)
        assert torch.equal(output.next_token_logprobs, plain.next_token_logprobs)
        for field in ("next_token_top_logprobs_idx", "next_token_top_logprobs_val"):
            for row in range(len(NUMS)):
                assert torch.equal(getattr(output, field)[row], getattr(plain, field)[row])
    assert "'yes' is not '1'" in caplog.text
    assert plain.next_token_top_logprobs_idx[2].numel() == 5  # SGLang's own top-K, not 1 + K


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(top_ks=[TOP_K_ALL, 5, TOP_K_ALL]), r"batch row 1: .*top_k=5 truncates"),
        (dict(top_ps=[1.0, 1.0, 0.9]), r"batch row 2: .*refused: top_p=0\.9 truncates"),
        (dict(min_ps=[0.1, 0.0, 0.0]), r"batch row 0: .*refused: min_p=0\.1 truncates"),
        (dict(top_ks=[1, 1, 1]), r"batch row 0: .*top_k=1 \(greedy decoding"),
    ],
)
def test_truncated_or_greedy_rows_asking_for_samples_are_refused(monkeypatch, params, message):
    logits = _logits(3, 11, seed=7)
    with hooks_enabled(monkeypatch), pytest.raises(ValueError, match=message):
        run_sampler(logits, sampling_info([0.8] * 3, **params), [2, 2, 2])


def test_truncated_row_not_asking_for_samples_is_served(monkeypatch):
    # Truncated sampling reads the backend from SGLang's runtime context, unpublished on CPU.
    backend = SimpleNamespace(kernel=SimpleNamespace(sampling_backend="pytorch"))
    monkeypatch.setattr(sampler_module, "get_exec", lambda: backend)
    logits = _logits(3, 11, seed=8)
    with hooks_enabled(monkeypatch):
        _, output = run_sampler(
            logits, sampling_info([0.8] * 3, top_ks=[TOP_K_ALL, 4, TOP_K_ALL]), [2, 0, 3]
        )
    assert [t.numel() for t in output.next_token_top_logprobs_idx] == [3, 0, 4]


def test_watermarked_logprobs_are_refused():
    with pytest.raises(ValueError, match="batch row 0: .*watermarked"):
        hooks.reject_unfaithful_rows(sampling_info([1.0]), [2], logprob_logits=torch.zeros(1, 4))


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(temperature=0.0), r"top_logprobs_num=4\) is refused: top_k=1 \(greedy"),
        (dict(temperature=0.9, top_k=20), "top_k=20 truncates"),
        (dict(temperature=0.9, top_p=0.95), "top_p=0.95 truncates"),
        (dict(temperature=0.9, min_p=0.05), "min_p=0.05 truncates"),
    ],
)
def test_admission_refuses_truncated_requests_with_clear_message(params, message):
    request = SimpleNamespace(
        return_logprob=True, top_logprobs_num=4, sampling_params=SamplingParams(**params)
    )
    with pytest.raises(ValueError, match=message):
        hooks.admission_hook(request)


def test_admission_lets_faithful_or_sample_free_requests_through():
    faithful = SimpleNamespace(
        return_logprob=True, top_logprobs_num=4, sampling_params=SamplingParams(temperature=0.9)
    )
    no_samples = SimpleNamespace(
        return_logprob=True, top_logprobs_num=0, sampling_params=SamplingParams(top_p=0.5)
    )
    no_logprobs = SimpleNamespace(
        return_logprob=False, top_logprobs_num=4, sampling_params=SamplingParams(temperature=0.0)
    )
    for request in (faithful, no_samples, no_logprobs):
        assert hooks.admission_hook(request) is None


@pytest.mark.parametrize(
    "server_args, message",
    [
        (SimpleNamespace(speculative_algorithm="EAGLE"), "speculative decoding"),
        (SimpleNamespace(speculative_algorithm=None, enable_watermark=True), "watermarking"),
    ],
)
def test_server_start_refused_under_unservable_settings(server_args, message):
    with pytest.raises(ValueError, match=f"refusing to start: {message}"):
        hooks.refuse_server_config(None, server_args)


def test_server_start_allowed_without_speculative_decoding():
    for algorithm in (None, "NONE"):
        server_args = SimpleNamespace(speculative_algorithm=algorithm)
        assert hooks.refuse_server_config(None, server_args) is None


def _registered_server_check():
    (hook_type, hook, _source), = HookRegistry._hooks[plugin.SERVER_ARGS_TARGET]
    assert hook_type is HookType.AFTER
    return hook


def test_server_check_is_registered_and_refuses_speculative_decoding(monkeypatch):
    with hooks_enabled(monkeypatch):
        check = _registered_server_check()
        assert check(None, SimpleNamespace(speculative_algorithm=None)) is None
        with pytest.raises(ValueError, match="speculative_algorithm=NGRAM"):
            check(None, SimpleNamespace(speculative_algorithm="NGRAM"))


def test_original_logprobs_env_disables_patching_and_refuses_start(monkeypatch, caplog):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    forward = Sampler.__dict__["forward"]
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert list(HookRegistry._hooks) == [plugin.SERVER_ARGS_TARGET]
        assert Sampler.__dict__["forward"] is forward
        with pytest.raises(ValueError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
            _registered_server_check()(None, SimpleNamespace(speculative_algorithm=None))
    assert "NOT enabled" in caplog.text


def test_sglang_without_a_known_target_is_left_alone_and_refused(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "find_draw_target", lambda: None)
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        assert list(HookRegistry._hooks) == [plugin.SERVER_ARGS_TARGET]
        with pytest.raises(ValueError, match="has neither .*compute_logprobs .*to hook"):
            _registered_server_check()(None, SimpleNamespace(speculative_algorithm=None))
    assert "NOT enabled" in caplog.text


def test_installed_sglang_gets_the_compute_logprobs_target():
    assert plugin.find_draw_target().path == plugin.COMPUTE_LOGPROBS_TARGET


def test_sampler_output_round_trips_through_client_helper(monkeypatch):
    """SGLang turns each top-logprob row into [logprob, id, text] triples in meta_info."""
    vocab, k = 29, 3
    logits = _logits(4, vocab, seed=9)
    steps = []
    with hooks_enabled(monkeypatch):
        for step in range(6):
            torch.manual_seed(step)
            ids, output = run_sampler(logits, sampling_info([0.9] * 4), [k] * 4)
            steps.append((ids[0], output))
    meta_info = {
        "output_token_logprobs": [
            [float(out.next_token_logprobs[0]), int(token), None] for token, out in steps
        ],
        "output_top_logprobs": [
            [
                [value, token, "txt"]
                for value, token in zip(
                    out.next_token_top_logprobs_val[0].tolist(),
                    out.next_token_top_logprobs_idx[0].tolist(),
                )
            ]
            for _, out in steps
        ],
        "weight_version": "v3",
    }
    samples = parse_token_samples(meta_info, k)
    assert samples.draw_ids.shape == (6, k) and samples.weight_version == "v3"
    assert torch.equal(samples.sampled_ids, torch.stack([i for i, _ in steps]).long())
    truth = tempered_logprobs(logits[:1], [0.9])[0]
    _assert_logprobs_close(samples.draw_logprobs, truth[samples.draw_ids])


class LegacySampler:
    """The 0.5.12 - 0.5.15 call shape: forward(...) calls _attach_logprobs_to_output(...)."""

    def forward(
        self,
        logits_output,
        sampling_info,
        return_logprob,
        top_logprobs_nums,
        token_ids_logprobs,
        positions,
    ):
        logits = logits_output.next_token_logits / sampling_info.temperatures
        probs = torch.softmax(logits, dim=-1)
        next_ids = torch.multinomial(probs, 1).view(-1)
        self._attach_logprobs_to_output(
            logits_output,
            probs.log(),
            top_logprobs_nums,
            token_ids_logprobs,
            sampling_info,
            next_ids,
        )
        return next_ids

    def _attach_logprobs_to_output(
        self,
        logits_output,
        logprobs,
        top_logprobs_nums,
        token_ids_logprobs,
        sampling_info,
        batch_next_token_ids,
    ):
        if any(x > 0 for x in top_logprobs_nums):
            (
                logits_output.next_token_top_logprobs_val,
                logits_output.next_token_top_logprobs_idx,
            ) = get_top_logprobs(logprobs, top_logprobs_nums, no_copy_to_cpu=True)
        rows = torch.arange(len(batch_next_token_ids))
        logits_output.next_token_logprobs = logprobs[rows, batch_next_token_ids]


def test_legacy_attach_target_gets_sampled_then_draws():
    forward_target = f"{__name__}.LegacySampler.forward"
    attach_target = f"{__name__}.LegacySampler._attach_logprobs_to_output"
    names = ("forward", "_attach_logprobs_to_output")
    saved = {name: LegacySampler.__dict__[name] for name in names}
    HookRegistry.reset()
    HookRegistry.register(forward_target, hooks.sampler_forward_hook, HookType.AROUND)
    HookRegistry.register(attach_target, hooks.attach_logprobs_hook, HookType.AROUND)
    try:
        HookRegistry.apply_hooks()
        assert {forward_target, attach_target} <= HookRegistry._patched
        logits = _logits(len(TEMPERATURES), 23, seed=10)
        output = SimpleNamespace(next_token_logits=logits.clone())
        torch.manual_seed(11)
        next_ids = LegacySampler().forward(
            output, sampling_info(TEMPERATURES), True, NUMS, [None] * 5, torch.arange(5)
        )
    finally:
        for name, value in saved.items():
            setattr(LegacySampler, name, value)
        HookRegistry.reset()
    _assert_sampled_then_draws(output, next_ids, tempered_logprobs(logits, TEMPERATURES))


def test_truncation_problem_accepts_only_the_whole_distribution():
    assert constraints.TOP_K_ALL == TOP_K_ALL  # the plugin's copy of SGLang's constant
    assert constraints.truncation_problem(TOP_K_ALL, 1.0, 0.0) is None
    assert "top_k=7" in constraints.truncation_problem(7, 1.0, 0.0)

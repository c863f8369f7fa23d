"""The token-sample plugin against SGLang's real Sampler.forward, hook registry and params."""

from __future__ import annotations

import logging
import os
import re
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.logprob_processor import OutputLogprobProcessor, get_top_logprobs
from sglang.srt.layers.sampler import Sampler
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from fusedrl.sglang_plugin import constraints, hooks, plugin
from fusedrl.sglang_plugin.client import parse_token_samples
from sglang_harness import (
    chi_square_p_value,
    hooks_enabled,
    publish_cpu_runtime,
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
    with caplog.at_level(logging.WARNING), hooks_enabled(monkeypatch):
        assert HookRegistry._patched == {
            plugin.COMPUTE_LOGPROBS_TARGET,
            plugin.SAMPLER_FORWARD_TARGET,
            plugin.ADMISSION_TARGET,
            plugin.SCHEDULER_ADMISSION_TARGET,
            plugin.SCHEDULER_INIT_TARGET,
            plugin.SERVER_ARGS_TARGET,
        }
        assert hasattr(OutputLogprobProcessor.compute_logprobs, "__wrapped__")
        torch.manual_seed(1)
        next_ids, output = run_sampler(logits, sampling_info(TEMPERATURES), NUMS)
    # A warning, naming the process: SGLang loads plugins before it configures logging, when
    # only Python's last-resort handler (warnings and above) writes anything.
    (line,) = [r for r in caplog.records if "token samples enabled" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert f"enabled in process {os.getpid()} " in line.getMessage()
    assert f"patching {plugin.COMPUTE_LOGPROBS_TARGET}" in line.getMessage()

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
    "params, refused_row, message",
    [
        (dict(top_ks=[TOP_K_ALL, 5, TOP_K_ALL]), 1, "top_k=5 truncates"),
        (dict(top_ps=[1.0, 1.0, 0.9]), 2, r"top_p=0\.9 truncates"),
        (dict(min_ps=[0.1, 0.0, 0.0]), 0, r"min_p=0\.1 truncates"),
    ],
)
def test_truncated_row_asking_for_samples_gets_plain_top_k_and_never_raises(
    monkeypatch, caplog, params, refused_row, message
):
    """Such a row is refused at admission; reached anyway, it must not take the scheduler down:
    it keeps SGLang's top-K (which the client rejects), logged once, and the others get draws."""
    publish_cpu_runtime()  # truncated sampling reads SGLang's sampling backend ("pytorch")
    logits = _logits(3, 11, seed=7)
    nums = [2, 3, 4]
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        hooks._logged_once.clear()
        for step in range(2):
            torch.manual_seed(step)
            next_ids, output = run_sampler(logits, sampling_info([0.8] * 3, **params), nums)
    records = [r for r in caplog.records if "instead of draws" in r.getMessage()]
    assert len(records) == 1  # once per process, not once per batch
    assert f"batch row {refused_row}" in records[0].getMessage()
    assert re.search(message, records[0].getMessage())
    truth = tempered_logprobs(logits, [0.8] * 3)
    for row, k in enumerate(nums):
        ids = output.next_token_top_logprobs_idx[row]
        if row == refused_row:  # SGLang's own top-K: K entries, the K most likely tokens
            assert ids.numel() == k
            assert set(ids.tolist()) == set(truth[row].topk(k).indices.tolist())
        else:
            assert ids.numel() == 1 + k and int(ids[0]) == int(next_ids[row])


def test_greedy_batch_asking_for_samples_gets_plain_top_k(monkeypatch):
    logits = _logits(2, 13, seed=17)
    with hooks_enabled(monkeypatch):
        next_ids, output = run_sampler(logits, sampling_info([1.0, 1.0], top_ks=[1, 1]), [3, 2])
    assert [t.numel() for t in output.next_token_top_logprobs_idx] == [3, 2]
    assert torch.equal(next_ids.long(), logits.argmax(-1))


def test_top_k_at_or_above_vocabulary_size_gets_draws(monkeypatch):
    """top_k >= V truncates nothing, so those rows are served like top_k = -1."""
    publish_cpu_runtime()
    vocab = 11
    logits = _logits(3, vocab, seed=18)
    with hooks_enabled(monkeypatch):
        hooks._logged_once.clear()
        next_ids, output = run_sampler(
            logits, sampling_info([0.9] * 3, top_ks=[vocab, vocab + 7, TOP_K_ALL]), [2, 2, 2]
        )
    assert not hooks._logged_once
    truth = tempered_logprobs(logits, [0.9] * 3)
    for row in range(3):
        ids = output.next_token_top_logprobs_idx[row]
        assert ids.numel() == 3 and int(ids[0]) == int(next_ids[row])
        _assert_logprobs_close(output.next_token_top_logprobs_val[row], truth[row, ids])


def test_failing_draw_falls_back_to_top_k_without_raising(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(hooks, "draw_token_samples", broken)
    logits = _logits(len(TEMPERATURES), 37, seed=19)
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        hooks._logged_once.clear()
        _, output = run_sampler(logits, sampling_info(TEMPERATURES), NUMS)
    assert [t.numel() for t in output.next_token_top_logprobs_idx] == NUMS
    assert "drawing failed" in caplog.text and "device lost" in caplog.text


def test_truncated_row_not_asking_for_samples_is_served(monkeypatch):
    publish_cpu_runtime()
    logits = _logits(3, 11, seed=8)
    with hooks_enabled(monkeypatch):
        hooks._logged_once.clear()
        _, output = run_sampler(
            logits, sampling_info([0.8] * 3, top_ks=[TOP_K_ALL, 4, TOP_K_ALL]), [2, 0, 3]
        )
    assert [t.numel() for t in output.next_token_top_logprobs_idx] == [3, 0, 4]
    assert not hooks._logged_once


def test_watermarked_rows_are_not_served_draws():
    refused = hooks.unfaithful_rows(sampling_info([1.0] * 3), [2, 0, 1], torch.zeros(3, 4))
    assert set(refused) == {0, 2} and "watermarked" in refused[0]


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
    assert constraints.truncation_problem(50, 1.0, 0.0, vocab_size=50) is None
    assert "top_k=7" in constraints.truncation_problem(7, 1.0, 0.0)
    assert "top_k=49" in constraints.truncation_problem(49, 1.0, 0.0, vocab_size=50)
    assert "top_k=1 " in constraints.truncation_problem(1, 1.0, 0.0, vocab_size=1)


def test_both_entry_point_names_register_each_hook_once(monkeypatch):
    """The package ships `fusedrl_token_samples` and `sglang_token_samples` (the name an allow-list
    for the original plugin would carry); with SGLANG_PLUGINS unset SGLang loads both, and the
    second registration must add nothing."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins_by_group  # noqa: F401  (the loader that reads this group)

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names["fusedrl_token_samples"] == names["sglang_token_samples"] == "fusedrl.sglang_plugin.plugin:register"
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    HookRegistry.reset()
    try:
        plugin.register()
        once = {target: len(entries) for target, entries in HookRegistry._hooks.items()}
        plugin.register()
        twice = {target: len(entries) for target, entries in HookRegistry._hooks.items()}
    finally:
        HookRegistry.reset()
    assert once == twice and once[plugin.SAMPLER_FORWARD_TARGET] == 1

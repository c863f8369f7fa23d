"""Draws against SGLang's own sampling: its seeded (deterministic-inference) sampler, and the
distribution left after its penalties, logit bias and grammar mask."""

from __future__ import annotations

import pytest
import torch
import triton
from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel
from sglang.srt.constrained.base_grammar_backend import GrammarMask
import sglang.srt.layers.sampler as sampler_module

from fusedrl.sglang_plugin.draws import _murmur3
from sglang_harness import (
    batch_sampling_info,
    chi_square_p_value,
    hooks_enabled,
    make_req,
    run_sampler,
    sampling_info,
)


def _sglang_murmur_hash32(seed, positions, col_indices):
    """SGLang's own murmur3 Triton kernel, run on CPU tensors (its CPU path needs sgl_kernel,
    a CUDA-only wheel); under TRITON_INTERPRET=1 this is the interpreter."""
    rows, cols = seed.shape[0], col_indices.shape[0]
    hashed = torch.empty((rows, cols), dtype=torch.uint32)
    grid = (rows, triton.cdiv(cols, 1024))
    murmur_hash32_kernel[grid](seed, positions, col_indices, hashed, rows, cols, BLOCK_SIZE=1024)
    return hashed


@pytest.fixture
def sglang_seeded_sampler(monkeypatch):
    """SGLang's seeded sampler (`multinomial_with_seed`, uncompiled) on its own hash kernel."""
    monkeypatch.setattr(sampler_module, "murmur_hash32", _sglang_murmur_hash32)
    uncompiled = sampler_module.multinomial_with_seed._torchdynamo_orig_callable
    monkeypatch.setattr(sampler_module, "multinomial_with_seed", uncompiled)


def test_plugin_hash_is_sglang_seeded_sampler_hash():
    seeds = torch.tensor([0, 42, -1, 2**62 + 12345, -(2**63)], dtype=torch.long)
    positions = torch.tensor([0, 7, 123456, 2**31 + 5, 3], dtype=torch.long)
    columns = torch.tensor([0, 1, 5, 4095, 151_935], dtype=torch.long)
    expected = _sglang_murmur_hash32(seeds, positions, columns).long()
    assert torch.equal(_murmur3(seeds, positions, columns), expected)


def _seeded_info(temperatures, seeds):
    info = sampling_info(temperatures)
    info.sampling_seed = torch.tensor(seeds, dtype=torch.long)
    return info


def test_seeded_draws_ride_on_sglang_seeded_sampling(monkeypatch, sglang_seeded_sampler):
    """With SGLang's seeded sampler: the sampled tokens are SGLang's own (the plugin changes no
    token), the draws are a pure function of (seed, position, distribution) whatever shares the
    batch and whatever the global generator, and their logprobs are exact."""
    vocab = 29
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 2
    temperatures, seeds = [0.7, 1.0, 1.3, 0.7], [42, 7, 42, 9]
    positions = torch.tensor([5, 5, 6, 5])
    nums = [6, 6, 6, 0]
    plain_ids, _ = run_sampler(
        logits, _seeded_info(temperatures, seeds), nums, positions, deterministic=True
    )
    with hooks_enabled(monkeypatch):
        runs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            runs.append(
                run_sampler(
                    logits, _seeded_info(temperatures, seeds), nums, positions, deterministic=True
                )
            )
        alone_ids, alone = run_sampler(
            logits[2:3], _seeded_info([1.3], [42]), [3], positions[2:3], deterministic=True
        )
    (ids_a, out_a), (ids_b, out_b) = runs
    assert torch.equal(ids_a, plain_ids) and torch.equal(ids_b, plain_ids)
    for row in range(4):
        assert torch.equal(out_a.next_token_top_logprobs_idx[row], out_b.next_token_top_logprobs_idx[row])
    assert int(alone_ids[0]) == int(plain_ids[2])
    assert torch.equal(alone.next_token_top_logprobs_idx[0], out_a.next_token_top_logprobs_idx[2][:4])
    truth = torch.log_softmax(logits.double() / torch.tensor(temperatures).double().view(-1, 1), -1)
    for row in range(3):
        ids = out_a.next_token_top_logprobs_idx[row]
        assert int(ids[0]) == int(plain_ids[row])
        torch.testing.assert_close(
            out_a.next_token_top_logprobs_val[row].double(), truth[row, ids], rtol=1e-5, atol=1e-5
        )


def test_seeded_draw_frequencies_match_the_seeded_sampling_distribution(
    monkeypatch, sglang_seeded_sampler
):
    vocab, rows, k, temperature = 9, 1000, 20, 0.8  # 20000 draws; SGLang's own hash kernel runs per row
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    logits = base.expand(rows, vocab).contiguous()
    info = _seeded_info([temperature] * rows, [1234] * rows)
    with hooks_enabled(monkeypatch):
        next_ids, output = run_sampler(
            logits, info, [k] * rows, torch.arange(rows), deterministic=True
        )
    draws = torch.stack(output.next_token_top_logprobs_idx)[:, 1:]
    probs = torch.softmax(base.double() / temperature, -1)
    assert chi_square_p_value(torch.bincount(draws.flatten(), minlength=vocab), probs) > 1e-3
    assert chi_square_p_value(torch.bincount(next_ids.long(), minlength=vocab), probs) > 1e-3
    wrong = torch.softmax(base.double() / (temperature * 1.1), -1)
    assert chi_square_p_value(torch.bincount(draws.flatten(), minlength=vocab), wrong) < 1e-6


class _MaskingGrammar:
    """A grammar handle whose mask sets the masked tokens' logits to -inf, as SGLang's grammar
    backends do (their own classes need xgrammar, outlines or llguidance)."""

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        logits.masked_fill_(vocab_mask, float("-inf"))


def test_draws_follow_the_distribution_after_penalties_logit_bias_and_grammar(monkeypatch):
    """Real Reqs with frequency and presence penalties and a logit bias, two generated tokens
    fed to SGLang's penalizers, a grammar mask, all applied by SGLang's `apply_logits_bias`
    (as its model runner does before sampling): the draws follow softmax of the result over T,
    computed independently in float64, and not the distribution before post-processing."""
    vocab, rows, k, temperature = 8, 600, 30, 0.9
    frequency, presence, bias = 0.6, 0.4, {"2": 1.5, "5": -1.0}
    masked = [0, 7]
    reqs = [
        make_req(
            f"r{i}",
            vocab,
            return_logprob=True,
            top_logprobs_num=k,
            temperature=temperature,
            frequency_penalty=frequency,
            presence_penalty=presence,
            logit_bias=bias,
        )
        for i in range(rows)
    ]
    nums, info = batch_sampling_info(reqs, vocab)
    generated = [3, 3, 6]
    for token in generated:
        info.penalizer_orchestrator.cumulate_output_tokens(torch.full((rows,), token))
    vocab_mask = torch.zeros(rows, vocab, dtype=torch.bool)
    vocab_mask[:, masked] = True
    info.grammar_mask = GrammarMask(_MaskingGrammar(), vocab_mask)

    base = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    logits = base.expand(rows, vocab).contiguous()
    info.apply_logits_bias(logits)
    with hooks_enabled(monkeypatch):
        torch.manual_seed(6)
        _, output = run_sampler(logits, info, nums)
    draws = torch.stack(output.next_token_top_logprobs_idx)[:, 1:]
    counts = torch.bincount(draws.flatten(), minlength=vocab)

    counts_seen = torch.bincount(torch.tensor(generated), minlength=vocab).double()
    processed = base.double() - frequency * counts_seen - presence * (counts_seen > 0).double()
    for token, value in bias.items():
        processed[int(token)] += value
    processed[masked] = float("-inf")
    truth = torch.log_softmax(processed / temperature, -1)
    assert int(counts[masked].sum()) == 0
    kept = [t for t in range(vocab) if t not in masked]
    assert chi_square_p_value(counts[kept], truth[kept].exp()) > 1e-3
    before = torch.softmax(base.double()[kept] / temperature, -1)
    assert chi_square_p_value(counts[kept], before) < 1e-6
    values = torch.stack(output.next_token_top_logprobs_val)
    ids = torch.stack(output.next_token_top_logprobs_idx)
    torch.testing.assert_close(values.double(), truth[ids], rtol=1e-5, atol=1e-5)

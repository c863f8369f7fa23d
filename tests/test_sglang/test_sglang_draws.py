"""Seeded draws: reproducible per request whatever shares the batch, and from the right law."""

from __future__ import annotations

import struct

import torch

from fusedrl.sglang_plugin.draws import _murmur3, draw_token_samples
from sglang_harness import chi_square_p_value


def _murmur3_scalar(key: bytes) -> int:
    """Textbook murmur3_x86_32 with seed 0, one byte string at a time (independent reference)."""
    mask = 0xFFFFFFFF
    state = 0
    for (word,) in struct.iter_unpack("<I", key):
        word = (word * 0xCC9E2D51) & mask
        word = ((word << 15) | (word >> 17)) & mask
        word = (word * 0x1B873593) & mask
        state ^= word
        state = ((state << 13) | (state >> 19)) & mask
        state = (state * 5 + 0xE6546B64) & mask
    state ^= len(key)
    state ^= state >> 16
    state = (state * 0x85EBCA6B) & mask
    state ^= state >> 13
    state = (state * 0xC2B2AE35) & mask
    return state ^ (state >> 16)


def test_murmur3_matches_scalar_reference():
    seeds = torch.tensor([0, 42, -1, 2**62 + 12345, -(2**63)], dtype=torch.long)
    positions = torch.tensor([0, 7, 123456, 2**31 + 5, 3], dtype=torch.long)
    streams = torch.tensor([0, 1, 151_936, 2**32 - 1], dtype=torch.long)
    hashed = _murmur3(seeds, positions, streams)
    for i, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, stream in enumerate(streams.tolist()):
            key = struct.pack(
                "<IIII", seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position & 0xFFFFFFFF, stream
            )
            assert int(hashed[i, j]) == _murmur3_scalar(key)


def _logprobs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 1.5
    return torch.log_softmax(logits, dim=-1)


def test_seeded_draws_depend_only_on_seed_position_and_distribution():
    logprobs = _logprobs(4, 50, seed=0)
    sampled = torch.tensor([3, 1, 4, 1])
    seeds = torch.tensor([42, 7, 42, 99])
    positions = torch.tensor([10, 10, 11, 10])
    _, full = draw_token_samples(logprobs, sampled, [6, 6, 6, 6], seeds=seeds, positions=positions)
    torch.manual_seed(123)  # the global generator plays no part
    _, again = draw_token_samples(logprobs, sampled, [6, 6, 6, 6], seeds=seeds, positions=positions)
    # Row 0 alone in a batch, asking for fewer draws: the same leading draws.
    _, alone = draw_token_samples(
        logprobs[:1], sampled[:1], [3], seeds=seeds[:1], positions=positions[:1]
    )
    # Row 0's batch-mates asking for nothing change nothing either.
    _, mixed = draw_token_samples(logprobs, sampled, [6, 0, 2, 0], seeds=seeds, positions=positions)
    for row in range(4):
        assert torch.equal(full[row], again[row])
    assert torch.equal(alone[0], full[0][:4])
    assert torch.equal(mixed[0], full[0]) and torch.equal(mixed[2], full[2][:3])
    assert mixed[1].numel() == mixed[3].numel() == 0
    assert not torch.equal(full[0][1:], full[2][1:])  # another position, other draws


def test_seeded_draw_frequencies_match_distribution():
    vocab, rows, k = 12, 3000, 8
    logprobs = _logprobs(1, vocab, seed=1).expand(rows, vocab).contiguous()
    seeds = torch.full((rows,), 2024)
    positions = torch.arange(rows)
    values, ids = draw_token_samples(
        logprobs, torch.zeros(rows, dtype=torch.long), [k] * rows, seeds=seeds, positions=positions
    )
    draws = torch.stack(ids)[:, 1:]
    counts = torch.bincount(draws.flatten(), minlength=vocab)
    probs = logprobs[0].double().exp()
    assert chi_square_p_value(counts, probs) > 1e-3
    flatter = torch.softmax(logprobs[0].double() / 1.1, dim=-1)
    assert chi_square_p_value(counts, flatter) < 1e-6
    assert torch.equal(torch.stack(values)[:, 1:], logprobs.gather(1, draws))


def test_zero_probability_tokens_are_never_drawn():
    logprobs = _logprobs(3, 9, seed=2)
    logprobs[:, ::2] = torch.finfo(logprobs.dtype).min  # as SGLang's clamp leaves -inf
    sampled = torch.tensor([1, 3, 5])
    for seeds in (None, torch.tensor([1, 2, 3])):
        torch.manual_seed(0)
        _, ids = draw_token_samples(
            logprobs, sampled, [200] * 3, seeds=seeds, positions=torch.tensor([0, 1, 2])
        )
        assert all(bool((row % 2 == 1).all()) for row in ids)


def test_probabilities_input_gives_the_same_draws_and_logprobs():
    logprobs = _logprobs(3, 17, seed=3)
    sampled = torch.tensor([0, 5, 16])
    kwargs = dict(seeds=torch.tensor([5, 6, 7]), positions=torch.tensor([1, 2, 3]))
    values, ids = draw_token_samples(logprobs, sampled, [4, 2, 3], **kwargs)
    prob_values, prob_ids = draw_token_samples(
        logprobs.exp(), sampled, [4, 2, 3], logprobs_are_probs=True, **kwargs
    )
    for row in range(3):
        assert torch.equal(ids[row], prob_ids[row])
        torch.testing.assert_close(prob_values[row], values[row], rtol=1e-5, atol=1e-6)


def test_the_kernel_path_draws_what_the_torch_path_draws(monkeypatch):
    """The path CUDA rows take (the fused kernel, interpreted here) against the CPU torch path on
    the same batch: bitwise the same seeded draws and values (same hashed uniforms, a subset of
    rows with different K), and unseeded draws of tokens with mass only, with their logprobs.
    Probabilities as input (`logprobs_are_probs`) included."""
    from fusedrl.sglang_plugin import draws

    logprobs = _logprobs(5, 300, seed=4)
    logprobs[:, ::3] = float("-inf")
    sampled = torch.tensor([1, 2, 4, 5, 7])
    nums = [6, 0, 17, 1, 0]
    seeded = dict(seeds=torch.tensor([11, 12, 13, 2**40, 15]), positions=torch.tensor([0, 3, 9, 2, 8]))
    for as_probs in (False, True):
        rows = logprobs.exp() if as_probs else logprobs
        torch_path = draw_token_samples(rows, sampled, nums, logprobs_are_probs=as_probs, **seeded)
        monkeypatch.setattr(draws, "_runs_the_kernel", lambda _: True)
        kernel_path = draw_token_samples(rows, sampled, nums, logprobs_are_probs=as_probs, **seeded)
        unseeded_values, unseeded_ids = draw_token_samples(rows, sampled, nums, logprobs_are_probs=as_probs)
        monkeypatch.undo()
        for mine, theirs in zip(kernel_path, torch_path):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        for i, k in enumerate(nums):
            assert unseeded_ids[i].shape == (1 + k if k else 0,)
            if k:
                assert unseeded_ids[i][0] == sampled[i] and not (unseeded_ids[i][1:] % 3 == 0).any()
                assert torch.allclose(unseeded_values[i], logprobs[i, unseeded_ids[i]])

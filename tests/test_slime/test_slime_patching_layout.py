"""slime's CP layouts in `fusedrl.slime_ext.context_parallel` against the harness' independent
derivation (position lists of padded zigzag chunks), over the input space of sample lengths and cp
sizes; the harness' reducer against slime's formula."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fusedrl.slime_ext import context_parallel as cpl
from slime_harness import (
    make_samples,
    micro_batch,
    pack_rows,
    rank_response_positions,
    slice_per_token,
    sum_of_sample_mean,
)

LENGTHS = [(9, 4), (2, 1), (16, 15), (7, 1), (30, 11), (5, 3)]


# A sample: total length >= 2 (one prompt token at least) and a response of 0 .. total - 1 tokens.
SAMPLE = st.integers(2, 40).flatmap(lambda total: st.tuples(st.just(total), st.integers(0, total - 1)))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(SAMPLE, min_size=1, max_size=6), cp_size=st.integers(1, 4), pad_multiple=st.sampled_from([1, 8]))
@example(lengths=LENGTHS, cp_size=3, pad_multiple=8)
def test_response_rows_match_packed_positions(lengths, cp_size, pad_multiple):
    totals, responses = zip(*lengths)
    # Each packed row carries (sample, position) so the rows the layout names can be read back.
    labels = [torch.stack([torch.full((t,), i), torch.arange(t)], dim=1).double() for i, t in enumerate(totals)]
    for allgather in (False, True):
        seen = [torch.zeros(r, dtype=torch.long) for r in responses]
        for rank in range(cp_size):
            packed = pack_rows(labels, rank, cp_size, allgather_cp=allgather, pad_multiple=pad_multiple, fill=-1)
            samples = cpl.local_response_rows(
                totals, responses, rank, cp_size, allgather_cp=allgather, local_length=packed.shape[0]
            )
            for i, (sample, total, response) in enumerate(zip(samples, totals, responses)):
                read = packed[sample.rows]
                assert bool((read[:, 0] == i).all())
                assert torch.equal(read[:, 1].long() - (total - response - 1), sample.positions)
                if not allgather:
                    assert torch.equal(sample.positions, rank_response_positions(total, response, rank, cp_size))
                seen[i][sample.positions] += 1
        assert all(bool((count == 1).all()) for count in seen)  # every response position exactly once


@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_slice_response_matches_slime_batch_slicing(cp_size):
    for total, response in LENGTHS:
        x = torch.randn(response)
        for rank in range(cp_size):
            expected = slice_per_token(x, total, response, rank, cp_size)
            assert torch.equal(cpl.slice_response(x, total, response, rank, cp_size), expected)
            assert cpl.slice_response(x.tolist(), total, response, rank, cp_size) == expected.tolist()
        assert sum(len(cpl.slice_response(x, total, response, rank, cp_size)) for rank in range(cp_size)) == response


def test_zigzag_offsets_of_a_prompt_only_chunk_are_empty():
    offsets = cpl.zigzag_offsets(16, 2, cp_rank=0, cp_size=2)  # rank 0 holds tokens 0-3 and 12-15
    assert offsets.chunk_size == 4
    assert offsets.logits == ((0, 0), (13, 15))
    assert offsets.tokens == ((0, 0), (14, 16))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("cp_size", [1, 2, 3])
def test_harness_reducer_sums_over_cp_ranks_to_slimes_formula(cp_size, per_token):
    """The harness' `sum_of_sample_mean` (slime's reducer, which the loss tests hand to the losses):
    its per-rank values add up to slime's whole-sample formula."""
    totals, responses = zip(*LENGTHS)
    samples = make_samples(3, totals, responses, vocab=11)
    x_full = [torch.randn(r, dtype=torch.float64) for r in responses]
    rollout_sums = [float(s.loss_mask.sum()) + 2.0 * (i % 2) for i, s in enumerate(samples)]
    parts = []
    for rank in range(cp_size):
        batch = micro_batch(samples, rank, cp_size, rollout_mask_sums=rollout_sums)
        x = torch.cat([slice_per_token(v, t, r, rank, cp_size) for v, t, r in zip(x_full, totals, responses)])
        parts.append(sum_of_sample_mean(batch, rank, cp_size, per_token=per_token)(x))
    masks = [s.loss_mask.double() for s in samples]
    if per_token:
        whole = sum((v * m).sum() for v, m in zip(x_full, masks))
    else:
        whole = sum((v * m).sum() / max(d, 1.0) for v, m, d in zip(x_full, masks, rollout_sums))
    assert torch.allclose(sum(parts), whole, rtol=1e-12)


def test_bad_lengths_and_ranks_are_rejected():
    with pytest.raises(ValueError, match="response_length"):
        cpl.zigzag_offsets(4, 4, 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        cpl.local_response_rows([4], [2], 2, 2)
    with pytest.raises(ValueError, match="local_length"):
        cpl.local_response_rows([4], [2], 0, 2, allgather_cp=True)
    with pytest.raises(ValueError, match="rollout_mask_sums"):
        cpl.sample_denominators([torch.ones(2)], [1.0, 2.0])
    with pytest.raises(ValueError, match="response_length"):
        cpl.slice_response(torch.ones(3), 6, 2, 0, 2)

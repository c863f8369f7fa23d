"""parse_token_samples: /generate meta_info -> draw tensors, and rejection of anything else."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedrl.sglang_plugin import TokenSamples, parse_token_samples


def _meta_info(length: int, k: int, seed: int = 0) -> tuple:
    """A response as the plugin-enabled server writes it, plus the tensors it encodes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (length, 1 + k), generator=gen)
    logprobs = -torch.rand(length, 1 + k, generator=gen, dtype=torch.float64) * 8
    meta_info = {
        "output_token_logprobs": [
            [float(logprobs[t, 0]), int(ids[t, 0]), None] for t in range(length)
        ],
        "output_top_logprobs": [
            [[float(logprobs[t, j]), int(ids[t, j]), f"tok{int(ids[t, j])}"] for j in range(1 + k)]
            for t in range(length)
        ],
        "weight_version": "12",
    }
    return meta_info, ids, logprobs


def test_round_trip():
    meta_info, ids, logprobs = _meta_info(length=7, k=4)
    samples = parse_token_samples(meta_info, num_samples=4)
    assert isinstance(samples, TokenSamples)
    assert samples.draw_ids.dtype == samples.sampled_ids.dtype == torch.long
    assert samples.draw_ids.shape == samples.draw_logprobs.shape == (7, 4)
    assert torch.equal(samples.sampled_ids, ids[:, 0])
    assert torch.equal(samples.draw_ids, ids[:, 1:])
    torch.testing.assert_close(samples.draw_logprobs, logprobs[:, 1:].float())
    torch.testing.assert_close(samples.sampled_logprobs, logprobs[:, 0].float())
    assert samples.weight_version == "12"


def test_empty_response_and_missing_weight_version():
    meta_info = {"output_token_logprobs": [], "output_top_logprobs": []}
    samples = parse_token_samples(meta_info, num_samples=3)
    assert samples.draw_ids.shape == (0, 3) and samples.sampled_ids.shape == (0,)
    assert samples.weight_version is None


def _broken(edit):
    meta_info, _, _ = _meta_info(length=5, k=3, seed=1)
    meta_info = copy.deepcopy(meta_info)
    edit(meta_info)
    return meta_info


def _drop_last_draw(m):
    m["output_top_logprobs"][2].pop()


def _plain_top_k(m):  # a server without the plugin: K top tokens, no sampled token first
    m["output_top_logprobs"][0] = m["output_top_logprobs"][0][1:]


def _swap_first(m):
    row = m["output_top_logprobs"][3]
    row[0], row[1] = row[1], row[0]
    row[0][1] = m["output_token_logprobs"][3][1] + 1


def _set(path, value):
    """An edit that sets meta_info[path[0]][path[1]]... = value."""

    def edit(meta_info):
        container = meta_info
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = value

    return edit


TOP, TOKEN = "output_top_logprobs", "output_token_logprobs"
COUNT = r"expected the sampled token plus 3 draws \(4 output_top_logprobs entries\), got"


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop_last_draw, rf"position 2: {COUNT} 3"),
        (_plain_top_k, rf"position 0: {COUNT} 3"),
        (_swap_first, r"position 3: first output_top_logprobs entry is token \d+, not the sampled"),
        (_set((TOP, 1), None), rf"position 1: {COUNT} None"),
        (_set((TOP, 4, 2), [-1.0]), "position 4: malformed output_top_logprobs entry"),
        (_set((TOP, 4, 2, 1), "7"), "position 4: malformed output_top_logprobs entry"),
        (_set((TOP, 0, 1, 0), float("nan")), "position 0: malformed output_top_logprobs entry"),
        (_set((TOKEN, 2, 1), -3), "position 2: malformed output_token_logprobs entry"),
        # +inf is refused like NaN; values float32 or int64 cannot hold, with the position named
        # (before: accepted as inf, or torch's and Python's overflow errors)
        (_set((TOP, 1, 2, 0), float("inf")), r"position 1: malformed .*log-probability must be -inf or a finite number .* got inf"),
        (_set((TOKEN, 3, 0), float("inf")), r"position 3: malformed output_token_logprobs entry .* got inf"),
        (_set((TOP, 2, 1, 0), 1e39), r"position 2: malformed output_top_logprobs entry .* got 1e\+39"),
        (_set((TOP, 0, 3, 0), -(10**400)), r"position 0: malformed .*log-probability .* got -1000000000"),
        (_set((TOP, 4, 1, 1), 2**70), r"position 4: malformed .*token id must be an int in \[0, 2\*\*63\), got 1180591620717411303424"),
        (lambda m: m[TOP].pop(), "5 output_token_logprobs but 4 output_top_logprobs"),
        (lambda m: m.pop(TOP), r"meta_info\['output_top_logprobs'\] must be a list"),
        (_set((TOKEN,), None), r"meta_info\['output_token_logprobs'\] must be a list"),
    ],
)
def test_malformed_responses_are_rejected_naming_the_position(edit, message):
    with pytest.raises(ValueError, match=message):
        parse_token_samples(_broken(edit), num_samples=3)


@pytest.mark.parametrize("meta_info", [None, [], "error", 3])
def test_a_reply_without_meta_info_is_refused_naming_it(meta_info):
    """`response.get("meta_info")` of an error reply is None: a ValueError, not an AttributeError."""
    with pytest.raises(ValueError, match=rf"meta_info must be the response's meta_info mapping, got {type(meta_info).__name__}"):
        parse_token_samples(meta_info, num_samples=3)


def test_a_minus_inf_log_probability_is_a_probability_of_zero():
    meta_info = _broken(_set((TOP, 1, 2, 0), float("-inf")))
    assert parse_token_samples(meta_info, num_samples=3).draw_logprobs[1, 1] == float("-inf")


@pytest.mark.parametrize("num_samples", [0, -2, True, 2.0, None])
def test_bad_num_samples_rejected(num_samples):
    meta_info, _, _ = _meta_info(length=2, k=2)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        parse_token_samples(meta_info, num_samples=num_samples)


def _flat_meta_info(length: int, k: int, b64: bool):
    """The same response with its output top logprobs in SGLang's flat format, built by
    SGLang's own TokenizerManager helper (`return_flat_raw_output_top_logprobs`)."""
    from sglang.srt.managers.tokenizer_manager import _build_flat_top_logprobs_fields

    meta_info, ids, logprobs = _meta_info(length, k, seed=4)
    nested = meta_info.pop("output_top_logprobs")
    meta_info.update(
        _build_flat_top_logprobs_fields(
            "output",
            [[entry[0] for entry in row] for row in nested],
            [[entry[1] for entry in row] for row in nested],
            1 + k,
            return_b64=b64,
        )
    )
    return meta_info, ids, logprobs


@pytest.mark.parametrize("b64", [False, True])
def test_flat_output_format_round_trip(b64):
    meta_info, ids, logprobs = _flat_meta_info(length=6, k=3, b64=b64)
    assert "output_top_logprobs" not in meta_info
    samples = parse_token_samples(meta_info, num_samples=3)
    assert torch.equal(samples.sampled_ids, ids[:, 0])
    assert torch.equal(samples.draw_ids, ids[:, 1:])
    # b64 carries float32, the JSON lists the full float64 values
    torch.testing.assert_close(samples.draw_logprobs, logprobs[:, 1:].float())


def _skip_first_position(m):  # flat rows start after a null prefix
    m.update(
        output_top_logprobs_null_prefix=1,
        output_top_logprobs_shape=[5, 4],
        output_top_logprobs_val_flat=m["output_top_logprobs_val_flat"][4:],
        output_top_logprobs_idx_flat=m["output_top_logprobs_idx_flat"][4:],
    )


@pytest.mark.parametrize(
    "b64, edit, message",
    [
        (False, lambda m: m["output_top_logprobs_val_flat"].pop(),
         r"output_top_logprobs_val_flat'\] must be a list of 24 numbers"),
        (False, lambda m: m.update(output_top_logprobs_shape=[6, 4, 1]),
         r"output_top_logprobs_shape'\]=\[6, 4, 1\]"),
        (False, lambda m: m.update(output_top_logprobs_shape=[6, 3]),
         r"output_top_logprobs_val_flat'\] must be a list of 18 numbers"),
        (False, _skip_first_position,
         r"position 0: expected the sampled token plus 3 draws .* got 0"),
        (True, lambda m: m.update(output_top_logprobs_idx_flat_b64="@@"), "is not base64"),
        (True, lambda m: m.update(output_top_logprobs_val_flat_b64_dtype="float16"),
         r"_dtype'\]='float16', expected 'float32'"),
        (True, lambda m: m.update(output_top_logprobs_val_flat_b64="AAAA"), "holds 3 bytes"),
    ],
)
def test_malformed_flat_output_is_rejected_naming_the_field(b64, edit, message):
    meta_info, _, _ = _flat_meta_info(length=6, k=3, b64=b64)
    edit(meta_info)
    with pytest.raises(ValueError, match=message):
        parse_token_samples(meta_info, num_samples=3)

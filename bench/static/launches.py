"""The kernel launches `--static` compiles: the shipped host functions called as a trainer would,
on meta tensors of production shape, so the signatures, specialisation (16-byte alignment, i32
sizes, divisibility by 16) and launch settings (BLOCK, num_warps) are exactly what ships.

Each function takes JSON-friendly arguments and only launches; the compile step intercepts the
launch (bench/static/compile.py).
"""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _token_inputs(dtype, ids_per_row, rows, tokens, vocab):
    logits = _meta((tokens, vocab), DTYPES[dtype])
    num_out = tokens // 2 if rows else tokens
    ids = _meta((num_out, ids_per_row), torch.int64)
    selected = _meta((num_out,), torch.int64) if rows else None
    return logits, ids, selected


def token_stats_forward(dtype, ids_per_row, entropy, rows, tokens, vocab):
    from fusedrl.kernels.token_stats import row_partials

    logits, ids, selected = _token_inputs(dtype, ids_per_row, rows, tokens, vocab)
    row_partials(logits, ids, selected, 0, 1.0, entropy)


def token_stats_backward(dtype, ids_per_row, entropy, rows, tokens, vocab):
    from fusedrl.kernels.token_stats import logits_grad

    logits, ids, selected = _token_inputs(dtype, ids_per_row, rows, tokens, vocab)
    num_out = ids.shape[0]
    per_row, per_id = _meta((num_out,), torch.float32), _meta(ids.shape, torch.float32)
    softmax_state = _meta((num_out, 3), torch.float32)
    entropy_grad = per_row if entropy else None
    logits_grad(logits, logits, ids, selected, softmax_state, per_id, entropy_grad, per_id, 0, 1.0)


def _segment_inputs(dtype, channels, tokens):
    accumulate = torch.promote_types(DTYPES[dtype], torch.float32)
    values = _meta((tokens, channels), DTYPES[dtype])
    return values, _meta((tokens,), accumulate), _meta((tokens,), torch.int64), _meta((tokens // 256,), accumulate)


def segment_sum_forward(dtype, channels, tokens):
    from fusedrl.kernels.segment_sum import segment_sum_forward as forward

    forward(*_segment_inputs(dtype, channels, tokens))


def segment_sum_backward(dtype, channels, tokens):
    from fusedrl.kernels.segment_sum import values_grad

    values, mask, segments, denominators = _segment_inputs(dtype, channels, tokens)
    values_grad(_meta((channels,), mask.dtype), mask, segments, denominators, values.dtype)


def token_draws(dtype, draws, rows, vocab, probs):
    from fusedrl.kernels.token_draws import token_draws_forward

    logprobs = _meta((rows, vocab), DTYPES[dtype])
    token_draws_forward(logprobs, _meta((rows, draws), torch.float64), _meta((rows,), torch.int64), probs)

"""The token-statistics kernels compile to sm_90 cubins for every feature switch and dtype."""

from sm90 import compile_for_hopper

MODULE = "fusedrl.kernels.token_stats"


def forward_signature(dtype):
    return {
        "logits_ptr": f"*{dtype}", "stride_row": "i64", "ids_ptr": "*i64", "rows_ptr": "*i64",
        "partials_ptr": "*fp32", "vocab_local": "i32", "vocab_start": "i32", "inv_temperature": "fp32",
    }


def backward_signature(dtype):
    return {
        "grad_ptr": f"*{dtype}", "stride_grad_row": "i64", "logits_ptr": f"*{dtype}",
        "stride_row": "i64", "slots_ptr": "*i64", "ids_ptr": "*i64", "scatter_coef_ptr": "*fp32",
        "logp_grad_sum_ptr": "*fp32", "entropy_grad_ptr": "*fp32", "lse_ptr": "*fp32",
        "mean_z_ptr": "*fp32", "vocab_local": "i32", "vocab_start": "i32", "inv_temperature": "fp32",
    }


def test_kernels_compile_for_hopper():
    jobs = []
    for dtype in ["fp32", "bf16", "fp16"]:
        for num_ids, has_rows, with_entropy in [(1, False, False), (9, True, True)]:
            switches = dict(J=num_ids, HAS_ROWS=has_rows, WITH_ENTROPY=with_entropy, BLOCK_V=4096)
            for kernel, signature in [
                ("_token_stats_fwd_kernel", forward_signature(dtype)),
                ("_token_stats_bwd_kernel", backward_signature(dtype)),
            ]:
                jobs.append(dict(module=MODULE, kernel=kernel, signature=signature,
                                 constexprs=switches, num_warps=8))
    compile_for_hopper(jobs)

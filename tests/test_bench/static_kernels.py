"""Hand-written kernels whose SASS counts are known, for testing the static cost model.

Each launcher calls its kernel on meta tensors, as bench/static/launches.py does for the shipped
kernels: 1024 fp32 elements per trip, 4 warps, so 8 elements per thread per trip.
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024
WARPS = 4


@triton.jit
def _copy_trip(src_ptr, dst_ptr, n, start, offs):
    """One trip of a copy: the columns start + offs."""
    cols = start + offs
    tl.store(dst_ptr + cols, tl.load(src_ptr + cols, mask=cols < n), mask=cols < n)


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = src, one program streaming the whole vector."""
    for start in range(0, n, BLOCK):
        _copy_trip(src_ptr, dst_ptr, n, start, tl.arange(0, BLOCK))


@triton.jit
def copy_unrolled_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """The copy with its loop unrolled twice by the compiler: two source trips per SASS trip."""
    for start in tl.range(0, n, BLOCK, loop_unroll_factor=2):
        _copy_trip(src_ptr, dst_ptr, n, start, tl.arange(0, BLOCK))


@triton.jit
def copy_without_block_kernel(src_ptr, dst_ptr, n, WIDTH: tl.constexpr):
    """A copy whose tile is not named BLOCK*: the cost model cannot know its elements per trip."""
    for start in range(0, n, WIDTH):
        _copy_trip(src_ptr, dst_ptr, n, start, tl.arange(0, WIDTH))


@triton.jit
def exp_sum_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, REDUCE_IN_LOOP: tl.constexpr):
    """out = sum(exp(src)): per-thread sums reduced once after the loop, or a block-wide
    reduction in every trip."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    total = 0.0
    for start in range(0, n, BLOCK):
        cols = start + offs
        e = tl.exp(tl.load(src_ptr + cols, mask=cols < n, other=float("-inf")))
        if REDUCE_IN_LOOP:
            total += tl.sum(e, axis=0)
        else:
            acc += e
    if not REDUCE_IN_LOOP:
        total = tl.sum(acc, axis=0)
    tl.store(out_ptr, total)


def _vector(n=1 << 24):
    return torch.empty(n, dtype=torch.float32, device="meta")


def launch_copy():
    src = _vector()
    copy_kernel[(1,)](src, torch.empty_like(src), src.numel(), BLOCK=BLOCK, num_warps=WARPS)


def launch_copy_unrolled():
    src = _vector()
    copy_unrolled_kernel[(1,)](src, torch.empty_like(src), src.numel(), BLOCK=BLOCK, num_warps=WARPS)


def launch_copy_without_block():
    src = _vector()
    copy_without_block_kernel[(1,)](src, torch.empty_like(src), src.numel(), WIDTH=BLOCK, num_warps=WARPS)


def launch_exp_sum(reduce_in_loop):
    src = _vector()
    out = torch.empty(1, dtype=torch.float32, device="meta")
    exp_sum_kernel[(1,)](src, out, src.numel(), BLOCK=BLOCK, REDUCE_IN_LOOP=reduce_in_loop, num_warps=WARPS)

"""Run a function on every rank of a CPU gloo process group (tensor/context parallel tests).

Each rank is a spawned process; `fn(rank, world_size, *args)` runs after
`torch.distributed` is initialised and its return value comes back to the caller, in rank order.
"""

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, results):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results.put((rank, fn(rank, world_size, *args), None))
    except Exception:  # reported to the parent, which raises it
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args):
    """[fn(0, world_size, *args), ..., fn(world_size - 1, ...)] computed on a gloo group."""
    ctx = mp.get_context("spawn")
    results = ctx.Manager().Queue()
    mp.start_processes(
        _rank_main,
        args=(world_size, _free_port(), fn, args, results),
        nprocs=world_size,
        start_method="spawn",
    )
    by_rank = dict()
    while not results.empty():
        rank, value, error = results.get()
        if error is not None:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        by_rank[rank] = value
    return [by_rank[rank] for rank in range(world_size)]

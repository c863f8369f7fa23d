"""The tests' one distributed-worker harness: CPU gloo process groups of forked workers.

`DistributedPool(tp, cp, dp, pp, vp)`: tp * cp * dp * pp workers with `torch.distributed`
initialised and, by default, megatron-core's parallel_state for those sizes (order tp-cp-dp-pp,
as slime's train actors have it; vp: virtual pipeline stages per pipeline rank); `pool.run(fn, *args)` returns `[fn(RankInfo, *args)]` in rank order, and a failing rank
raises in the caller with its traceback. `get_pool` keeps one pool per configuration, reused by
every test, and closes the least recently used pools (never one the current test took) when the
live workers would exceed MAX_POOL_WORKERS: each worker holds about 1 GiB (torch, megatron-core,
the interpreter), and keeping every configuration's pool to the end held 22 of them, 18 of the
machine's 24 GiB. `run_on_ranks(world_size, fn, *args)`
runs `fn(rank, world_size, *args)` once on fresh workers without Megatron, for tests that set up
their own groups.

Workers run on CPU, in the Triton interpreter, also in a FUSEDRL_TEST_DEVICE=cuda session: gloo
has no CUDA collectives, so tests on these groups stay on CPU (single-rank loss tests run on the
test device in the test process instead: `slime_harness.run_loss_on_ranks`).

megatron-core's schedules and pipeline communication allocate on the CUDA device by name
(`torch.zeros(..., device="cuda")`, `torch.cuda.current_device()`, `weight.data.cuda()`,
`torch.cuda.synchronize()`); on these CPU workers `cuda_on_cpu()` is the test-only stand-in for that
device (see its docstring).

Workers fork from multiprocessing's fork server, not from the test process: a fork after the test
process has run torch's OpenMP thread pool can deadlock the child's first parallel op, and the fork
server never runs a torch op. It imports WORKER_IMPORTS once, with the Triton interpreter on, so a
worker starts in well under a second where a spawned one re-imported torch and megatron-core
(seconds of a busy core each, for every worker of every pool), and the workers share those pages.
Results cross processes detached (autograd graphs do not), pickled in the worker so that one that
cannot cross fails its task, not the queue.
"""

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import tempfile
import traceback
import warnings
from typing import NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode


class RankInfo(NamedTuple):
    """Where a worker sits in the megatron-core layout (order tp-cp-dp-pp)."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    vp_size: Optional[int] = None


def _detached(value):
    """The value with every tensor detached (autograd graphs do not cross processes)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, tuple):
        return type(value)(*(_detached(v) for v in value))
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensors megatron-core asks for on "cuda" (a factory's `device=` argument, `Tensor.cuda()`)
    made or kept on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _NoStream:
    """`torch.cuda.current_stream()` on the CPU: gloo's collectives are synchronous, nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


@contextlib.contextmanager
def cuda_on_cpu():
    """Test-only stand-in for the CUDA device megatron-core's schedules, pipeline communication and
    shared-embedding setup use by name: inside it, "cuda" tensors are CPU tensors,
    `torch.cuda.current_device()` is "cpu", and `torch.cuda.synchronize()` and the streams of
    `torch.cuda.current_stream()` (megatron-core 0.19's grad sync) do nothing (gloo's collectives are
    synchronous). Without it megatron-core 0.16's `forward_backward_no_pipelining` stops at
    `torch.zeros([], dtype=torch.int, device="cuda")`: "RuntimeError: Found no NVIDIA driver on your
    system"; 0.19's `start_grad_sync` at `torch.cuda.current_stream()`: "AssertionError: Torch not
    compiled with CUDA enabled"."""
    names = ("current_device", "synchronize", "current_stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = lambda device=None: _NoStream()
    try:
        with _CudaFactoriesOnCpu():
            yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def _parallel_state():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
    return parallel_state


def _rank_info(rank, world_size, tp, cp, pp, vp, megatron) -> RankInfo:
    if not megatron:
        return RankInfo(rank, world_size, 0, 1, 0, 1, rank, world_size)
    parallel_state = _parallel_state()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, create_gloo_process_groups=False,
    )  # fmt: skip
    return RankInfo(
        rank,
        world_size,
        parallel_state.get_tensor_model_parallel_rank(),
        tp,
        parallel_state.get_context_parallel_rank(),
        cp,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        pp,
        vp,
    )


def _worker(rank, world_size, init_file, sizes, megatron, tasks, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    info = _rank_info(rank, world_size, *sizes, megatron)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, pickle.dumps(_detached(fn(info, *args))), None))
        except BaseException:  # reported to the parent, which raises it
            results.put((rank, None, traceback.format_exc()))
    # Every result has been taken (the parent sends None after the last), so no collective is in
    # flight: the worker ends without destroy_process_group, which with the many gloo groups slime
    # and megatron-core create waits on its peers until close() kills it (30 s per worker).
    results.close()
    results.join_thread()  # this worker's results are in the pipe before it ends
    os._exit(0)


# What every worker imports, loaded once in the fork server (installed modules only: Python 3.11's
# fork server does not take the test process's sys.path for its preload).
WORKER_IMPORTS = ["torch", "torch.distributed", "megatron.core.parallel_state", "fusedrl.kernels"]


def _fork_server():
    """multiprocessing's fork-server context, its server started with WORKER_IMPORTS loaded. The
    server takes the environment of its start: the Triton interpreter is on there (workers run on
    CPU, also in a FUSEDRL_TEST_DEVICE=cuda session whose test process compiles the kernels)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_IMPORTS)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return ctx


class DistributedPool:
    """World of tp * cp * dp * pp CPU workers on one gloo group (megatron-core
    parallel_state initialised unless `megatron=False`; vp virtual stages per pipeline rank)."""

    def __init__(self, tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1, vp: Optional[int] = None, *,
                 megatron: bool = True, timeout: float = 1200.0):  # fmt: skip
        self.world_size = tp * cp * dp * pp
        self.timeout = timeout
        ctx = _fork_server()
        self._init_file = tempfile.mktemp(prefix="fusedrl_gloo_")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, self._init_file, (tp, cp, pp, vp), megatron, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args) -> list:
        """[fn(RankInfo, *args)] on every rank, in rank order; a failing rank raises here."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        by_rank, errors = {}, []
        for _ in range(self.world_size):
            try:
                rank, value, error = self._results.get(timeout=self.timeout)
            except queue.Empty:  # a rank waits forever on one that failed: say which failed, and how
                waiting = sorted(set(range(self.world_size)) - set(by_rank))
                raise RuntimeError("\n".join([f"ranks {waiting} gave no result in {self.timeout:.0f} s", *errors])) from None
            if error is not None:
                errors.append(f"rank {rank} failed:\n{error}")
            by_rank[rank] = None if value is None else pickle.loads(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return [by_rank[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        for tasks in self._tasks:
            tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if os.path.exists(self._init_file):
            os.remove(self._init_file)


MAX_POOL_WORKERS = 8
_POOLS = {}  # configuration -> pool, least recently used first
_TEST = {"current": 0, "last_use": {}}  # the running test's number; configuration -> test that last took it


def begin_test() -> None:
    """A new test starts (conftest's autouse fixture): pools it takes are kept until it ends."""
    _TEST["current"] += 1


def get_pool(tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1, vp: Optional[int] = None) -> DistributedPool:
    """The Megatron pool for this configuration, started on first use, closed when evicted or at exit."""
    key = (tp, cp, dp, pp, vp)
    pool = _POOLS.pop(key, None)
    if pool is None:
        _evict_for(tp * cp * dp * pp)
        pool = DistributedPool(tp, cp, dp, pp, vp)
    _POOLS[key] = pool
    _TEST["last_use"][key] = _TEST["current"]
    return pool


def _evict_for(new_workers: int) -> None:
    """Close least recently used pools, none the current test took, until the new one fits."""
    for key in list(_POOLS):
        if sum(pool.world_size for pool in _POOLS.values()) + new_workers <= MAX_POOL_WORKERS:
            return
        if _TEST["last_use"][key] != _TEST["current"]:
            _POOLS.pop(key).close()


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def _with_rank(info: RankInfo, fn, *args):
    return fn(info.rank, info.world_size, *args)


def run_on_ranks(world_size: int, fn, *args):
    """[fn(0, world_size, *args), ..., fn(world_size - 1, ...)] on fresh workers of one gloo group
    without Megatron (the function sets up whatever it needs; nothing outlives the call)."""
    pool = DistributedPool(dp=world_size, megatron=False)
    try:
        return pool.run(_with_rank, fn, *args)
    finally:
        pool.close()

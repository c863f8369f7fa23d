"""Peak memory a computation allocates beyond what was live when it started.

On a GPU this is the caching allocator's own account (`torch.cuda.max_memory_allocated`). On CPU
there is no such counter, so a dispatch mode keeps a tally: every aten result whose storage is new
(not an input's, not a view) is an allocation, alive until its storage is freed (a weak reference to
the storage tells). The tally is sampled after every operator, so temporaries an operator frees
before returning are not seen; Triton kernels allocate nothing themselves (their host code does,
through aten, and is seen).
"""

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ..cpu_meters.aten_ops import package_op_body, relabels_memory, tensors_in


class CudaMemory:
    """Live and peak bytes allocated on the current CUDA device since `__enter__`."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        return False

    def live(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.base

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - self.base

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


class TensorTally(TorchDispatchMode):
    """Live and peak bytes of tensor storage created by aten operators since `__enter__`."""

    def __init__(self):
        super().__init__()
        self._storages = {}  # data_ptr -> (weak reference, bytes)
        self._peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = package_op_body(func)
        if body is not None:
            with self:
                return body(*args, **(kwargs or {}))
        result = func(*args, **(kwargs or {}))
        if not relabels_memory(func):
            inputs = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
            for out in tensors_in(result):
                self._remember(out.untyped_storage(), inputs)
        self._peak = max(self._peak, self.live())
        return result

    def _remember(self, storage, inputs):
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in inputs:
            return
        known = self._storages.get(key)
        if known is None or known[0].expired():
            self._storages[key] = (StorageWeakRef(storage), storage.nbytes())

    def live(self) -> int:
        self._storages = {k: v for k, v in self._storages.items() if not v[0].expired()}
        return sum(nbytes for _, nbytes in self._storages.values())

    def peak(self) -> int:
        return self._peak

    def live_storages(self) -> set:
        """data_ptr of every storage made since `__enter__` that is still alive."""
        return {key for key, (ref, _) in self._storages.items() if not ref.expired()}

    def reset_peak(self) -> None:
        self._peak = self.live()


def memory_meter(device: torch.device):
    """The meter for `device`: the allocator's counters on CUDA, the aten tally on CPU."""
    return CudaMemory() if device.type == "cuda" else TensorTally()

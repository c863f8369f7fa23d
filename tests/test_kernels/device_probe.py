"""Which device the tensors a test hands the kernels are on, checked without a GPU.

Under FUSEDRL_TEST_DEVICE=cuda a test that forgets to move an input to its `device` fixture
still passes: CPU tensors outside the Triton interpreter take the float64 reference, which the
test then compares with itself. `DeviceProbe` records every call of a `fusedrl::` op made while
it is active (autograd's backward excepted: it runs inside `torch.autograd.grad`), with the
tensor arguments that are not on the probed device.

On a GPU the probed device is the real one. On CPU it is `STAND_IN` (the meta device, which no
test uses on its own), emulated by the probe: the data stays on CPU, and the probe follows which
tensors are "on" the stand-in, keeping to what CUDA allows:

- a move to it (`.to(STAND_IN)`) or a factory call on it (`device=STAND_IN`) gives a CPU tensor
  on the stand-in; so does any torch call with an input on it, except moves back to CPU
  (`.cpu()`, `.to("cpu")`), which give a fresh tensor that is not; an in-place call leaves its
  tensor where it was; `.device` of a tensor on the stand-in reads `STAND_IN`;
- what CUDA refuses raises RuntimeError: one call mixing tensors on the stand-in with CPU
  tensors of one or more dimensions (0-dim CPU tensors may be mixed in, as Python numbers; CPU
  indices and copies across are allowed), a CPU generator for a factory call on the stand-in,
  `.numpy()` of a tensor on it.
"""

import weakref
from typing import List, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

STAND_IN = torch.device("meta")
CPU = torch.device("cpu")

_DEVICE_GET = torch.Tensor.device.__get__
_MIXING_ALLOWED = (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_)
_AUTOGRAD = (torch.autograd.grad, torch.Tensor.backward)


class OpCall(NamedTuple):
    """One call of a fusedrl op: its name and its tensor arguments off the probed device."""

    op: str
    strays: List[str]


def _is_device(value) -> bool:
    return isinstance(value, (torch.device, str))


def _as_device(value) -> torch.device:
    return torch.device(value) if isinstance(value, str) else value


def _describe(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} {tuple(tensor.shape)}"


class DeviceProbe(TorchFunctionMode):
    """`with DeviceProbe(device) as probe:` records `probe.calls` (see the module docstring);
    `device` is a CUDA device or `STAND_IN`."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.emulated = device == STAND_IN
        self.calls: List[OpCall] = []
        self._on_stand_in = {}  # id -> weak reference, for the tensors on the stand-in

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "fusedrl":
            strays = [_describe(t) for t in self._tensors((args, kwargs)) if not self.holds(t)]
            self.calls.append(OpCall(str(func), strays))
        if not self.emulated:
            return func(*args, **kwargs)
        return self._emulated(func, args, kwargs)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is on the probed device."""
        if not self.emulated:  # torch.device("cuda") stands for any index
            on = tensor.device
            return on.type == self.device.type and self.device.index in (None, on.index)
        reference = self._on_stand_in.get(id(tensor))
        return reference is not None and reference() is tensor

    def _emulated(self, func, args, kwargs):
        if func == _DEVICE_GET:
            return STAND_IN if self.holds(args[0]) else func(*args)
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            return self._move(func, args, kwargs)
        if _is_device(kwargs.get("device")) and _as_device(kwargs["device"]) == STAND_IN:
            return self._factory(func, args, kwargs)
        tensors = self._tensors((args, kwargs))
        on = [t for t in tensors if self.holds(t)]
        if not on:
            return func(*args, **kwargs)
        if func == torch.Tensor.numpy:
            raise TypeError("can't convert a tensor on the stand-in device to numpy (as for cuda): use .cpu() first")
        if func not in _MIXING_ALLOWED + _AUTOGRAD:
            cpu = [_describe(t) for t in tensors if not self.holds(t) and t.dim() > 0]
            if cpu:
                raise RuntimeError(
                    f"{getattr(func, '__name__', func)}: expected all tensors to be on the same device, "
                    f"got tensors on the stand-in device and CPU tensors {cpu} (CUDA refuses this)"
                )
        result = func(*args, **kwargs)
        if not (args and result is args[0]):  # an in-place call leaves its tensor where it was
            self._put_on_stand_in(result)
        return result

    def _move(self, func, args, kwargs):
        source, target = args[0], self._target(func, args, kwargs)
        if target == STAND_IN:  # the same call with CPU in place of the target
            def on_cpu(value):
                return CPU if _is_device(value) or isinstance(value, torch.Tensor) else value

            result = func(source, *map(on_cpu, args[1:]), **{k: on_cpu(v) for k, v in kwargs.items()})
            if result is source and not self.holds(source):
                result = source.clone()  # a move makes a new tensor
            self._put_on_stand_in(result)
            return result
        result = func(*args, **kwargs)
        if target is None:  # a dtype change only: stays where it is
            if self.holds(source) and result is not source:
                self._put_on_stand_in(result)
            return result
        return result.clone() if result is source and self.holds(source) else result

    def _target(self, func, args, kwargs):
        """Where `.to(...)` or `.cpu()` moves its tensor (None: a dtype change only)."""
        if func == torch.Tensor.cpu:
            return CPU
        for value in (*args[1:], kwargs.get("device"), kwargs.get("other")):
            if _is_device(value):
                return _as_device(value)
            if isinstance(value, torch.Tensor):
                return STAND_IN if self.holds(value) else value.device
        return None

    def _factory(self, func, args, kwargs):
        generator = kwargs.get("generator")
        if generator is not None and generator.device != STAND_IN:
            raise RuntimeError(f"expected a generator on the stand-in device, got one on {generator.device} (as cuda does)")
        result = func(*args, **dict(kwargs, device=CPU))
        self._put_on_stand_in(result)
        return result

    def _put_on_stand_in(self, value) -> None:
        for tensor in self._tensors(value):
            self._on_stand_in[id(tensor)] = weakref.ref(tensor)

    @staticmethod
    def _tensors(value) -> list:
        return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


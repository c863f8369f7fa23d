"""The parity tests hand the kernels tensors on their `device` fixture's device, checked here on
any machine: a test that left its inputs on CPU would, under FUSEDRL_TEST_DEVICE=cuda, compare the
float64 reference with itself and pass.

Every test of the LM-head, token-statistics, segmented-sum and token-draws parity files that takes `device`
(and nothing but its parametrized arguments) runs again under `device_probe.DeviceProbe`: the LM
head's once per parametrization (their `rows` and chunking take different paths), the others once
(their parameters are shapes and dtypes), with `device` = the stand-in device on CPU (the probe
emulates it) or the GPU in a CUDA session. Each must pass, call at least one fusedrl op, and hand
every op only tensors on that device. Their other tests (bad input, parametrizations on the
float64 reference) run under the probe too and must call no op: a test that runs a kernel takes
the fixture. The probe itself is checked on a test body that keeps its LM head on CPU and on what
CUDA refuses.
"""

import itertools

import pytest
import test_linear_token_stats
import test_segment_sum
import test_token_draws
import test_token_stats
import test_token_stats_masked
import test_token_stats_scale
import torch
from device import DEVICE, ON_GPU
from device_probe import CPU, STAND_IN, DeviceProbe
from lm_head_cases import head_with_grad, random_layer
from token_stats_cases import make_ids

from fusedrl.kernels import linear_token_stats

PROBED = DEVICE if ON_GPU else STAND_IN
MODULES = {  # module: every parametrization (else the first that runs a kernel)
    test_linear_token_stats: True,
    test_token_stats: False,
    test_token_stats_masked: False,
    test_token_stats_scale: False,
    test_segment_sum: False,
    test_token_draws: False,
}
NOT_PROBED = {
    "test_tp_rank_with_an_all_minus_inf_shard": "launches the kernels through the host functions, not the ops",
    "test_two_rank_combine_fp32_no_worse_than_eager": "launches the kernels through the host functions, not the ops",
    "test_kernels_compile_for_hopper": "compiles for sm_90 and runs nothing (10 s)",
    "test_meta_tensors_get_shapes_with_the_value_checks_on": "meta tensors: the ops' fake implementations, no device",
    "test_meta_tensors_get_the_ids_shape": "meta tensors: the op's fake implementation, no device",
    "test_kernels_compile_for_hopper_streaming_without_spills": "compiles for sm_90 and runs nothing",
}


def parametrizations(test) -> list:
    """Every combination of a test function's `parametrize` marks, as keyword arguments."""
    axes = []
    for mark in reversed(getattr(test, "pytestmark", [])):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        values = [getattr(v, "values", v) if hasattr(v, "marks") else v for v in mark.args[1]]
        axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in values])
    return [dict(item for part in combo for item in part.items()) for combo in itertools.product(*axes)]


def picks_the_reference(kwargs) -> bool:
    """A parametrization that runs the float64 reference in place of the kernels (it calls no op)."""
    return any(getattr(value, "__module__", None) == "fusedrl.kernels.reference" for value in kwargs.values())


def probed_tests():
    """pytest params (test, keyword arguments, whether it runs a kernel) for the probed tests: those
    whose arguments are `device` and their parametrized ones, or the parametrized ones alone."""
    found = []
    for module, every in MODULES.items():
        for name, test in vars(module).items():
            if not name.startswith("test_") or not callable(test) or name in NOT_PROBED:
                continue
            arguments = set(test.__code__.co_varnames[: test.__code__.co_argcount])
            cases = parametrizations(test)
            kernel_cases = [kwargs for kwargs in cases if not picks_the_reference(kwargs)]
            for index, kwargs in enumerate(cases if every else kernel_cases[:1] or cases[:1]):
                if arguments - {"device"} != set(kwargs):
                    continue  # another fixture (monkeypatch: the CPU-only dispatch tests)
                if "device" in arguments:
                    kwargs = dict(kwargs, device=PROBED)
                kernels = "device" in arguments and not picks_the_reference(kwargs)
                found.append(pytest.param(test, kwargs, kernels, id=f"{module.__name__}::{name}[{index}]"))
    return found


@pytest.mark.parametrize("test,kwargs,kernels", probed_tests())
def test_every_kernel_call_of_a_parity_test_is_on_its_device(test, kwargs, kernels):
    with DeviceProbe(PROBED) as probe:
        test(**kwargs)
    if not kernels:  # a test that runs a kernel must take the device fixture
        assert probe.calls == [], "a test without the device fixture (or on the reference) called fusedrl ops"
        return
    assert probe.calls, "the test called no fusedrl op"
    strays = [call for call in probe.calls if call.strays]
    assert not strays, f"fusedrl ops got tensors off {PROBED}: {strays}"


def lm_head_left_on_cpu(device):
    """test_linear_token_stats.py's parity call as it was before the fixture: no `device=`."""
    gen = torch.Generator().manual_seed(1)
    hidden, weight = random_layer(6, 8, 50, torch.float32, gen)
    head_with_grad(linear_token_stats, hidden, weight, make_ids(6, 50, 2, gen), with_entropy=True)


@pytest.mark.skipif(ON_GPU, reason="the CPU run is the check: in a CUDA session CPU tensors never reach the ops")
def test_the_probe_finds_an_lm_head_left_on_cpu():
    with DeviceProbe(STAND_IN) as probe:
        lm_head_left_on_cpu(STAND_IN)
    assert [call.op for call in probe.calls] == ["fusedrl.linear_token_stats.default"]
    assert probe.calls[0].strays == ["torch.float32 (6, 8)", "torch.float32 (50, 8)", "torch.int64 (6, 2)"]


def test_the_stand_in_keeps_to_what_cuda_allows():
    with DeviceProbe(STAND_IN) as probe:
        x = torch.randn(3, 4).to(STAND_IN)
        assert x.device == STAND_IN and (x * 2 + 1).t().device == STAND_IN
        assert torch.zeros(2, device=STAND_IN).device == STAND_IN
        assert x.cpu().device == CPU and x.to("cpu", torch.float64).device == CPU and x.double().device == STAND_IN
        assert (x * torch.tensor(2.0)).device == STAND_IN  # a 0-dim CPU tensor mixes in
        assert x[torch.tensor([0, 2])].device == STAND_IN  # CPU indices are fine
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.randn(3, 4)
        with pytest.raises(RuntimeError, match="generator"):
            torch.randn(3, generator=torch.Generator(), device=STAND_IN)
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
    assert probe.calls == []

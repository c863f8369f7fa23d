"""The rivals of the fused LM head (bench/rivals): verl's linear cross-entropy (its weight gradient
returned, or added to main_grad as megatron-core does) and Liger's fused linear losses, run by the bench on its LM-head workload and checked against float64.

fp32 is held to 1e-5 (relative, with the workload's floor), bf16 to three times the unfused eager
path's error on the same inputs: enough to catch a rival wired wrong (an unapplied temperature, a
transposed weight, a dropped entropy gradient give errors of order 1), not a judgement of its
accuracy, which `python -m bench` measures. The rivals are dependencies of the bench
(.ci/install-test-deps.sh installs them); where one is missing the test of it is skipped.
"""

import pytest
import torch
from bench_package import import_bench

import_bench()
from bench.__main__ import main as bench_main  # noqa: E402
from bench.harness.measure import measure_case, profile  # noqa: E402
from bench.subjects import Unavailable, make_subjects, refusal_notes  # noqa: E402
from bench.workloads.linear_token_stats import LinearCase, LinearWorkload  # noqa: E402

RIVALS = ("verl", "liger_flce", "liger_scaled")  # verl_main_grad: verl's, added to main_grad (tested below)
CPU = torch.device("cpu")


def _subject(name):
    subjects, notes = make_subjects([name], CPU)
    if not subjects:
        pytest.skip("; ".join(notes))
    return subjects[0]


def _case(name, dtype):
    """T and V/tp off the kernels' blocks, H = 128 (verl asserts H % 128 == 0); a temperature and
    the entropy where the rival takes them."""
    sampled_only = name == "liger_flce"
    return LinearCase(16, 700, dtype, 1, not sampled_only, 1.0 if sampled_only else 0.7, 128)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", RIVALS)
def test_rival_matches_float64(name, dtype):
    subject, eager = _subject(name), _subject("eager")
    case = _case(name, dtype)
    for seed in (0, 1):
        workload = LinearWorkload.make(case, CPU, seed=seed)
        error = profile(subject, workload, count_bytes=False)["fwd+bwd"]["error"]
        bar = 1e-5 if dtype == "fp32" else 3 * profile(eager, workload, count_bytes=False)["fwd+bwd"]["error"]
        assert error < bar, (name, dtype, seed, error, bar)


def test_verl_gemms_are_counted_in_the_interpreter():
    """verl's logits GEMMs are Triton `tl.dot`s (none of them an aten operator): the forward's count
    is at least one GEMM of the logits' size, whole tiles included."""
    case = _case("verl", "fp32")
    figures = profile(_subject("verl"), LinearWorkload.make(case, CPU), count_bytes=False)
    assert figures["fwd"]["gemm_flops"] >= 2 * case.tokens * case.vocab * case.hidden


def test_verl_main_grad_adds_verls_weight_gradient_to_main_grad_as_megatrons_hook_does():
    """verl_main_grad: d hidden as verl's, no d weight returned, and the workload's fp32 main_grad
    holding verl's bf16 weight gradient, widened exactly (added once to zeros)."""
    verl, into_main_grad = _subject("verl"), _subject("verl_main_grad")
    workload = LinearWorkload.make(_case("verl", "bf16"), CPU)
    layer = workload.leaf()
    grad_hidden, grad_weight = workload.backward(layer, verl.run(layer, workload))
    layer = workload.leaf()  # main_grad zeroed
    grads = workload.backward(layer, into_main_grad.run(layer, workload))
    assert grads[1] is None and torch.equal(grads[0], grad_hidden)
    assert workload.main_grad.dtype == torch.float32 and torch.equal(workload.main_grad, grad_weight.float())


def test_rivals_refuse_what_they_cannot_run():
    """One id per row: J = 1 + K is "not supported", with the reason, and so are the entropy and a
    temperature for Liger's fused linear cross entropy."""
    subjects = [_subject(name) for name in RIVALS]
    several_ids = LinearCase(16, 700, "fp32", 3, True, 0.7, 128)
    entropy = LinearCase(16, 700, "fp32", 1, True, 1.0, 128)
    assert not any(subject.covers(several_ids) for subject in subjects)
    notes = refusal_notes([several_ids, entropy], subjects)
    for name in RIVALS:
        assert any(note.startswith(f"{name}: not supported, takes one id per row") for note in notes), notes
    assert any(note.startswith("liger_flce: not supported, returns no entropy") for note in notes), notes
    odd_width = LinearCase(16, 700, "fp32", 1, True, 1.0, 96)
    assert "hidden % 128" in refusal_notes([odd_width], subjects[:1])[0]


class _CpuOnlyNvtx:
    """torch.cuda.nvtx's module-level `_nvtx` as a CPU-only torch build has it (`_NVTXStub`)."""

    @staticmethod
    def _fail(*args, **kwargs):
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    rangePushA = rangePop = markA = _fail


def test_a_rival_this_build_cannot_run_is_a_note_not_the_end_of_the_run(monkeypatch, tmp_path, capsys):
    """On a CPU-only torch build verl's forward opens `torch.cuda.nvtx.range`, which raises: the run
    goes on, the other subjects are measured, and verl's rows are a note saying why."""
    _subject("verl")  # skips where verl is not installed
    monkeypatch.setattr(torch.cuda.nvtx, "_nvtx", _CpuOnlyNvtx())
    records = bench_main(["--device", "cpu", "--op", "linear_token_stats", "-T", "8", "-V", "300", "--dtype", "fp32",
                          "-J", "1", "--entropy", "on", "--phase", "fwd+bwd", "--subjects", "eager", "verl",
                          "--results-dir", str(tmp_path)])  # fmt: skip
    assert {record["subject"] for record in records} == {"fused", "eager"}
    out = capsys.readouterr().out
    assert ("note: verl: unavailable (RuntimeError: NVTX functions not installed. Are you sure you have a CUDA "
            "build?): lm D=256 T=8 V=300 fp32 J=1 +H") in out  # fmt: skip


def test_the_package_s_own_errors_end_the_run(monkeypatch):
    """Only a peer's RuntimeError becomes a note: the package's own subjects raise as they are."""

    def broken(layer, workload):
        raise RuntimeError("a bug of the package")

    fused = _subject("fused")
    monkeypatch.setitem(fused.runs, "linear_token_stats", broken)
    with pytest.raises(RuntimeError, match="a bug of the package"):
        measure_case(LinearWorkload.make(_case("verl", "fp32"), CPU), [fused], unavailable=Unavailable())

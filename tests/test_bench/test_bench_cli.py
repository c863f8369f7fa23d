"""`python -m bench` as a newcomer meets it: usage errors that name the option instead of
tracebacks, help with defaults, a refusal before allocating more memory than the machine has,
progress with an estimate of the time left, and a chart of bounded size that says what it shows."""

import io

import pytest
import torch
from bench_package import import_bench

import_bench()
from bench.__main__ import build_parser, parse_args  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from bench.cases import CPU_GRID, GPU_GRID, Case, SegmentCase  # noqa: E402
from bench.harness.budget import estimated_peak_bytes, oversized_message  # noqa: E402
from bench.harness.progress import Progress  # noqa: E402
from bench.report import figure  # noqa: E402


@pytest.mark.parametrize(
    "argv, option, problem",
    [
        (["-T", "0"], "--tokens/-T", "must be >= 1, got 0"),
        (["-T", "8", "-4"], "--tokens/-T", "must be >= 1, got -4"),
        (["-V", "0"], "--vocab/-V", "must be >= 1, got 0"),
        (["--vocab", "-300"], "--vocab/-V", "must be >= 1, got -300"),
        (["-J", "0"], "--ids-per-row/-J", "must be >= 1, got 0"),
        (["-T", "1.5"], "--tokens/-T", "must be a whole number >= 1, got '1.5'"),
        (["--temperature", "0"], "--temperature", "must be finite and > 0, got 0"),
        (["--temperature", "-1"], "--temperature", "must be finite and > 0, got -1"),
        (["--temperature", "inf"], "--temperature", "must be finite and > 0, got inf"),
        (["--temperature", "warm"], "--temperature", "must be a number > 0, got 'warm'"),
        (["--dtype", "fp64"], "--dtype", "invalid choice: 'fp64'"),
        (["--entropy", "yes"], "--entropy", "invalid choice: 'yes'"),
        (["--static", "--arch", "sm_70"], "--arch", "unknown arch sm_70; choose from sm_80,sm_90,sm_100,sm_103,sm_120"),
        (["--static", "--arch", ","], "--arch", "unknown arch ','"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_option(capsys, argv, option, problem):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert f"argument {option}: {problem}" in capsys.readouterr().err


def test_op_defaults_are_the_timed_ops_and_with_static_every_modelled_kernel(tmp_path):
    results = ["--results-dir", str(tmp_path)]
    assert parse_args(["--device", "cpu", *results]).op == ["token_stats", "segment_sum"]
    assert parse_args(["--static", *results]).op == ["token_stats", "segment_sum", "token_draws"]
    assert parse_args(["--static", "--op", "token_draws", *results]).op == ["token_draws"]


def test_a_temperature_the_kernels_do_not_answer_is_a_usage_error(capsys, tmp_path):
    """Checked before any case runs (it was a ValueError traceback from inside the first case)."""
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--device", "cpu", "--temperature", "1e10", "--results-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "argument --temperature: must lie in [1e-06, 1e+06], got 1e+10" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "argument --device: cuda, but torch" in capsys.readouterr().err


def test_gpu_run_under_the_interpreter_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit):
        parse_args(["--device", "auto"])
    assert "unset TRITON_INTERPRET=1" in capsys.readouterr().err


def test_results_dir_that_is_a_file_is_a_usage_error(capsys, tmp_path):
    existing = tmp_path / "results.csv"
    existing.write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--results-dir", str(existing)])
    assert f"argument --results-dir: {existing} exists and is not a directory" in capsys.readouterr().err


def test_results_dir_that_cannot_be_created_is_a_usage_error_before_any_case(capsys, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr("bench.__main__.measure_case", lambda *a, **k: pytest.fail("a case ran"))
    with pytest.raises(SystemExit):
        bench_main(["--device", "cpu", "-T", "8", "-V", "300", "--results-dir", str(blocker / "results")])
    assert f"argument --results-dir: cannot create {blocker / 'results'}" in capsys.readouterr().err


def test_every_option_has_help_that_states_its_default():
    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        assert "default:" in action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    assert "%(default)" not in text and "default: auto" in text and "default: 1.0" in text


def test_memory_estimate_bounds_the_largest_case_and_refuses_with_the_numbers():
    big = Case(16384, 151936, "fp32", 1, False)  # the README's GPU example: 10 GB of logits
    assert estimated_peak_bytes(big) >= 4 * big.input_bytes
    assert estimated_peak_bytes(SegmentCase(4096)) > SegmentCase(4096).floor_bytes("fwd+bwd")
    cases = [Case(32, 4748, "fp32", 1, False), big, SegmentCase(4096)]
    message = oversized_message(cases, available=16 * 10**9, device_type="cpu")
    assert message.startswith("case T=16384 V=151936 fp32 J=1 needs about")
    assert "16.0 GB available in RAM" in message and "-T/--tokens" in message
    assert oversized_message(cases, available=10**12, device_type="cpu") is None
    assert oversized_message(CPU_GRID.cases(), available=8 * 10**9, device_type="cpu") is None  # --full fits a laptop
    assert oversized_message(GPU_GRID.cases(), available=139 * 2**30, device_type="cuda") is None  # and --full an H200


def test_oversized_cpu_run_refuses_before_allocating(tmp_path):
    # The README's GPU example (64.7 GB at peak) scaled up past any machine's RAM.
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--device", "cpu", "-T", "1000000", "-V", "1000000", "--results-dir", str(tmp_path)])
    assert str(exit_info.value.code).startswith("python -m bench: error: case T=1000000 V=1000000")


def test_progress_estimates_each_kind_from_its_own_finished_steps(monkeypatch):
    clock = iter([0.0, 1.0, 11.0, 12.0, 22.0, 23.0])  # start, then steps of 1 s (fast) and 10 s (slow)
    monkeypatch.setattr("bench.harness.progress.time.perf_counter", lambda: next(clock))
    stream = io.StringIO()
    progress = Progress(["fast", "slow", "fast", "slow", "fast"], stream=stream)
    for what in ("fast one", "slow one", "fast two"):
        progress.finished(what)
    first, second, third = stream.getvalue().splitlines()
    assert first == "[1/5] fast one: 1.0 s; elapsed 0:01, about 0:04 left"  # no slow step seen yet: 1 s each
    assert second == "[2/5] slow one: 10.0 s; elapsed 0:11, about 0:12 left"  # fast 1 + slow 10 + fast 1
    assert third == "[3/5] fast two: 1.0 s; elapsed 0:12, about 0:11 left"
    progress.finished("slow two")
    progress.finished("fast three")
    assert stream.getvalue().splitlines()[-1].startswith("[5/5] fast three: ") and "left" not in stream.getvalue().splitlines()[-1]


def test_progress_counts_steps_learnt_of_later(monkeypatch):
    clock = iter([0.0, 1.0, 11.0, 12.0])  # start, then steps of 1 s (fast), 10 s (slow), 1 s (fast)
    monkeypatch.setattr("bench.harness.progress.time.perf_counter", lambda: next(clock))
    stream = io.StringIO()
    progress = Progress(["fast", "fast", "fast", "fast"], stream=stream)  # the start's estimate
    progress.finished("fast one")
    progress.expect_next(["slow"])  # a step found to be needed: it runs next
    progress.finished("slow one")
    progress.plan(["fast"])  # the rest turned out to be one step (others were done before)
    progress.finished("fast two")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[1/4] fast one: 1.0 s; elapsed 0:01, about 0:03 left"
    assert lines[1] == "[2/5] slow one: 10.0 s; elapsed 0:11, about 0:03 left"  # the slow step was not taken for fast
    assert lines[2] == "[3/3] fast two: 1.0 s; elapsed 0:12"


def test_staleness_toy_reports_every_run():
    from bench.studies.sfc_staleness import ToyConfig, run_grid

    stream = io.StringIO()
    tiny = ToyConfig(contexts=4, actions=6, batch=8, draws=2, steps=1)
    grid = run_grid(range(1), tiny, progress=Progress(["reinforce"] * 3 + ["sfc"] * 3, stream=stream))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 6 == sum(len(runs) for runs in grid.values())
    assert lines[0].startswith("[1/6] reinforce staleness 0 seed 0: ") and "left" in lines[0]
    assert lines[-1].startswith("[6/6] sfc staleness 8 seed 0: ")


def _fake_records(cases, subjects, gpu):
    """Plausible records for every case, phase and subject (the chart only reads them)."""
    records = []
    for number, case in enumerate(cases):
        for subject in subjects:
            for phase in ("fwd", "bwd", "fwd+bwd"):
                floor = case.floor_bytes(phase)
                factor = 1.0 + number % 3 + (subject != "fused")
                records.append(dict(
                    case=case, phase=phase, subject=subject, error=1e-7 * factor,
                    bytes_moved=None if gpu else floor * factor, floor_bytes=floor,
                    peak_extra_bytes=case.input_bytes * (subject != "fused"), input_bytes=case.input_bytes,
                    time_ms=floor / 3e9 * factor if gpu else None, copy_gbps=4000.0 if gpu else None,
                ))  # fmt: skip
    return records


ENV = dict(date="2026-11-29T23:30:00", device="NVIDIA H200", torch="2.11.0", triton="3.6.0", commit="abc1234")


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_chart_is_faceted_labelled_and_carries_the_run_metadata(gpu):
    import matplotlib.pyplot as plt

    cases = GPU_GRID.cases()[:5] + [SegmentCase(4096)]
    fig = figure(_fake_records(cases, ["fused", "eager"], gpu), gpu, ENV)
    panels = fig.axes
    columns = 4 if gpu else 3
    assert len(panels) == 2 * columns  # a row per op, a column per metric
    assert all(axes.get_xlabel() for axes in panels[columns:])  # the bottom row names every x axis
    assert [axes.get_title() for axes in panels[:columns]][-1] == "accuracy"
    assert panels[0].get_ylabel().startswith("token statistics") and panels[columns].get_ylabel().startswith("aggregation")
    title = fig._suptitle.get_text()
    for field in ("NVIDIA H200", "torch 2.11.0", "triton 3.6.0", "commit abc1234", "2026-11-29T23:30:00", "dtypes: fp32 bf16", "forward + backward"):
        assert field in title
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fused", "eager"]
    assert min(t.get_fontsize() for t in panels[0].get_yticklabels()) >= 8  # few cases: full-size labels
    plt.close(fig)


def test_chart_size_is_bounded_whatever_the_number_of_cases():
    import matplotlib.pyplot as plt

    cases = [Case(tokens, 4096, "fp32", 1, False) for tokens in range(1, 301)]
    fig = figure(_fake_records(cases, ["fused", "eager"], gpu=False), False, ENV)
    width, height = fig.get_size_inches()
    assert width <= 13 and height <= 16
    assert min(t.get_fontsize() for t in fig.axes[0].get_yticklabels()) >= 5
    plt.close(fig)

"""Every shipped kernel compiles for every GPU arch users train on (bench/static/gpus.py: sm_80,
sm_100, sm_103 and sm_120 here; sm_90 with its SASS in the other compile tests), with no spill: a
compile error or local memory on one of them would be a crash or a slowdown on a user's first
call. CI runs this on the oldest, the pinned and the newest supported Triton (.ci/triton-matrix).

The variants: both phases of token_stats in every dtype with every switch off and all on (J = 9),
the J = 129 score-centering variants (the most ids a row), and segment_sum in both phases and
dtypes at 8 channels, and token_draws (both kernels) for fp32 and bf16 log-probs and fp32
probabilities. Resource usage only (registers, local memory): the loop counts are the static
model's (`python -m bench --static`)."""

from sm90 import shipped

from bench.static import compile_launches
from bench.static.gpus import ARCHS

OTHER_ARCHS = tuple(arch for arch in ARCHS if arch != "sm_90")


def covering(kwargs) -> bool:
    if "draws" in kwargs:
        return True
    if "channels" in kwargs:
        return kwargs["channels"] == 8
    switches = (kwargs["ids_per_row"], kwargs["entropy"], kwargs["rows"])
    return switches in [(1, False, False), (9, True, True), (129, True, True)]


def test_every_kernel_compiles_for_every_arch_without_spilling():
    launches = shipped("token_stats", covering) + shipped("segment_sum", covering) + shipped("token_draws", covering)
    assert len(launches) == 12 + 4 + 4 + 3
    records = compile_launches(launches, archs=OTHER_ARCHS, sass=False)
    failed = [f"{record['label']} for {record['arch']}: {record['error']}" for record in records if "error" in record]
    assert not failed, "\n".join(failed)
    assert sorted({(record["label"], record["arch"]) for record in records}) == sorted(
        (launch.label, arch) for launch in launches for arch in OTHER_ARCHS
    )
    spilled = [f"{record['label']} for {record['arch']}: {record['resources']}" for record in records
               if record["resources"]["local"] or record["resources"]["stack"]]  # fmt: skip
    assert not spilled, "\n".join(spilled)

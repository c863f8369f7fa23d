"""The plugin in SGLang 0.5.23's real HTTP server on CPU, in the configurations beside the
default one of tests/test_sglang/test_sglang_server.py:

- variable unset: every response is bitwise the one of a server that never loads the package
  (same seed, same requests in the same order);
- `--tokenizer-worker-num 2`: SGLang's extra tokenizer workers load no plugins, so the
  scheduler's door refuses (truncated sampling, K above a bound set at start-up, input ids
  outside the vocabulary) and the server keeps serving;
- a hook SGLang fails to apply stops the server's start-up with a message naming it.

The three servers of the first two start together (they share the machine's cores while they
load) and are stopped when the session ends.
"""

from __future__ import annotations

import sys

import pytest

from fusedrl.sglang_plugin import parse_token_samples
from fusedrl.sglang_plugin.constraints import ENV_VAR, MAX_SAMPLES_ENV_VAR
from fusedrl.sglang_plugin.plugin import COMPUTE_LOGPROBS_TARGET
from bench_package import import_bench

import_bench()
from bench.slime_loop.sglang_server import (  # noqa: E402
    ENABLED_LINE,
    PLUGIN_ENV,
    PROMPT,
    VOCAB,
    draw_request,
    error_message,
    generate,
    start_server,
)

WORKERS_MAX_K = 8
# uvicorn's supervisor kills a tokenizer worker that does not answer its health ping within
# SGLang's timeout (10 s) and starts another; a worker still importing SGLang on a loaded 2-core
# machine misses it every time ("Child process [...] died" every 10 s, the server never ready).
SLOW_WORKER_HEALTHCHECK = {"SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT": "600"}


_MISSING_HOOK_LAUNCHER = """
import runpy, sys
from sglang.srt.plugins.hook_registry import HookRegistry
apply_target, missing = HookRegistry._apply_target.__func__, sys.argv[1]
def apply_all_but_one(cls, target, hooks):
    if target == missing:
        raise AttributeError(f"test: SGLang cannot patch {target}")
    return apply_target(cls, target, hooks)
HookRegistry._apply_target = classmethod(apply_all_but_one)
sys.argv = ["sglang.launch_server"] + sys.argv[2:]
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
"""


def test_a_hook_sglang_fails_to_apply_stops_start_up_naming_it(tmp_path_factory):
    """SGLang's HookRegistry only logs a hook it cannot apply; here it cannot apply the draw
    hook (as when a release renames the target), and the real launch_server stops."""
    server = start_server(
        tmp_path_factory,
        "missing_hook",
        PLUGIN_ENV,
        launcher=(sys.executable, "-c", _MISSING_HOOK_LAUNCHER, COMPUTE_LOGPROBS_TARGET),
    )
    try:
        assert server.wait_exit() != 0
        log = server.log_text()
    finally:
        server.stop()
    assert "refusing to start" in log, log[-3000:]
    assert f"SGLang did not apply the plugin's hooks on {COMPUTE_LOGPROBS_TARGET}" in log


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{name: ready Server}: 'unset' (package installed, variable unset), 'stock' (SGLang told
    to load no plugin by its own SGLANG_PLUGINS allow-list; the variable is set there, so a
    loaded package would say so in the log) and 'workers' (plugin on, two tokenizer workers,
    K bound WORKERS_MAX_K)."""
    configs = {
        "unset": ({ENV_VAR: None, "SGLANG_PLUGINS": None}, ()),
        "stock": ({ENV_VAR: "1", "SGLANG_PLUGINS": "no_such_plugin"}, ()),
        "workers": (
            {**PLUGIN_ENV, MAX_SAMPLES_ENV_VAR: str(WORKERS_MAX_K), **SLOW_WORKER_HEALTHCHECK},
            ("--tokenizer-worker-num", "2"),
        ),
    }
    started = {}
    try:
        for name, (env, args) in configs.items():
            started[name] = start_server(tmp_path_factory, name, env, args)
        yield {name: server.wait_ready() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


# Sequential, so both seeded servers see the same request stream.
SAME_STREAM = [
    draw_request(PROMPT, 5, 1.0, 8),
    draw_request(PROMPT, 5, 0.7, 8),
    draw_request(PROMPT, 3, 0.8, 6, top_p=0.9),
    draw_request(PROMPT, 3, 0.0, 6),
    draw_request([PROMPT, [7, 8, 9]], 2, 1.3, 5),
    {"text": "w5 w17 w300", "sampling_params": {"temperature": 1.0, "max_new_tokens": 6}},
]
# Per-response fields that differ between any two runs: the request id and wall-clock times.
VOLATILE = ("id", "e2e_latency", "response_sent_to_client_ts")


def _stable(body):
    if isinstance(body, list):
        return [_stable(item) for item in body]
    if isinstance(body, dict) and isinstance(body.get("meta_info"), dict):
        meta = {k: v for k, v in body["meta_info"].items() if k not in VOLATILE}
        return {**body, "meta_info": meta}
    return body


def test_variable_unset_responses_are_bitwise_those_of_a_server_without_the_package(servers):
    unset, stock = servers["unset"], servers["stock"]
    assert "fusedrl token samples" not in stock.log_text()  # the package did not load there
    assert "fusedrl token samples enabled" not in unset.log_text()
    answers = {}
    for name, server in (("unset", unset), ("stock", stock)):
        answers[name] = []
        for request in SAME_STREAM:
            status, body = generate(server.port, request)
            assert status == 200, (name, body)
            answers[name].append(_stable(body))
    assert answers["unset"] == answers["stock"]
    # The draws' mode is off: top_logprobs_num = 5 is SGLang's top 5, not 1 + 5 entries.
    assert len(answers["unset"][0]["meta_info"]["output_top_logprobs"][0]) == 5


def test_tokenizer_workers_the_scheduler_refuses_and_the_server_keeps_serving(servers):
    server = servers["workers"]
    cases = [
        (draw_request(PROMPT, 4, 0.8, top_p=0.9), "top_p=0.9 truncates"),
        (draw_request(PROMPT, 4, 0.0), "top_k=1 (greedy"),
        (
            draw_request(PROMPT, WORKERS_MAX_K + 1),
            f"top_logprobs_num={WORKERS_MAX_K + 1} exceeds the limit of {WORKERS_MAX_K}",
        ),
        (draw_request([5000, 7], 0), f"input_ids holds token id 5000, outside the model's vocabulary of {VOCAB}"),
        (draw_request([9, VOCAB + 3], 2), f"input_ids holds token id {VOCAB + 3},"),
    ]
    for request, message in cases:
        for return_logprob in (True, False):
            status, body = generate(server.port, {**request, "return_logprob": return_logprob})
            assert status == 400, (request, body)
            assert message in error_message(body), body
    status, body = generate(server.port, draw_request(PROMPT, WORKERS_MAX_K, 1.0, 4))
    assert status == 200, body
    samples = parse_token_samples(body["meta_info"], num_samples=WORKERS_MAX_K)
    assert samples.draw_ids.shape == (4, WORKERS_MAX_K)
    assert server.alive()
    # The HTTP workers never load the plugin; the main, scheduler and detokenizer processes do.
    assert server.log_text().count(ENABLED_LINE.split("{")[0]) >= 3

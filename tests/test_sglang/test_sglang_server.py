"""The plugin inside SGLang 0.5.23's real HTTP server on CPU (bench/slime_loop/sglang_server.py), with
AGENTCORE_SGLANG_TOKEN_SAMPLES=1: draws against the model's own float64 distribution, refusals
at the door, a mixed load, the weight version, the K bound, out-of-vocabulary input ids and the
plugin's line in every server process's log.

One server serves this module; the requests are small and bounded in number, each with a time
limit."""

from __future__ import annotations

import functools
import json
import random
import re
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from fusedrl.sglang_plugin import parse_token_samples
from fusedrl.sglang_plugin.constraints import DEFAULT_MAX_SAMPLES
from fusedrl.sglang_plugin.plugin import COMPUTE_LOGPROBS_TARGET
from bench_package import import_bench
from sglang_harness import chi_square_p_value

import_bench()
from bench.slime_loop.sglang_server import (  # noqa: E402
    ENABLED_LINE,
    HOST,
    PLUGIN_ENV,
    PROMPT,
    VOCAB,
    WEIGHT_VERSION,
    artifacts,
    draw_request,
    error_message,
    generate,
    post,
    running_server,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory, "plugin", PLUGIN_ENV)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return artifacts(tmp_path_factory)[0]


@functools.lru_cache(maxsize=None)
def _reference_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def reference_logprobs(model_dir, ids, temperature: float) -> torch.Tensor:
    """[len(ids), V] float64 log_softmax(logits / T) after each prefix of `ids`, computed by
    transformers from the saved weights (independently of SGLang)."""
    with torch.no_grad():
        logits = _reference_model(model_dir)(torch.tensor([list(ids)])).logits[0]
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def pooled_p_value(draws: torch.Tensor, logprobs: torch.Tensor, min_expected: float = 5.0):
    """Chi-square p-value of `draws` (token ids) against exp(logprobs): tokens expected at
    least `min_expected` times get their own bin, the rest share one."""
    probs = logprobs.exp()
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    own = probs * draws.numel() >= min_expected
    binned_counts = torch.cat([counts[own], counts[~own].sum().view(1)])
    binned_probs = torch.cat([probs[own], probs[~own].sum().view(1)])
    return chi_square_p_value(binned_counts, binned_probs)


def assert_serving(server):
    status, body = generate(server.port, draw_request(PROMPT, 2))
    assert status == 200, body
    parse_token_samples(body["meta_info"], num_samples=2)
    assert server.alive()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_tempered_distribution_of_the_model(server, model_dir, temperature):
    """K = 64 draws at the first output position of 32 copies of one prompt: their pooled
    frequencies pass chi-square against softmax(logits / T) of the model in float64, and fail
    it at a wrong temperature; every entry's logprob is that distribution's."""
    copies, k = 32, DEFAULT_MAX_SAMPLES
    status, body = generate(server.port, draw_request([PROMPT] * copies, k, temperature))
    assert status == 200, body
    truth = reference_logprobs(model_dir, PROMPT, temperature)[-1]
    draws = []
    for result in body:
        samples = parse_token_samples(result["meta_info"], num_samples=k)
        assert samples.draw_ids.shape == (1, k)
        ids = torch.cat([samples.sampled_ids, samples.draw_ids[0]])
        values = torch.cat([samples.sampled_logprobs, samples.draw_logprobs[0]])
        torch.testing.assert_close(values.double(), truth[ids], rtol=1e-4, atol=1e-4)
        draws.append(samples.draw_ids[0])
    draws = torch.cat(draws)
    assert draws.numel() == copies * k
    assert truth.exp().max() > 20.0 / VOCAB  # far from uniform, so the control has teeth
    assert pooled_p_value(draws, truth) > 1e-3
    wrong = reference_logprobs(model_dir, PROMPT, temperature * 1.3)[-1]
    assert pooled_p_value(draws, wrong) < 1e-6


def test_every_position_returns_the_sampled_token_and_k_draws(server, model_dir):
    k, length, temperature = 5, 8, 0.9
    status, body = generate(server.port, draw_request(PROMPT, k, temperature, length))
    assert status == 200, body
    samples = parse_token_samples(body["meta_info"], num_samples=k)
    assert samples.draw_ids.shape == (length, k)
    assert samples.sampled_ids.tolist() == body["output_ids"]
    truth = reference_logprobs(model_dir, PROMPT + body["output_ids"][:-1], temperature)
    truth = truth[len(PROMPT) - 1 :]
    positions = torch.arange(length)
    torch.testing.assert_close(
        samples.sampled_logprobs.double(), truth[positions, samples.sampled_ids], rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        samples.draw_logprobs.double(),
        truth.gather(1, samples.draw_ids),
        rtol=1e-4,
        atol=1e-4,
    )


REFUSED = [
    (dict(top_p=0.9), "top_p=0.9 truncates"),
    (dict(top_k=20), "top_k=20 truncates"),
    (dict(min_p=0.05), "min_p=0.05 truncates"),
    (dict(temperature=0.0), r"top_k=1 \(greedy"),
]


@pytest.mark.parametrize("return_logprob", [True, False])
@pytest.mark.parametrize("params, message", REFUSED)
def test_truncated_or_greedy_requests_get_400_naming_the_parameter(
    server, params, message, return_logprob
):
    request = draw_request(PROMPT, 4, **{"temperature": 0.8, **params})
    request["return_logprob"] = return_logprob
    status, body = generate(server.port, request)
    assert status == 400, body
    assert re.search(message, error_message(body)), body
    assert_serving(server)


def test_top_logprobs_num_above_the_bound_gets_400_naming_it(server):
    for num in (DEFAULT_MAX_SAMPLES + 1, 100_000):
        status, body = generate(server.port, draw_request(PROMPT, num, max_new_tokens=4))
        assert status == 400, body
        message = error_message(body)
        assert f"top_logprobs_num={num} exceeds the limit of {DEFAULT_MAX_SAMPLES}" in message
    assert_serving(server)


@pytest.mark.parametrize("input_ids, bad", [([5000, 7], 5000), ([3, VOCAB], VOCAB), ([4, -2], -2)])
def test_out_of_vocabulary_input_ids_get_400_and_the_server_keeps_serving(server, input_ids, bad):
    """Stock SGLang 0.5.23 hands such an id to the embedding lookup, whose IndexError kills the
    scheduler and the server; the plugin's tokenizer-side door refuses it."""
    for num in (0, 3):
        status, body = generate(server.port, draw_request(input_ids, num))
        assert status == 400, body
        message = error_message(body)
        assert f"input_ids holds token id {bad}," in message and f"vocab_size={VOCAB}" in message
    assert_serving(server)


def _tree(server):
    """The (pid, name, command line) of every process under the server, for failure messages."""
    found = []
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            found.append((child.pid, child.name(), child.cmdline()[:1]))
        except psutil.Error as error:
            found.append((child.pid, repr(error)))
    return found


def test_the_log_says_the_plugin_is_on_in_every_process_that_loads_it(server):
    """SGLang loads plugins in its main process, its scheduler and its detokenizer (each spawned
    from the main one): three processes of the server's tree, each with its own line."""
    main = psutil.Process(server.process.pid)
    tree = {main.pid} | {child.pid for child in main.children(recursive=True)}
    logged = {int(pid) for pid in re.findall(ENABLED_LINE.format(pid=r"(\d+)"), server.log_text())}
    assert main.pid in logged, (logged, _tree(server))
    assert len(logged) == 3 and logged <= tree, (logged, _tree(server))
    assert COMPUTE_LOGPROBS_TARGET in server.log_text()


def test_the_weight_version_sglang_reports_reaches_the_parsed_result(server):
    def reported_and_parsed():
        _, info = post(server.port, "/model_info", method="GET")
        status, body = generate(server.port, draw_request(PROMPT, 2))
        assert status == 200, body
        return info["weight_version"], parse_token_samples(body["meta_info"], 2).weight_version

    assert reported_and_parsed() == (WEIGHT_VERSION, WEIGHT_VERSION)
    updated = WEIGHT_VERSION + "-updated"
    try:
        status, body = post(
            server.port,
            "/update_weight_version",
            {"new_version": updated, "abort_all_requests": False},
        )
        assert status == 200 and body["success"], body
        assert reported_and_parsed() == (updated, updated)
    finally:
        post(server.port, "/update_weight_version", {"new_version": WEIGHT_VERSION, "abort_all_requests": False})


# ---- load --------------------------------------------------------------------------------

LOAD_REQUESTS = 300
LOAD_CLIENTS = 8


def _disconnect(port: int, body: bytes, send_all: bool) -> None:
    """Send a request (all of it, or half its body) and hang up without reading the answer."""
    head = (
        f"POST /generate HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((HOST, port), timeout=30) as connection:
        connection.sendall(head + (body if send_all else body[: len(body) // 2]))


def _load_case(rng: random.Random):
    """(kind, what to send, K for good requests): one request of the mixed load; a hang-up
    sends (body, whether to send all of it)."""
    roll = rng.random()
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]
    if roll < 0.45:
        k = rng.randrange(1, 9)
        request = draw_request(prompt, k, rng.uniform(0.6, 1.4), rng.randrange(1, 7))
        return "good", request, k
    if roll < 0.55:
        params, _ = rng.choice(REFUSED)
        request = draw_request(prompt, rng.randrange(1, 9), **{"temperature": 0.8, **params})
        request["return_logprob"] = rng.random() < 0.5
        return "refused", request, None
    if roll < 0.63:
        body = rng.choice([b"{bad json", b"[1, 2", b"", b'{"input_ids": "x"}', b"\xff\xfe", b"null"])
        return "malformed", body, None
    if roll < 0.70:
        return "huge_k", draw_request(prompt, rng.choice([100_000, 10**9]), max_new_tokens=8), None
    if roll < 0.77:
        long_prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1100, 6000))]
        return "too_long", draw_request(long_prompt, 2), None
    if roll < 0.84:
        near_limit = [rng.randrange(3, VOCAB) for _ in range(900)]
        return "good", draw_request(near_limit, 3, 1.0, 2), 3
    if roll < 0.91:
        return "out_of_vocab", draw_request(prompt + [rng.randrange(VOCAB, 10**6)], 2), None
    body = json.dumps(draw_request(prompt, 4, 1.0, 6)).encode()
    return "disconnect", (body, rng.random() < 0.5), None


EXPECTED_STATUS = {"refused": 400, "huge_k": 400, "too_long": 400, "out_of_vocab": 400}


def _send(port: int, case):
    kind, payload, k = case
    started = time.monotonic()
    if kind == "disconnect":
        _disconnect(port, *payload)
        return kind, None, None, k, time.monotonic() - started
    status, body = post(port, "/generate", payload)
    return kind, status, body, k, time.monotonic() - started


def test_mixed_load_leaves_no_5xx_and_the_scheduler_alive(server):
    """300 requests from 8 concurrent clients: good ones (parsed by the client helper), every
    refused kind, malformed JSON, huge top_logprobs_num, prompts beyond the context, ids
    outside the vocabulary and clients that hang up."""
    tree = psutil.Process(server.process.pid).children(recursive=True)
    rng = random.Random(20261201)
    cases = [_load_case(rng) for _ in range(LOAD_REQUESTS)]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=LOAD_CLIENTS) as clients:
        results = list(clients.map(functools.partial(_send, server.port), cases))
    elapsed = time.monotonic() - started

    kinds = {}
    for kind, status, body, k, _ in results:
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "disconnect":
            continue
        assert status < 500, (kind, status, body)
        if kind == "good":
            assert status == 200, body
            samples = parse_token_samples(body["meta_info"], num_samples=k)
            assert samples.sampled_ids.tolist() == body["output_ids"]
        elif kind == "malformed":
            assert 400 <= status < 500, body
        else:
            assert status == EXPECTED_STATUS[kind], (kind, body)
    assert set(kinds) == {"good", "refused", "malformed", "huge_k", "too_long", "out_of_vocab", "disconnect"}
    # No process of the server (scheduler, detokenizer) died or was replaced.
    assert all(process.is_running() and process.status() != psutil.STATUS_ZOMBIE for process in tree)
    assert psutil.Process(server.process.pid).children(recursive=True) == tree
    assert post(server.port, "/health_generate", method="GET")[0] == 200
    assert_serving(server)

    latencies = sorted(latency for kind, *_, latency in results if kind != "disconnect")
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(
        f"\nmixed load: {LOAD_REQUESTS} requests, {LOAD_CLIENTS} clients, {elapsed:.1f} s, "
        f"{LOAD_REQUESTS / elapsed:.1f} requests/s, latency p50 {statistics.median(latencies):.3f} s "
        f"p99 {p99:.3f} s; kinds {kinds}"
    )

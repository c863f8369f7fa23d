"""SGLang 0.5.23's real HTTP server on CPU, for the end-to-end plugin tests: a test setup, not a
way to serve models.

What it takes, built here at test time:
- `libcuda_stub`: sgl_kernel's libraries (imported at module level by several SGLang modules,
  even under the CPU engine) link the CUDA driver library `libcuda.so.1`, which no registry
  package ships. A shared object of that name exporting the `cu*` symbols they link, each
  returning CUDA_ERROR_NO_DEVICE (100), lets them load while torch still sees no GPU. It goes
  on the server's LD_LIBRARY_PATH only.
- `tiny_model`: a random LlamaForCausalLM (vocab 1000) written with transformers'
  `save_pretrained`, its output layer scaled so the next-token distribution is far from uniform,
  and an offline word-level tokenizer (`w<id>` is token `<id>`); `llama_checkpoint` writes such a
  model of any vocabulary (the training-loop test's task has its own, bench/slime_loop/target_task.py).
- `Server`: `python -m sglang.launch_server --device cpu` with SGLANG_USE_CPU_ENGINE=1 on a free
  loopback port, in its own process group, its output in a log file, with `--sleep-on-idle`
  (SGLang's scheduler otherwise busy-polls a core while it waits for requests, taking it from the
  tests and the other servers beside it on a 2-core machine); `wait_ready` polls
  `/health_generate` for a bounded time and fails with the log's tail; `stop` ends the group
  it started, by its PID.
- `post`: one HTTP request with the standard library (no client-side JSON encoding, so malformed
  bodies can be sent), returning (status, parsed JSON or text).

Each test module starts the servers it needs (`running_server`, `start_server`) and stops them
when it ends, so no server idles through the rest of the session; the model and the stub are
built once per session (`artifacts`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple

import pytest

from fusedrl.sglang_plugin.constraints import ENV_VAR

HOST = "127.0.0.1"
VOCAB = 1000
CONTEXT_LENGTH = 1024
SEED = 1234
WEIGHT_VERSION = "fusedrl-test-v1"
PROMPT = [11, 402, 77, 981, 5, 630]
# The plugin's start-up line (sglang_plugin/plugin.py), once per process that loads it.
ENABLED_LINE = "fusedrl token samples enabled in process {pid} "
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 120.0
# How long a stopped (SIGKILLed) server's leader may take to be reaped.
STOP_WAIT_S = 10.0

# The cu* functions sglang-kernel 0.4.10's libraries link (`nm -D --undefined-only` on
# sgl_kernel/*.so and sgl_kernel/sm*/common_ops*.so), plus the entry points the CUDA runtime
# looks up first when torch asks how many GPUs there are.
CUDA_DRIVER_SYMBOLS = (
    "cuInit",
    "cuDeviceGetCount",
    "cuDriverGetVersion",
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuGetErrorString",
    "cuGetErrorName",
    "cuPointerGetAttribute",
    "cuCtxFromGreenCtx",
    "cuCtxPopCurrent_v2",
    "cuCtxPushCurrent_v2",
    "cuDevResourceGenerateDesc",
    "cuDevSmResourceSplitByCount",
    "cuDeviceGetDevResource",
    "cuGreenCtxCreate",
    "cuGreenCtxDestroy",
    "cuGreenCtxGetDevResource",
    "cuStreamCreate",
)
CUDA_ERROR_NO_DEVICE = 100


def libcuda_stub(directory: Path) -> Path:
    """Build `directory/libcuda.so.1` with gcc; return the directory (for LD_LIBRARY_PATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "libcuda_stub.c"
    source.write_text(
        "/* Test-only stand-in for the CUDA driver: every entry point reports no device. */\n"
        + "".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in CUDA_DRIVER_SYMBOLS)
    )
    library = directory / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return directory


def tiny_model(directory: Path) -> Path:
    """A random Llama (vocab 1000, with <unk>, <s> and </s>) whose next-token distribution is far
    from uniform, and its word-level tokenizer."""
    # Unit-scale hidden states times N(0, 0.3^2) output weights: logits of std ~2.4, so the
    # temperature matters.
    return llama_checkpoint(directory, VOCAB, seed=20261201, max_positions=CONTEXT_LENGTH, output_std=0.3)


def llama_checkpoint(
    directory: Path,
    vocab_size: int,
    *,
    seed: int,
    max_positions: int,
    with_eos: bool = True,
    output_std: Optional[float] = None,
) -> Path:
    """A random LlamaForCausalLM (hidden 64, 2 layers, 4 heads in 2 groups, untied output layer,
    fp32) over `vocab_size` tokens and its offline word-level tokenizer (`w<id>` is token `<id>`),
    saved in `directory`. `with_eos`: ids 0-2 are <unk>, <s> and </s>; without, every id is a word
    and there is no end-of-sequence token, so generation always runs to its length limit.
    `output_std`: the output layer drawn from N(0, output_std^2) instead of the default init."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1 if with_eos else None,
        eos_token_id=2 if with_eos else None,
        pad_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).float()
        if output_std is not None:
            with torch.no_grad():
                model.lm_head.weight.normal_(0.0, output_std)
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(directory)

    special = {"<unk>": 0, "<s>": 1, "</s>": 2} if with_eos else {}
    vocab = {**special, **{f"w{i}": i for i in range(len(special), vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>" if with_eos else "w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"} if with_eos else {"unk_token": "w0"}
    PreTrainedTokenizerFast(tokenizer_object=backend, **names).save_pretrained(directory)
    return directory


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def post(
    port: int,
    path: str,
    body: bytes | Mapping | None = None,
    *,
    method: str = "POST",
    timeout: float = REQUEST_TIMEOUT_S,
) -> Tuple[int, object]:
    """(HTTP status, JSON body or text) of one request to the server on `port`."""
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")


def generate(port: int, payload: Mapping) -> Tuple[int, object]:
    return post(port, "/generate", payload)


def draw_request(input_ids, num, temperature=1.0, max_new_tokens=1, **params) -> dict:
    """A /generate body asking for `num` top logprobs (draws, with the plugin on) at each of
    `max_new_tokens` positions; `input_ids` one prompt or a list of prompts."""
    return {
        "input_ids": input_ids,
        "sampling_params": {
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "ignore_eos": True,
            **params,
        },
        "return_logprob": True,
        "top_logprobs_num": num,
    }


def error_message(body) -> str:
    """The message of SGLang's error body (`{"error": {"message": ...}}` or `{"message": ...}`),
    or the body as text."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
    return str(body)


class Server:
    """One `sglang.launch_server` process group on a free loopback port."""

    def __init__(
        self,
        model: Path,
        stub_dir: Path,
        log_path: Path,
        *,
        env: Mapping[str, Optional[str]],
        extra_args: Sequence[str] = (),
        launcher: Sequence[str] = (sys.executable, "-m", "sglang.launch_server"),
    ):
        """Start `launcher` with the server arguments below plus `extra_args`, under this
        process's environment changed by `env` (a None value removes the variable)."""
        self.port = free_port()
        self.log_path = log_path
        server_env = dict(os.environ)
        # The tests' Triton interpreter switch is for the kernels under test, not the server.
        server_env.pop("TRITON_INTERPRET", None)
        server_env.update(
            SGLANG_USE_CPU_ENGINE="1",
            LD_LIBRARY_PATH=os.pathsep.join(
                p for p in (str(stub_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p
            ),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            CUDA_VISIBLE_DEVICES="",
        )
        for name, value in env.items():
            if value is None:
                server_env.pop(name, None)
            else:
                server_env[name] = value
        self.args = [
            *launcher,
            "--model-path", str(model),
            "--device", "cpu",
            "--host", HOST,
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-total-tokens", "4096",
            "--random-seed", str(SEED),
            "--weight-version", WEIGHT_VERSION,
            "--sleep-on-idle",
            *extra_args,
        ]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            self.args,
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as one
        )

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "Server":
        """Return once `/health_generate` answers 200; fail with the log tail if the server
        exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(
                    f"SGLang server exited with {self.process.returncode} during start-up; "
                    f"log tail ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                status, _ = post(self.port, "/health_generate", method="GET", timeout=30)
            except OSError:
                status = None
            if status == 200:
                return self
            time.sleep(1.0)
        self.stop()
        pytest.fail(
            f"SGLang server not ready after {timeout:.0f} s; log tail ({self.log_path}):\n"
            f"{self.log_tail()}"
        )

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        """The exit status of a server expected to stop by itself (start-up refused)."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"SGLang server still running after {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGKILL to the process group this server leads (children that outlived the leader
        included): the server holds nothing a graceful exit would save, and SGLang's graceful one
        takes 5 s (its SIGTERM handler sets a flag that a 5-second loop reads; a SIGTERM to the group
        kills the scheduler first, which the leader takes for a crash and sleeps 5 s over)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # start_new_session: the group id is the leader's PID
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


_built: Dict[str, Path] = {}


def artifacts(tmp_path_factory) -> Tuple[Path, Path]:
    """(model dir, stub dir), built once per session."""
    if not _built:
        root = tmp_path_factory.mktemp("sglang_server")
        _built["stub"] = libcuda_stub(root / "libcuda")
        _built["model"] = tiny_model(root / "model")
    return _built["model"], _built["stub"]


def start_server(tmp_path_factory, name: str, env, extra_args=(), **kwargs) -> Server:
    """A new server `name` (not waited for), its log in the session's temporary folder."""
    model, stub = artifacts(tmp_path_factory)
    log = tmp_path_factory.mktemp(f"log_{name}") / "server.log"
    return Server(model, stub, log, env=env, extra_args=extra_args, **kwargs)


def running_server(tmp_path_factory, name: str, env, extra_args=()) -> Iterator[Server]:
    """Body of a fixture: the ready server `name`, stopped when the fixture ends."""
    server = start_server(tmp_path_factory, name, env, extra_args)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


# The plugin on, SGLANG_PLUGINS unset (every installed plugin loads).
PLUGIN_ENV = {ENV_VAR: "1", "SGLANG_PLUGINS": None}

"""Loop runs forked from one process that has imported slime's training stack once.

Each loop run needs a fresh process (slime's and megatron-core's state is per process), and a fresh
`python -m bench.slime_loop.loop` spends most of a short run importing torch, megatron-core,
SGLang's modules and slime (seconds of a busy core each time). `ForkServer(**env)` starts one
process (`python -m bench.slime_loop.fork_server`) that imports them, with the stand-ins in place
(`preload`), and then forks a child per `run(config, workdir, ...)`: the child runs `loop.run`
exactly as the fresh process would, its output in workdir/loop.log, its observations returned.

The environment is the server's, fixed when it starts (`loop.loop_environment(**env)`):
TRITON_INTERPRET, for one, changes what `@triton.jit` builds at import, so runs that differ in it
take separate servers (or `loop.run_in_subprocess`). A child past its `timeout` is killed
(SIGALRM); a server that runs no torch op before forking has no thread pool for a child to inherit
(`preload` refuses to fork with threads running).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Optional

from . import loop


def preload() -> None:
    """Import what every run imports (slime with its stand-ins, train.py, megatron-core, SGLang's
    client side) and check that the process is still one thread, so that forking it is safe."""
    root = loop.upstream_slime.load()
    loop.stand_ins.run_on_cpu()
    from fusedrl.slime_ext.train import load_script

    load_script(os.path.join(root, "train.py"))
    threads = [thread.name for thread in threading.enumerate()]
    if len(threads) > 1:
        raise RuntimeError(f"the fork server must not fork with threads running, found {threads}")


def _run_child(request: dict) -> None:
    """In the forked child: `loop.run` on the request, output to workdir/loop.log; never returns."""
    status = 1
    try:
        workdir = Path(request["workdir"])
        log = os.open(workdir / "loop.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _flush()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        if request["timeout"] is not None:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(max(1, int(request["timeout"])))
        engine = tuple(request["engine"]) if request["engine"] else None
        task_dir = Path(request["task_dir"]) if request["task_dir"] else None
        config = loop.LoopConfig(**json.loads((workdir / "config.json").read_text()))
        result = loop.run(config, workdir, engine, task_dir)
        (workdir / "observations.json").write_text(json.dumps(result))
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        os._exit(status)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def serve() -> None:
    """The server: preload, then per request line on stdin (JSON: workdir, engine, task_dir,
    timeout) fork a child, wait for it, and answer its exit status as one line (a negative status:
    the signal that killed it). Its own output goes to stderr; the answers to the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    preload()
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            _run_child(request)
        _, status = os.waitpid(child, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


class ForkServer:
    """A fork server in the loop's environment with `env` applied (`loop.loop_environment`),
    its own output in `log`; `run` one config after another, `close` (or use it as a context)."""

    def __init__(self, log: Path, **env):
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __spec__.name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=output, env=loop.loop_environment(**env), text=True,
            )  # fmt: skip
        self._answer("the fork server did not start")

    def _answer(self, failure: str) -> str:
        answer = self.process.stdout.readline().strip()
        if not answer:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])
            raise RuntimeError(f"{failure} (exit {self.process.poll()}); log tail ({self.log}):\n{tail}")
        return answer

    def run(self, config: "loop.LoopConfig", workdir: Path, engine: Optional[tuple] = None,
            task_dir: Optional[Path] = None, timeout: Optional[float] = None) -> dict:  # fmt: skip
        """`loop.run_in_subprocess`'s observations, from a forked child."""
        _, out_path, log_path = loop.run_files(config, workdir)
        request = dict(workdir=str(workdir), engine=list(engine) if engine else None,
                       task_dir=str(task_dir) if task_dir else None, timeout=timeout)  # fmt: skip
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        returncode = int(self._answer("the fork server stopped during a run"))
        return loop.observations(returncode, out_path, log_path)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    serve()

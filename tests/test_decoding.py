"""Every vLLM server we start and every request we send states its decoding (issue 46 item 1).

vLLM's default `generation_config="auto"` fills each sampling field a request leaves unset from
the model folder's generation_config.json (vllm/config/model.py `get_diff_sampling_param`:
repetition_penalty, temperature, top_k, top_p, min_p, max_new_tokens), and transformers'
`generate` does the same with its keyword arguments. Qwen2.5-7B-Instruct's file sets
repetition_penalty 1.05 and top_k 20. Checked here: the server command lines (serve/vllm.py for
every `configs/serve/vllm-*.yaml`, the servers of scripts/reproduce_paper.sh) pass
`--generation-config vllm`; the stage-1 sampler (endpoint and in-process) and the `openai`
auditor state every sampling field they can; TRL's and verl's rollouts sample the same way.

    pytest tests/test_decoding.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# what the configs mean by "sampling at T, top_p": nothing else filters or penalises
NEUTRAL = {"repetition_penalty": 1.0, "top_k": 0, "min_p": None}
QWEN25_GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20,
                            "top_p": 0.8}


# --------------------------------------------------------------------------- servers

@pytest.mark.parametrize("path", sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs/serve").glob("vllm-*.yaml")))
def test_every_served_config_starts_vllm_with_its_neutral_generation_config(path):
    from serve.config import load_serve_config
    from serve.vllm import vllm_command

    cmd = vllm_command(load_serve_config(REPO / path))
    i = cmd.index("--generation-config")
    assert cmd[i + 1] == "vllm" and cmd.count("--generation-config") == 1


def test_extra_args_cannot_bring_the_models_generation_config_back():
    import dataclasses

    from serve.config import ConfigError, load_serve_config
    from serve.vllm import vllm_command

    cfg = load_serve_config(REPO / "configs/serve/vllm-qwen2.5-7b-h200.yaml")
    for extra in (("--generation-config", "auto"), ("--generation-config=auto",)):
        with pytest.raises(ConfigError, match="extra_args: --generation-config is always 'vllm'"):
            vllm_command(dataclasses.replace(cfg, extra_args=extra))


def _script_env(**over) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SERVER_CMD")}
    return {**env, **over}


def test_reproduce_paper_refuses_a_vllm_server_without_the_flag(tmp_path):
    cmd = "python -m vllm.entrypoints.openai.api_server --model /m --port 8000"
    for var in ("CORPUS_SERVER_CMD", "SAMPLER_SERVER_CMD"):
        r = subprocess.run(["bash", "scripts/reproduce_paper.sh", "--dry-run"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=_script_env(OUT=str(tmp_path / "out"), **{var: cmd}))
        assert r.returncode == 1 and f"{var} starts vLLM without --generation-config vllm" in r.stderr, r.stderr


def test_reproduce_paper_starts_its_servers_with_the_flag():
    """The defaults of the script's server commands (the dry run prints them: test_reproduce_paper.py)."""
    text = (REPO / "scripts/reproduce_paper.sh").read_text()
    lines = [ln for ln in text.splitlines() if "vllm.entrypoints.openai.api_server" in ln and "_SERVER_CMD=" in ln]
    assert len(lines) == 2
    assert all("--generation-config vllm" in ln for ln in lines), lines


# --------------------------------------------------------------------------- requests

def test_the_endpoint_sampler_states_every_openai_sampling_field():
    from training.stage1.preferences import OpenAISampler

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": "x"}}] * bodies[-1]["n"]})

    s = OpenAISampler("http://vllm:8000/v1", "base", temperature=1.0, top_p=1.0,
                      transport=httpx.MockTransport(handler))
    s.sample([[{"role": "user", "content": "a"}]], 2)
    b = bodies[0]
    assert (b["temperature"], b["top_p"], b["presence_penalty"], b["frequency_penalty"]) == (1.0, 1.0, 0.0, 0.0)


def test_the_in_process_sampler_ignores_the_models_generation_config(tiny_model_dir):
    """A model whose generation_config.json is Qwen2.5-7B-Instruct's: the sampler's own fields win
    (transformers fills every field a call leaves unset from the model's file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from training.stage1.preferences import HFSampler

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.generation_config = GenerationConfig(**QWEN25_GENERATION_CONFIG, eos_token_id=tok.eos_token_id)
    seen = []
    real = model.generate

    def generate(**kw):
        gen = {k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")}
        seen.append(model._prepare_generation_config(None, **gen)[0])   # what generate() decodes with
        return real(**kw)

    model.generate = generate
    HFSampler(model, tok, temperature=1.0, top_p=1.0, max_new_tokens=2).sample([[{"role": "user", "content": "a"}]], 2)
    g = seen[0]
    assert (g.do_sample, g.temperature, g.top_p) == (True, 1.0, 1.0)
    assert {k: getattr(g, k) for k in NEUTRAL} == NEUTRAL


def test_the_openai_auditor_states_every_openai_sampling_field():
    from aftraj.schema import Label, Step, Trajectory
    from eval.auditors import get_auditor

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    traj = Trajectory(id="t", family_id="f", domain="math", source="test", task="compute",
                      steps=[Step(index=0, agent="user", kind="message", content="hi")], label=Label("SAFE", "verified_safe"))
    with get_auditor("openai", endpoint="http://vllm:8000/v1", api_model="auditor",
                     transport=httpx.MockTransport(handler)) as aud:
        aud.audit(traj, 0)
    b = bodies[0]
    assert (b["temperature"], b["top_p"], b["presence_penalty"], b["frequency_penalty"]) == (0.0, 1.0, 0.0, 0.0)


# --------------------------------------------------------------------------- rollouts

def test_trl_and_verl_rollouts_sample_like_the_stage1_sampler():
    from training.stage2.config import load_stage2_config
    from training.stage2.trl_engine import grpo_args

    cfg = load_stage2_config(REPO / "configs/stage2/tiny-cpu.yaml")
    args = grpo_args(cfg, REPO / "runs" / "unused", progress=False)
    assert (args.temperature, args.top_p) == (cfg.temperature, cfg.top_p)
    assert {"repetition_penalty": args.repetition_penalty, "top_k": args.top_k, "min_p": args.min_p} == NEUTRAL
    recipe = yaml.safe_load((REPO / "training/verl/stage2_grpo.yaml").read_text())
    assert recipe["actor_rollout_ref"]["rollout"]["top_k"] == -1     # vLLM's "off"; verl forces repetition_penalty 1.0

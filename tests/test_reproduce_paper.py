"""scripts/reproduce_paper.sh --dry-run and its checks (aftraj/drivers/reproduce.py): every config of the
GPU sequence is validated by the loader the run uses, every phase's command is printed with its
config, a broken or missing config fails naming the file and key.

    pytest tests/test_reproduce_paper.py -q
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from aftraj.drivers import reproduce
from aftraj.drivers.reproduce import ReproduceError, check_command, check_configs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "reproduce_paper.sh"
CONFIGS = {
    "CORPUS_CONFIG": "configs/corpus/openai-local.yaml",
    "STAGE1_CONFIG": "configs/stage1/qwen2.5-7b-2xh200.yaml",
    "ACCELERATE_CONFIG": "configs/accelerate/fsdp-2xh200.yaml",
    "STAGE2_CONFIG": "configs/stage2/qwen2.5-7b-8xh200.yaml",
    "SERVE_CONFIG": "configs/serve/vllm-qwen2.5-7b-h200.yaml",
}


def _env(out: Path, **over) -> dict:
    """The variables as the script exports them (its defaults), for the in-process checks."""
    env = {"OUT": str(out), "MODEL": "/models/Qwen2.5-7B-Instruct", "CORPUS_URL": "http://127.0.0.1:8000/v1",
           "CORPUS_MODEL": "Qwen/Qwen2.5-7B-Instruct", "SAMPLER_URL": "http://127.0.0.1:8000/v1",
           "SAMPLER_MODEL": "Qwen2.5-7B-Instruct", "NPROC_PER_NODE": "2", "GPUS_PER_NODE": "8",
           "VERL_PYTHON": ".venv-verl/bin/python", "VLLM_PYTHON": ".venv-vllm-gpu/bin/python",
           "SERVE_PORT": "8000", "SERVED_NAME": "auditor",
           **{k: str(REPO / v) for k, v in CONFIGS.items()}}
    env.update(over)
    return env


# every variable the script reads (its `: "${NAME:=…}"` and `NAME="${NAME-…}"` lines): the caller's
# environment must not change what the tests see
SCRIPT_VARS = set(re.findall(r'^(?::\s+"\$\{|)([A-Z][A-Z0-9_]*)(?::=|="\$\{\1-)', SCRIPT.read_text(), re.M))


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in SCRIPT_VARS and k != "PYTHON"}


def test_script_vars_found():
    assert {"OUT", "MODEL", "CORPUS_SERVER_CMD", "SAMPLER_SERVER_CMD", "VERL_PYTHON"} <= SCRIPT_VARS
    assert set(reproduce.VARS) <= SCRIPT_VARS        # the checks read only variables the script sets


def _dry_run(tmp_path: Path, **over) -> subprocess.CompletedProcess:
    env = _clean_env()
    env.update({"OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **over})
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def _with_unknown_key(tmp_path: Path, var: str) -> Path:
    src = REPO / CONFIGS[var]
    raw = yaml.safe_load(src.read_text())
    raw["not_a_setting"] = 1
    dst = tmp_path / f"broken-{src.name}"
    dst.write_text(yaml.safe_dump(raw))
    return dst


# --------------------------------------------------------------------------- the script

@pytest.mark.slow
def test_dry_run_validates_and_prints_every_phase(tmp_path):
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    out = r.stdout
    for path in CONFIGS.values():                       # each config named
        assert path in out, path
    cfgs = tmp_path / "out" / "configs"
    for phase, needles in {
        "corpus": ["vllm.entrypoints.openai.api_server", f"corpus build --config {cfgs}/corpus.yaml"],
        "servers": ["--tensor-parallel-size 2 --generation-config vllm"],
        "warm-up": ["warm-up: none"],
        "stage 1": [f"ACCELERATE_CONFIG={cfgs}/accelerate.yaml", "bash scripts/train_stage1.sh --config "
                    + CONFIGS["STAGE1_CONFIG"]],
        "stage 2": ["train stage2 --engine verl", "--config " + CONFIGS["STAGE2_CONFIG"],
                    "verl.trainer.main_ppo", "verl.model_merger merge"],
        "serve": [f"serve vllm --config {cfgs}/serve.yaml"],
        "eval": ["--auditor openai --endpoint http://127.0.0.1:8000/v1", "--data who_and_when",
                 "--auditor rules", "--auditor heuristic:position-prior", "--auditor heuristic:length",
                 "eval compare"],
    }.items():
        for n in needles:
            assert n in out, (phase, n)
    # every vLLM server line decodes what the requests say (tests/test_decoding.py)
    servers = [ln.replace("\\ ", " ") for ln in out.splitlines()
               if ln.startswith("+") and "vllm.entrypoints.openai.api_server" in ln]
    assert len(servers) == 2                             # the corpus endpoint and the stage-1 sampler
    assert servers and all("--generation-config vllm" in ln for ln in servers), servers
    assert "checked: aftraj eval --auditor openai" in out
    assert "dry run OK" in out
    # the run's copies carry the variables and nothing else ran
    serve = yaml.safe_load((cfgs / "serve.yaml").read_text())
    assert serve["model"] == str(tmp_path / "out" / "stage2" / "final")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["configs"]
    assert "--resume" not in out                         # a fresh run resumes nothing


@pytest.mark.slow
def test_dry_run_variables_reach_the_commands(tmp_path):
    (tmp_path / "out" / "stage1" / "checkpoint-20").mkdir(parents=True)    # an interrupted stage 1
    r = _dry_run(tmp_path, NPROC_PER_NODE="4", CORPUS_URL="http://10.0.0.9:9000/v1", CORPUS_MODEL="m-x",
                 CORPUS_SERVER_CMD="")
    assert r.returncode == 0, r.stderr + r.stdout
    cfgs = tmp_path / "out" / "configs"
    assert yaml.safe_load((cfgs / "accelerate.yaml").read_text())["num_processes"] == 4
    corpus = yaml.safe_load((cfgs / "corpus.yaml").read_text())
    assert corpus["policy"]["base_url"] == corpus["judge"]["base_url"] == "http://10.0.0.9:9000/v1"
    assert corpus["policy"]["model"] == "m-x"
    assert "vllm.entrypoints.openai.api_server --model /models/Qwen2.5-7B-Instruct --served-model-name m-x" \
        not in r.stdout                                  # empty CORPUS_SERVER_CMD: no corpus server
    stage1 = next(ln for ln in r.stdout.splitlines() if ln.startswith("+ env "))
    stage2 = next(ln for ln in r.stdout.splitlines() if "train stage2" in ln and ln.startswith("+"))
    assert stage1.endswith("--no-progress --resume") and not stage2.endswith("--resume")


def test_dry_run_fails_on_unknown_key_naming_file_and_key(tmp_path):
    bad = _with_unknown_key(tmp_path, "STAGE1_CONFIG")
    r = _dry_run(tmp_path, STAGE1_CONFIG=str(bad))
    assert r.returncode != 0
    assert str(bad) in r.stderr and "not_a_setting" in r.stderr
    assert "corpus build" not in r.stdout              # nothing printed past the failed check


@pytest.mark.slow
def test_dry_run_fails_on_missing_config_naming_it(tmp_path):
    r = _dry_run(tmp_path, SERVE_CONFIG="configs/serve/no-such.yaml")
    assert r.returncode != 0
    assert "configs/serve/no-such.yaml" in r.stderr


def test_unknown_argument_is_refused(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--gpu"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown argument --gpu" in r.stderr


# --------------------------------------------------------------------------- the checks, in process

def test_production_configs_pass(tmp_path):
    lines = check_configs(_env(tmp_path))
    assert [ln.split()[0] for ln in lines] == ["corpus", "stage", "accelerate", "stage", "serve"]


@pytest.mark.parametrize("var", sorted(CONFIGS))
def test_unknown_key_in_each_config_is_named(tmp_path, var):
    bad = _with_unknown_key(tmp_path, var)
    with pytest.raises(ReproduceError) as e:
        check_configs(_env(tmp_path, **{var: str(bad)}))
    assert str(bad) in str(e.value) and "not_a_setting" in str(e.value)


@pytest.mark.parametrize("var", sorted(CONFIGS))
def test_missing_config_is_named(tmp_path, var):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ReproduceError, match=str(missing)):
        check_configs(_env(tmp_path, **{var: str(missing)}))


def test_accelerate_fsdp_key_is_checked(tmp_path):
    raw = yaml.safe_load((REPO / CONFIGS["ACCELERATE_CONFIG"]).read_text())
    raw["fsdp_config"]["fsdp_sharding_strategy"] = "FULLSHARD"
    bad = tmp_path / "acc.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ReproduceError, match="fsdp_sharding_strategy"):
        check_configs(_env(tmp_path, ACCELERATE_CONFIG=str(bad)))


def test_corpus_config_must_use_an_endpoint(tmp_path):
    raw = yaml.safe_load((REPO / CONFIGS["CORPUS_CONFIG"]).read_text())
    raw["policy"] = {"backend": "scripted"}
    bad = tmp_path / "corpus.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ReproduceError, match=r"policy\.backend"):
        check_configs(_env(tmp_path, CORPUS_CONFIG=str(bad)))


def test_serve_config_must_be_vllm(tmp_path):
    with pytest.raises(ReproduceError, match="kind"):
        check_configs(_env(tmp_path, SERVE_CONFIG=str(REPO / "configs/serve/gateway-local.yaml")))


@pytest.mark.parametrize("val,ok", [("1", True), ("8", True), ("0", False), ("two", False), ("", False)])
def test_nproc_variable_bounds(tmp_path, val, ok):
    env = _env(tmp_path, NPROC_PER_NODE=val)
    if ok:
        check_configs(env)
        assert yaml.safe_load((tmp_path / "configs" / "accelerate.yaml").read_text())["num_processes"] == int(val)
    else:
        with pytest.raises(ReproduceError, match="NPROC_PER_NODE"):
            check_configs(env)


@pytest.mark.parametrize("line,status", [
    ("/v/bin/python -m aftraj.cli eval --auditor rules --data d --out o", "checked"),
    ("env A=1 B=x\\ y bash scripts/train_stage1.sh --config c.yaml --out o --no-progress", "checked"),
    ("accelerate launch --config_file a.yaml -m training.stage1 --phase train", "checked"),
    ("/v/.venv-verl/bin/python -m verl.model_merger merge --backend fsdp", "not checked"),
])
def test_command_check_accepts(line, status):
    assert check_command(line).startswith(status)


@pytest.mark.parametrize("line", [
    "/v/bin/python -m aftraj.cli eval --auditor rules --no-such-flag",
    "/v/bin/python -m aftraj.cli train stage9 --config c",
    "bash scripts/train_stage1.sh --config c.yaml --phase warm",
    "accelerate launch --no_such_option 1 x.py",
])
def test_command_check_rejects_naming_the_command(line):
    with pytest.raises(ReproduceError, match="does not parse") as e:
        check_command(line)
    assert line in str(e.value)


# --------------------------------------------------------------------------- the real path, up to the first failure

FAKE_ENDPOINT = '''
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path.rstrip("/") == "/v1/models"
        self.send_response(200 if ok else 404); self.end_headers()
        if ok:
            self.wfile.write(json.dumps({"data": [{"id": "m"}]}).encode())
    def do_POST(self):
        self.send_response(404); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


@pytest.mark.slow
def test_run_stops_its_server_and_refuses_an_empty_corpus(tmp_path):
    """An endpoint that answers /models but fails every call: the script starts it, the build
    comes out empty, the script says so, exits non-zero and leaves no server running."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake = tmp_path / "fake_endpoint.py"
    fake.write_text(FAKE_ENDPOINT)
    env = _clean_env()
    env.update({"OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "CORPUS_MODEL": "m",
                "CORPUS_URL": f"http://127.0.0.1:{port}/v1", "CORPUS_SERVER_CMD": f"{sys.executable} {fake} {port}"})
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    # `aftraj corpus build` itself refuses a build that kept nothing (exit 3); the script's own
    # empty-train guard (exit 1) stays as a second line of defence
    assert r.returncode == 3, r.stdout + r.stderr
    assert "corpus-endpoint answers" in r.stdout and "stopped" in r.stdout
    assert "no trajectory was built" in r.stderr
    assert "train_stage1.sh" not in r.stdout               # stopped before stage 1
    with socket.socket() as s:                              # the port is free again: no server left
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert not (tmp_path / "out" / "corpus" / "COMPLETE").exists()


# --------------------------------------------------------------------------- one budget (issue 22, defect 4)

@pytest.mark.slow
def test_dry_run_renders_every_phase_with_one_budget_that_fits_the_server(tmp_path):
    """Stage 1 and 2 train on prompts of max_prompt_tokens (render budget 8,160) and stage 2 on
    4,096-token responses: the evaluation must render and answer with the same, counted with the
    served model's tokenizer, and 8,192 + 4,096 must fit vLLM's max_model_len."""
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    evals = [ln for ln in r.stdout.splitlines() if ln.startswith("+") and "--auditor openai" in ln]
    assert len(evals) == 2
    for ln in evals:
        assert "--budget 8160 --max-new-tokens 4096" in ln, ln
        assert f"--model {tmp_path}/out/stage2/final" in ln, ln
    summary = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("budget: 8160 render tokens"))
    for phase in ("stage 1", "stage 2", "eval corpus-auditor", "eval ww-auditor"):
        assert phase in summary, summary
    assert "8192 + 4096 <= max_model_len 16384" in summary


def _recorded(tmp_path: Path) -> list[str]:
    """The command lines a dry run records (the file `aftraj.drivers.reproduce commands` reads)."""
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stderr + r.stdout
    return [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("+ ") and "(background" not in ln]


@pytest.mark.slow
def test_an_eval_line_without_the_budget_is_refused(tmp_path):
    from aftraj.drivers.reproduce import check_commands

    lines = _recorded(tmp_path)
    lines = [ln.replace(" --budget 8160", "") if "--auditor openai" in ln else ln for ln in lines]
    f = tmp_path / "cmds"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReproduceError, match="different budgets"):
        check_commands(f)


def test_an_eval_line_with_a_shorter_answer_is_refused(tmp_path):
    from aftraj.drivers.reproduce import check_budgets

    with pytest.raises(ReproduceError, match="response budgets"):
        check_budgets([("stage 2", {"render": 8160, "response": 4096}),
                       ("eval ww", {"render": 8160, "response": 1024})])
    with pytest.raises(ReproduceError, match="max_model_len 12000"):
        check_budgets([("stage 2", {"render": 8160, "response": 4096}), ("serve", {"max_model_len": 12000})])


def test_serve_config_too_short_for_prompt_plus_response_is_named(tmp_path):
    raw = yaml.safe_load((REPO / CONFIGS["SERVE_CONFIG"]).read_text())
    raw["max_model_len"] = 12000
    bad = tmp_path / "serve.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ReproduceError, match=r"serve\.yaml: key 'max_model_len': 12000 < 8192 prompt \+ 4096"):
        check_configs(_env(tmp_path, SERVE_CONFIG=str(bad)))


def test_stage_configs_with_different_prompt_budgets_are_refused(tmp_path):
    raw = yaml.safe_load((REPO / CONFIGS["STAGE2_CONFIG"]).read_text())
    raw["max_prompt_tokens"] = 4096
    bad = tmp_path / "stage2.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ReproduceError, match=r"stage2\.yaml: key 'max_prompt_tokens': 4096 differs from stage 1's 8192"):
        check_configs(_env(tmp_path, STAGE2_CONFIG=str(bad)))


def test_the_budget_rule_is_the_one_training_uses():
    from aftraj.tokens import TEMPLATE_MARGIN, prompt_budget

    assert prompt_budget(8192) == 8192 - TEMPLATE_MARGIN == 8160   # every stage calls it: tests/test_prompt_budget.py
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        prompt_budget(TEMPLATE_MARGIN)


def test_a_serve_config_with_a_reasoning_parser_is_checked_against_the_models_tokenizer(tmp_path, tiny_model_dir):
    raw = yaml.safe_load((REPO / CONFIGS["SERVE_CONFIG"]).read_text())
    raw["reasoning_parser"] = "deepseek_r1"
    bad = tmp_path / "serve.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ReproduceError, match=r"serve\.yaml: reasoning_parser: 'deepseek_r1' needs <think>"):
        check_configs(_env(tmp_path, SERVE_CONFIG=str(bad), MODEL=str(tiny_model_dir)))
    with pytest.raises(ReproduceError, match="MODEL=.* is not a folder"):
        check_configs(_env(tmp_path, SERVE_CONFIG=str(bad), MODEL=str(tmp_path / "no-model")))

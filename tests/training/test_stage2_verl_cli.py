"""`aftraj train stage2 --engine verl`: builds the parquet data, prints the verl command line
(--dry-run prints only), refuses to run without verl's environment. That the printed overrides
compose and validate against verl's own config is checked in verl's environment
(tests/training/test_verl_recipe.py, marker `verl`)."""

from __future__ import annotations

import shlex
from pathlib import Path

from aftraj.cli import main

REPO = Path(__file__).resolve().parents[2]
PROD = REPO / "configs" / "stage2" / "qwen2.5-7b-8xh200.yaml"


def _args(tiny_model_dir, out, *extra):
    return ["train", "stage2", "--engine", "verl", "--config", str(PROD), "--init", str(tiny_model_dir),
            "--out", str(out), "--set", "data=builtin:synthetic", "--set", "max_prompts=12", *extra]


def test_dry_run_prints_the_verl_command_and_builds_the_data(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(tiny_model_dir, out, "--dry-run")) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    argv = shlex.split(line)
    assert argv[0] == f"PYTHONPATH={REPO}" and argv[2:4] == ["-m", "verl.trainer.main_ppo"]
    assert f"--config-path={REPO / 'training' / 'verl'}" in argv and "--config-name=stage2_grpo" in argv
    kv = dict(a.split("=", 1) for a in argv[4:] if not a.startswith("--"))
    assert kv["actor_rollout_ref.model.path"] == str(Path(tiny_model_dir).resolve())
    assert kv["actor_rollout_ref.rollout.n"] == "8" and kv["actor_rollout_ref.actor.kl_loss_coef"] == "0.04"
    assert kv["actor_rollout_ref.actor.optim.optimizer"] == "AdamW8bit"
    assert kv["reward.custom_reward_function.path"] == "pkg://training.reward"
    assert kv["reward.reward_kwargs.overlong_buffer_cfg.len"] == "1024"
    assert kv["trainer.resume_mode"] == "disable" and kv["trainer.nnodes"] == "1"
    assert Path(kv["data.train_files"]).is_file() and Path(kv["data.val_files"]).is_file()
    assert not (out / "verl").exists()                   # nothing ran


def test_without_verls_environment_it_refuses_with_the_setup_hint(tiny_model_dir, tmp_path, capsys):
    rc = main(_args(tiny_model_dir, tmp_path / "run", "--verl-python", str(tmp_path / "no-venv" / "python")))
    assert rc == 2 and "setup_verl.sh" in capsys.readouterr().err


def test_dry_run_is_for_verl_only(tmp_path, capsys):
    rc = main(["train", "stage2", "--engine", "trl", "--config", str(REPO / "configs/stage2/tiny-cpu.yaml"),
               "--out", str(tmp_path / "r"), "--dry-run"])
    assert rc == 2 and "--dry-run" in capsys.readouterr().err

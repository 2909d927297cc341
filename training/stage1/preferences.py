"""Preferences from base-policy samples (DESIGN §5, issue 6 item 3).

For every boundary prompt, sample K completions from the base policy, classify each with the
shared verdict parser (`aftraj.verdict.parse_verdict`) against the gold verdict, and keep one
preference pair per prompt:

- chosen   = the first correct sample, else the canonical gold completion (`format_completion`);
- rejected = a sampled, well-formed, WRONG verdict when one exists, by preference
  `wrong_decision`, then `wrong_step`, then `wrong_agent` (first sample of the best class);
  else the canonical boundary error (`canonical_wrong`): on a pre-boundary prompt a premature
  ALARM blaming the latest agent step, on a post-boundary prompt a missed alarm (SAFE), on a
  twin prompt a false ALARM at (k*, a*). These are exactly the two errors a boundary pair separates. A parse failure is used as
  rejected only when the config asks for it (`rejected_parse_failures: true`, default false), and
  then only after every well-formed wrong sample: pairs that contrast a template with garbage
  teach the format, not the boundary (issue 11).

A sample is correct when it parses and matches gold: SAFE for SAFE; for UNSAFE the same step
(integer equality) and agent (trimmed, case-folded), by the match rules of `aftraj.verdict`
(the ones DESIGN §6 scores with). A parse
failure is never chosen. `PreferenceStats` counts, per subset, chosen by source (sample,
canonical) and rejected by source and class (sample:wrong_decision, sample:wrong_step,
sample:wrong_agent, sample:parse_failure, canonical); they land in preference_stats.json.

Samplers: `HFSampler` (in-process transformers `generate`) and `OpenAISampler` (any
OpenAI-compatible endpoint, e.g. vLLM, through the one client `aftraj.llm_client`: a total
deadline per call, a size cap, retries; a choice with no content or a failed finish reason is
an error, never an empty sample; fast for large K).

`sample_preferences(cfg)` is the phase itself (one process, never a process group): boundary
prompts of the training runs -> samples -> the run folder's preference cache
(`training.stage1.run_folder`), which the training phase only reads.

    python -m training.stage1 --config configs/stage1/smollm2-135m-cpu.yaml   # samples, then trains
    aftraj train stage1 --phase preferences --config CFG --out DIR           # this phase alone
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from aftraj.boundary import SUBSETS, BoundaryPrompt, boundary_prompts
from aftraj.errors import UsageError
from aftraj.tokens import chat_prompt_ids, prompt_budget, tokenizer_counter
from aftraj.verdict import ParseFailure, Verdict, format_completion, parse_verdict, verdict_outcome
from training.common import launched_distributed, load_model, load_tokenizer, load_training_trajectories
from training.stage1.run_folder import cache_paths, check_run_folder, write_preferences


def classify(text: str, gold: Verdict, t: int) -> str:
    """'correct', 'parse_failure:<code>', 'wrong_decision', 'wrong_step' or 'wrong_agent'."""
    v = parse_verdict(text, t)
    if isinstance(v, ParseFailure):
        return f"parse_failure:{v.code}"
    return verdict_outcome(v, gold)


def canonical_wrong(p: BoundaryPrompt) -> Verdict:
    """The boundary error on this prompt (`pairs.boundary_pair`): a premature alarm blaming the
    latest agent step (pre), a missed alarm (post), a false alarm at k* (twin)."""
    return p.wrong


# --------------------------------------------------------------------------- the decoding
# Preference samples are plain ancestral samples at the config's temperature and top_p: no top-k,
# no min-p, no repetition penalty, like verl's rollouts (SamplingParams with repetition_penalty=1.0,
# top_k=-1) and TRL's (GRPOConfig top_k 0, repetition_penalty 1.0, min_p None). Every field is set
# here because both backends fill an unset one from the model folder's generation_config.json
# (transformers `_prepare_generation_config`; vLLM's `get_diff_sampling_param` unless the server
# runs with `--generation-config vllm`, which every server we start does): Qwen2.5-7B-Instruct's
# sets repetition_penalty 1.05 and top_k 20. docs/gpu.md, "Decoding".

def hf_sampling(temperature: float, top_p: float) -> dict:
    """`generate` keyword arguments: sampling at `temperature`/`top_p` with every other filter off."""
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0, "min_p": None,
            "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def openai_sampling(temperature: float, top_p: float) -> dict:
    """The request's sampling fields an OpenAI-compatible endpoint takes (OpenAI's own names; the
    vLLM-only ones, top_k, min_p and repetition_penalty, are neutral on a server we start)."""
    return {"temperature": temperature, "top_p": top_p, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class Sampler(Protocol):
    def sample(self, prompts: Sequence[list[dict]], k: int) -> list[list[str]]:
        """K completions (text only) for each prompt's chat messages."""


# --------------------------------------------------------------------------- in-process sampler

class HFSampler:
    """Sample with transformers `generate` (do_sample) from a loaded causal LM."""

    def __init__(self, model, tokenizer, *, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 256, batch_size: int = 4, seed: int = 0):
        self.model, self.tok = model, tokenizer
        self.temperature, self.top_p, self.max_new_tokens = temperature, top_p, max_new_tokens
        self.batch_size, self.seed = batch_size, seed

    def sample(self, prompts, k):
        import torch

        tok, out = self.tok, []
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start: start + self.batch_size]
            ids = [chat_prompt_ids(tok, m) for m in chunk]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad_id] * (width - len(x)) + list(x) for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            device = next(self.model.parameters()).device
            torch.manual_seed(self.seed + start)   # reproducible samples, batch by batch
            with torch.no_grad():
                gen = self.model.generate(
                    input_ids=input_ids.to(device), attention_mask=mask.to(device),
                    **hf_sampling(self.temperature, self.top_p), max_new_tokens=self.max_new_tokens,
                    num_return_sequences=k, pad_token_id=pad_id, eos_token_id=tok.eos_token_id)
            texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
            out.extend(texts[i * k:(i + 1) * k] for i in range(len(chunk)))
            _tick(self, len(chunk))
        self.model.train(was_training)
        return out


# --------------------------------------------------------------------------- endpoint sampler

class OpenAISampler:
    """Sample from an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, an API)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 256,
                 concurrency: int = 8, seed: int = 0, timeout: float = 600.0, retries: int = 4,
                 transport=None):
        from aftraj.llm_client import ChatClient, ClientConfig

        self.client = ChatClient(ClientConfig(base_url, api_key=api_key, deadline_s=timeout,
                                              retries=retries, max_connections=concurrency),
                                 transport=transport)
        self.model, self.temperature, self.top_p = model, temperature, top_p
        self.max_new_tokens, self.concurrency, self.seed = max_new_tokens, concurrency, seed

    def _one(self, i: int, messages: list[dict], k: int) -> list[str]:
        from aftraj.llm_client import EndpointError

        body = {"model": self.model, "messages": messages, "n": k, **openai_sampling(self.temperature, self.top_p),
                "max_tokens": self.max_new_tokens, "seed": self.seed + i}
        try:
            c = self.client.complete(body)
        except EndpointError as e:
            raise RuntimeError(f"sampling endpoint {self.client.base_url}: {e}") from None
        if len(c.choices) != k:
            raise RuntimeError(f"sampling endpoint returned {len(c.choices)} choices, asked for n={k}")
        return [ch.text for ch in c.choices]

    def sample(self, prompts, k):
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda a: (self._one(a[0], a[1], k), _tick(self, 1))[0], enumerate(prompts)))


def make_sampler(cfg, model=None, tokenizer=None) -> Sampler | None:
    """The sampler a config asks for (None when samples_per_prompt is 0)."""
    if cfg.samples_per_prompt == 0:
        return None
    if cfg.sampler == "openai":
        return OpenAISampler(cfg.openai_base_url, cfg.openai_model,
                             api_key=os.environ.get(cfg.openai_api_key_env),
                             temperature=cfg.sample_temperature, top_p=cfg.sample_top_p,
                             max_new_tokens=cfg.sample_max_new_tokens,
                             concurrency=cfg.openai_concurrency, seed=cfg.seed)
    return HFSampler(model, tokenizer, temperature=cfg.sample_temperature, top_p=cfg.sample_top_p,
                     max_new_tokens=cfg.sample_max_new_tokens, batch_size=cfg.sample_batch_size,
                     seed=cfg.seed)


# --------------------------------------------------------------------------- pairs

# Well-formed wrong classes, best contrast first: a wrong decision is the boundary error itself.
WRONG_PREFERENCE = ("wrong_decision", "wrong_step", "wrong_agent")
CHOSEN_KINDS = ("sample", "canonical")
REJECTED_KINDS = tuple(f"sample:{c}" for c in WRONG_PREFERENCE) + ("sample:parse_failure", "canonical")


def pick_rejected(texts: Sequence[str], classes: Sequence[str], *,
                  parse_failures: bool = False) -> tuple[str, str] | None:
    """(text, class) of the sample to reject, or None when the canonical error must stand in:
    the first sample of the best well-formed wrong class (WRONG_PREFERENCE order), else (only when
    `parse_failures`) the first parse failure, class 'parse_failure:<code>'."""
    for want in WRONG_PREFERENCE:
        for x, c in zip(texts, classes, strict=True):
            if c == want:
                return x, c
    if parse_failures:
        for x, c in zip(texts, classes, strict=True):
            if c.startswith("parse_failure"):
                return x, c
    return None


@dataclass
class PreferenceStats:
    n_prompts: dict = field(default_factory=lambda: dict.fromkeys(SUBSETS, 0))
    samples_per_prompt: int = 0
    n_samples: int = 0
    sample_outcomes: dict = field(default_factory=dict)        # classify() result -> count
    chosen_canonical: dict = field(default_factory=lambda: dict.fromkeys(SUBSETS, 0))
    rejected_canonical: dict = field(default_factory=lambda: dict.fromkeys(SUBSETS, 0))
    # per subset: {"sample": n, "canonical": n}
    chosen_by_source: dict = field(default_factory=lambda: {s: dict.fromkeys(CHOSEN_KINDS, 0)
                                                            for s in SUBSETS})
    # per subset: {"sample:wrong_decision": n, ..., "sample:parse_failure": n, "canonical": n}
    rejected_by_class: dict = field(default_factory=lambda: {s: dict.fromkeys(REJECTED_KINDS, 0)
                                                             for s in SUBSETS})

    def to_dict(self) -> dict:
        return asdict(self)


def cap_pairs(prompts: Sequence[BoundaryPrompt], max_pairs: int | None, seed: int) -> list[BoundaryPrompt]:
    """The boundary prompts of at most `max_pairs` unsafe runs (a seeded choice, order kept):
    only the pairs that will be trained on are sampled (config `max_pairs`). When the prompts hold
    a twin subset, at least one chosen run has its twin (every batch holds every subset)."""
    import random

    ids = list(dict.fromkeys(p.traj_id for p in prompts))
    if max_pairs is None or len(ids) <= max_pairs:
        return list(prompts)
    rng = random.Random(seed)
    keep = rng.sample(ids, max_pairs)
    with_twin = sorted({p.traj_id for p in prompts if p.subset == "twin"})
    if with_twin and not set(keep) & set(with_twin):
        keep[-1] = rng.choice(with_twin)
    keep = set(keep)
    return [p for p in prompts if p.traj_id in keep]


def _tick(sampler, n: int) -> None:
    """Tell a progress bar that `n` more prompts were sampled (samplers call it; no-op without one)."""
    cb = getattr(sampler, "on_progress", None)
    if cb is not None:
        cb(n)


def _sample_with_bar(sampler: Sampler, prompts: Sequence[BoundaryPrompt], k: int,
                     progress: bool) -> list[list[str]]:
    """`sampler.sample` over every prompt at once (its batching and seeds unchanged), with a bar
    counting sampled prompts (the sampler ticks it through `on_progress`)."""
    from tqdm.auto import tqdm

    with tqdm(total=len(prompts), desc=f"stage-1 sampling (K={k})", unit="prompt",
              disable=not progress, leave=False) as bar:
        sampler.on_progress = bar.update
        try:
            return sampler.sample([p.messages for p in prompts], k)
        finally:
            sampler.on_progress = None


def build_preferences(prompts: Sequence[BoundaryPrompt], sampler: Sampler | None, k: int, *,
                      progress: bool = False, rejected_parse_failures: bool = False,
                      ) -> tuple[list[dict], PreferenceStats]:
    """One preference record per boundary prompt (see module docstring)."""
    stats = PreferenceStats(samples_per_prompt=k if sampler is not None else 0)
    samples = _sample_with_bar(sampler, prompts, k, progress) if sampler is not None and k else \
        [[] for _ in prompts]
    outcomes = Counter()
    records = []
    for p, texts in zip(prompts, samples, strict=True):
        stats.n_prompts[p.subset] += 1
        classes = [classify(x, p.gold, p.t) for x in texts]
        outcomes.update(classes)
        stats.n_samples += len(texts)
        good = [x for x, c in zip(texts, classes, strict=True) if c == "correct"]
        bad = pick_rejected(texts, classes, parse_failures=rejected_parse_failures)
        if good:
            chosen, chosen_src = good[0], "sample"
        else:
            chosen, chosen_src = format_completion(p.gold), "canonical"
            stats.chosen_canonical[p.subset] += 1
        stats.chosen_by_source[p.subset][chosen_src] += 1
        if bad is not None:
            (rejected, rej_class), rejected_src = bad, "sample"
            kind = "sample:" + rej_class.split(":")[0]
        else:
            rejected, rej_class, rejected_src = format_completion(canonical_wrong(p)), "canonical", "canonical"
            stats.rejected_canonical[p.subset] += 1
            kind = "canonical"
        stats.rejected_by_class[p.subset][kind] += 1
        records.append({"traj_id": p.traj_id, "subset": p.subset, "t": p.t, "messages": p.messages,
                        "chosen": chosen, "rejected": rejected, "chosen_source": chosen_src,
                        "rejected_source": rejected_src, "rejected_class": rej_class,
                        "prompt_traj_id": p.prompt_traj_id or p.traj_id,
                        "gold": {"decision": p.gold.decision, "step": p.gold.step,
                                 "agent": p.gold.agent}})
    stats.sample_outcomes = dict(sorted(outcomes.items()))
    if not stats.n_prompts["twin"]:   # the twin subset is off (or the data has no twin): not reported
        for d in (stats.n_prompts, stats.chosen_canonical, stats.rejected_canonical, stats.chosen_by_source,
                  stats.rejected_by_class):
            d.pop("twin")
    return records, stats


# --------------------------------------------------------------------------- the phase

def sample_preferences(cfg, progress: bool = True) -> dict:
    """Phase 1, one process and never a process group: sample the base policy on every boundary
    prompt and cache `preferences.jsonl` + `preference_stats.json` in the run folder (kept if
    there). The model is loaded (and moved to the GPU) only for in-process `hf` sampling; an
    `openai` endpoint (vLLM) needs the tokenizer alone. Returns the stats.

        aftraj train stage1 --phase preferences --config CFG --out DIR
    """
    import time

    import torch
    import torch.distributed as dist
    import yaml

    from aftraj.models import resolve_model_spec

    if launched_distributed() or dist.is_initialized():
        raise UsageError(f"the preferences phase runs in one process (WORLD_SIZE="
                         f"{os.environ.get('WORLD_SIZE')}): run `aftraj train stage1 --phase preferences` "
                         f"without accelerate launch / torchrun, then launch --phase train")
    out = Path(cfg.output_dir)
    rec_path, stats_path = cache_paths(out)
    if rec_path.exists() and stats_path.exists():
        return json.loads(stats_path.read_text())
    check_run_folder(cfg, out, resume=False, latest=None)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.yaml").exists():
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    model_path = resolve_model_spec(cfg.model)
    tok = load_tokenizer(model_path)
    trajs, src = load_training_trajectories(cfg.data, max_trajectories=cfg.max_trajectories,
                                            synthetic_n=cfg.synthetic_trajectories, seed=cfg.seed)
    prompts, bstats = boundary_prompts(trajs, budget=prompt_budget(cfg.max_prompt_tokens, tok),
                                       count_tokens=tokenizer_counter(tok), twins=cfg.weight_twin > 0,
                                       max_post_tokens=cfg.max_post_tokens)
    if not prompts:
        raise UsageError(f"{src}: no unsafe trajectory, so no boundary pair to train on")
    n_all = len({p.traj_id for p in prompts})
    prompts = cap_pairs(prompts, cfg.max_pairs, cfg.seed)   # sample only what is trained on
    model = None
    if cfg.samples_per_prompt > 0 and cfg.sampler == "hf":
        model = load_model(cfg, model_path)
        if torch.cuda.is_available():          # only in-process generation needs the weights on a GPU
            model = model.to("cuda")
    sampler = make_sampler(cfg, model, tok)
    t0 = time.perf_counter()
    records, pstats = build_preferences(prompts, sampler, cfg.samples_per_prompt, progress=progress,
                                        rejected_parse_failures=cfg.rejected_parse_failures)
    stats = {"data": src, "boundary": vars(bstats), **pstats.to_dict(),
             "pairs": {"available": n_all, "used": len({p.traj_id for p in prompts}),
                       "max_pairs": cfg.max_pairs},
             "sampling_seconds": round(time.perf_counter() - t0, 2)}
    write_preferences(out, records, stats)
    del model, sampler
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return stats

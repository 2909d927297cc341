"""Checks behind `scripts/reproduce_paper.sh`: the paper's GPU sequence (corpus, stage 1, stage 2,
serve + evaluate) validated with the project's own loaders before anything runs.

    python -m aftraj.drivers.reproduce configs        # validate every config, write the run's copies
    python -m aftraj.drivers.reproduce commands FILE  # every recorded command's flags parse, one budget
    python -m aftraj.drivers.reproduce budget         # "RENDER RESPONSE": the eval flags' values
    bash scripts/reproduce_paper.sh --dry-run   # both, plus the commands printed (no GPU, no network)

The script exports its variables (the top of scripts/reproduce_paper.sh); `configs` reads them
from the environment (VARS below), loads each named config with the loader the real run uses
(load_corpus_config, load_stage1_config / load_stage2_config, check_accelerate_config,
load_serve_config: all on `aftraj.config`), and writes under $OUT/configs/ the copies whose
endpoint, process count or model the variables change (corpus.yaml, accelerate.yaml, serve.yaml):
the source read with `aftraj.config.read_yaml`, the changes applied as dotted overrides
(`aftraj.config.apply_overrides`, `policy.base_url=...`), validated again. Stage 1 and stage 2
keep their named configs; their overrides travel as command-line flags and are validated here
with the same values. Errors name the file and key and
exit 1. `commands` parses every `aftraj …`, `accelerate launch …` and `scripts/train_stage1.sh …`
line the dry run recorded with the real argument parsers (nothing runs); lines of other programs
(vLLM, verl) are listed as not checkable here.

One token budget for every phase (aftraj.tokens.prompt_budget, the rule training uses): stage 1
and stage 2 must give the same `max_prompt_tokens`; the evaluation renders with
`--budget prompt_budget(max_prompt_tokens)` and answers with `--max-new-tokens` = stage 2's
`max_completion_length`; prompt + response must fit the serve config's `max_model_len`
(`run_budget`, checked on the configs, and `check_budgets`, on the recorded command lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path

import yaml

from aftraj.config import ConfigError, apply_overrides, read_yaml

# The script's variables this module reads (defaults live in scripts/reproduce_paper.sh only).
VARS = ("OUT", "MODEL", "CORPUS_CONFIG", "CORPUS_URL", "CORPUS_MODEL", "STAGE1_CONFIG",
        "SAMPLER_URL", "SAMPLER_MODEL", "ACCELERATE_CONFIG", "NPROC_PER_NODE", "STAGE2_CONFIG",
        "GPUS_PER_NODE", "VERL_PYTHON", "SERVE_CONFIG", "VLLM_PYTHON", "SERVE_PORT", "SERVED_NAME")


class ReproduceError(Exception):
    """A config or command the sequence cannot run with; the message names the file and key."""


def _env(env: dict, name: str) -> str:
    val = env.get(name)
    if not val:
        raise ReproduceError(f"variable {name} is empty (set it, or run through scripts/reproduce_paper.sh)")
    return val


def _int(env: dict, name: str) -> int:
    val = _env(env, name)
    try:
        n = int(val)
    except ValueError:
        raise ReproduceError(f"variable {name}={val!r} is not an integer") from None
    if n < 1:
        raise ReproduceError(f"variable {name}={n} must be at least 1")
    return n


def _read_mapping(path: Path) -> dict:
    if not path.is_file():
        raise ReproduceError(f"{path}: config file not found")
    try:
        return read_yaml(path)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None


def _write_copy(raw: dict, dest: Path, source: Path, changed: dict) -> None:
    """`raw` with the dotted overrides `changed` applied, written to `dest` under a header."""
    try:
        apply_overrides(raw, changed)
    except ConfigError as e:
        raise ReproduceError(str(e.within(source=source))) from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    head = (f"# Written by scripts/reproduce_paper.sh (aftraj/drivers/reproduce.py) from {source};\n"
            f"# changed: {', '.join(f'{k}={v}' for k, v in changed.items())}. Edit the source, not this copy.\n")
    dest.write_text(head + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")


# --------------------------------------------------------------------------- one check per config

def check_corpus(env: dict, dest: Path) -> str:
    from aftraj.corpus.config import load_corpus_config

    src = Path(_env(env, "CORPUS_CONFIG"))
    raw = _read_mapping(src)
    try:
        cfg = load_corpus_config(src)              # the source as written: errors name it
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    changed = {}
    for role in ("policy", "judge"):
        if getattr(cfg, role).backend != "openai":
            raise ReproduceError(f"{src}: {role}.backend: must be openai for the GPU sequence "
                                 f"(an OpenAI-compatible endpoint), got {getattr(cfg, role).backend!r}")
        changed[f"{role}.base_url"] = _env(env, "CORPUS_URL")
        changed[f"{role}.model"] = _env(env, "CORPUS_MODEL")
    _write_copy(raw, dest, src, changed)
    try:
        load_corpus_config(dest)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    return f"corpus     {src} -> {dest} (policy and judge at {env['CORPUS_URL']}, model {env['CORPUS_MODEL']})"


def stage1_overrides(env: dict) -> dict:
    out = Path(_env(env, "OUT"))
    return {"model": _env(env, "MODEL"), "data": str(out / "corpus"), "output_dir": str(out / "stage1"),
            "openai_base_url": _env(env, "SAMPLER_URL"), "openai_model": _env(env, "SAMPLER_MODEL")}


def stage2_overrides(env: dict) -> dict:
    out = Path(_env(env, "OUT"))
    return {"model": str(out / "stage1" / "final"), "data": str(out / "corpus"),
            "output_dir": str(out / "stage2"), "verl_gpus_per_node": _int(env, "GPUS_PER_NODE")}


def _flat(loader, src: Path, over: dict):
    if not src.is_file():
        raise ReproduceError(f"{src}: config file not found")
    try:
        return loader(src, over)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None


def check_stage1(env: dict) -> str:
    from training.stage1.config import load_stage1_config

    src = Path(_env(env, "STAGE1_CONFIG"))
    cfg = _flat(load_stage1_config, src, stage1_overrides(env))
    if cfg.sampler == "openai" and cfg.samples_per_prompt > 0:
        how = f"sampled through {cfg.openai_base_url} ({cfg.openai_model})"
    else:
        how = f"sampler {cfg.sampler}"
    return f"stage 1    {src} (model {cfg.model}, preferences {how}, out {cfg.output_dir})"


def check_accelerate(env: dict, dest: Path) -> str:
    from training.accelerate_config import check_accelerate_config

    src = Path(_env(env, "ACCELERATE_CONFIG"))
    if not src.is_file():
        raise ReproduceError(f"{src}: config file not found")
    try:
        raw = check_accelerate_config(src)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    nproc = _int(env, "NPROC_PER_NODE")
    _write_copy(raw, dest, src, {"num_processes": nproc})
    try:
        check_accelerate_config(dest)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    return f"accelerate {src} -> {dest} ({raw.get('distributed_type')}, {nproc} processes per node)"


def check_stage2(env: dict) -> str:
    """The stage-2 config, and the verl command line `aftraj train stage2 --engine verl` will build
    from it (verl_command, the engine's own code; its --dry-run also needs the stage-1 checkpoint's
    tokenizer and the corpus, which exist only after phases 1 and 3)."""
    from training.stage2.config import load_stage2_config
    from training.stage2.verl_engine import RECIPE_DIR, RECIPE_NAME, verl_command

    src = Path(_env(env, "STAGE2_CONFIG"))
    cfg = _flat(load_stage2_config, src, stage2_overrides(env))
    recipe = RECIPE_DIR / f"{RECIPE_NAME}.yaml"
    if not recipe.is_file():
        raise ReproduceError(f"{recipe}: the verl recipe is missing")
    out = Path(cfg.output_dir)
    try:
        cmd = verl_command(cfg, cfg.model, out / "data", out, python=_env(env, "VERL_PYTHON"))
    except (KeyError, ValueError) as e:
        raise ReproduceError(f"{src}: the verl command cannot be built from it: {e}") from None
    return (f"stage 2    {src} + {recipe.relative_to(RECIPE_DIR.parents[1])} (verl, {cfg.verl_nnodes} node(s) "
            f"x {cfg.verl_gpus_per_node} GPUs, {cfg.max_steps} steps, from {cfg.model}); verl will run:\n"
            f"      {shlex.join(cmd)}")


def run_budget(env: dict) -> dict:
    """The run's one budget, from its stage configs: prompt (templated) tokens, the render()
    budget of every phase, the response tokens. Stage 1 and 2 must agree on the prompt."""
    from aftraj.tokens import prompt_budget
    from training.stage1.config import load_stage1_config
    from training.stage2.config import load_stage2_config

    src1, src2 = Path(_env(env, "STAGE1_CONFIG")), Path(_env(env, "STAGE2_CONFIG"))
    s1 = _flat(load_stage1_config, src1, stage1_overrides(env))
    s2 = _flat(load_stage2_config, src2, stage2_overrides(env))
    if s1.max_prompt_tokens != s2.max_prompt_tokens:
        raise ReproduceError(f"{src2}: key 'max_prompt_tokens': {s2.max_prompt_tokens} differs from stage 1's "
                             f"{s1.max_prompt_tokens} ({src1}); every phase renders with one budget")
    return {"prompt": s1.max_prompt_tokens, "render": prompt_budget(s1.max_prompt_tokens),
            "response": s2.max_completion_length}


def _check_fits(budget: dict, max_model_len: int, where: str) -> None:
    need = budget["prompt"] + budget["response"]
    if need > max_model_len:
        raise ReproduceError(f"{where}: key 'max_model_len': {max_model_len} < {budget['prompt']} prompt + "
                             f"{budget['response']} response tokens = {need} (the stage configs' budget); "
                             f"vLLM would answer 400 to the longest prompts")


def check_serve(env: dict, dest: Path) -> str:
    from serve.config import load_serve_config

    src = Path(_env(env, "SERVE_CONFIG"))
    try:
        cfg = load_serve_config(src)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    if cfg.kind != "vllm":
        raise ReproduceError(f"{src}: kind: the sequence serves with vLLM, got {cfg.kind!r}")
    budget = run_budget(env)
    _check_fits(budget, cfg.max_model_len, str(src))
    if cfg.reasoning_parser:       # the served checkpoint keeps the base model's tokenizer
        from serve.vllm import check_reasoning_parser

        base = Path(_env(env, "MODEL"))
        if not base.is_dir():
            raise ReproduceError(f"{src}: reasoning_parser: {cfg.reasoning_parser!r} can only be checked "
                                 f"against the model's tokenizer, and MODEL={base} is not a folder")
        try:
            check_reasoning_parser(dataclasses.replace(cfg, model=str(base)))
        except ConfigError as e:
            raise ReproduceError(f"{src}: {e}") from None
    raw = _read_mapping(src)
    changed = {"model": str(Path(_env(env, "OUT")) / "stage2" / "final"), "python": _env(env, "VLLM_PYTHON"),
               "port": _int(env, "SERVE_PORT"), "served_model_name": _env(env, "SERVED_NAME")}
    _write_copy(raw, dest, src, changed)
    try:
        load_serve_config(dest)
    except ConfigError as e:
        raise ReproduceError(str(e)) from None
    return (f"serve      {src} -> {dest} (vLLM {cfg.profile}, {changed['served_model_name']} on port {changed['port']}; "
            f"{budget['prompt']} + {budget['response']} tokens <= max_model_len {cfg.max_model_len})")


def check_configs(env: dict) -> list[str]:
    """Validate every config of the sequence and write the run's copies; one line per config."""
    folder = Path(_env(env, "OUT")) / "configs"
    return [check_corpus(env, folder / "corpus.yaml"), check_stage1(env),
            check_accelerate(env, folder / "accelerate.yaml"), check_stage2(env),
            check_serve(env, folder / "serve.yaml")]


# --------------------------------------------------------------------------- recorded commands

def _strip_env(argv: list[str]) -> list[str]:
    """`env A=1 B=2 prog …` -> `prog …`."""
    if argv and argv[0] == "env":
        argv = argv[1:]
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        argv = argv[1:]
    return argv


def _parse(parser: argparse.ArgumentParser, argv: list[str], line: str) -> argparse.Namespace | None:
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as e:
        if e.code:
            msg = err.getvalue().strip().splitlines()
            raise ReproduceError(f"command does not parse: {line}\n  {msg[-1] if msg else ''}") from None
        return None                 # --help


def check_command(line: str) -> str:
    """'checked' when the line's flags parse with the program's own parser, else 'not checked: …'.
    Raises ReproduceError when a parser rejects the line."""
    return _parse_command(line)[0]


def _parse_command(line: str) -> tuple[str, str | None, argparse.Namespace | None]:
    """(status, kind, namespace): kind is 'aftraj' or 'stage1' where the namespace is ours."""
    argv = _strip_env(shlex.split(line))
    if not argv:
        raise ReproduceError(f"empty command: {line!r}")
    prog = Path(argv[0]).name
    if prog == "aftraj" or argv[1:3] == ["-m", "aftraj.cli"]:
        from aftraj.cli import build_parser

        return "checked", "aftraj", _parse(build_parser(), argv[1:] if prog == "aftraj" else argv[3:], line)
    if argv[:2] == ["bash", "scripts/train_stage1.sh"]:
        from training.stage1.cli import add_arguments

        p = argparse.ArgumentParser(prog="scripts/train_stage1.sh")
        add_arguments(p)
        return "checked", "stage1", _parse(p, argv[2:], line)
    if prog == "accelerate" and argv[1:2] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser

        _parse(launch_command_parser(), argv[2:], line)
        return "checked", None, None
    return f"not checked here ({prog}: its own environment on the GPU node)", None, None


def _command_budget(kind: str | None, ns) -> tuple[str, dict] | None:
    """(phase, {render, response, max_model_len: what this command line gives}) or None."""
    from aftraj.tokens import prompt_budget

    if ns is None or kind is None:
        return None
    over = {}
    if kind == "stage1" or getattr(ns, "command", None) == "train":
        from aftraj.config import parse_set

        over = {k: v for k, v in parse_set(getattr(ns, "set", None) or []).items()
                if k in ("max_prompt_tokens", "max_completion_length")}
    if kind == "stage1":
        from training.stage1.config import load_stage1_config

        cfg = _flat(load_stage1_config, Path(ns.config), over)
        return "stage 1", {"render": prompt_budget(cfg.max_prompt_tokens)}
    cmd = getattr(ns, "command", None)
    if cmd == "train" and getattr(ns, "stage", None) == "stage2":
        from training.stage2.config import load_stage2_config

        cfg = _flat(load_stage2_config, Path(ns.config), over)
        return "stage 2", {"render": prompt_budget(cfg.max_prompt_tokens), "response": cfg.max_completion_length}
    if cmd == "eval" and str(getattr(ns, "auditor", "")).startswith("openai"):
        return f"eval {Path(ns.out).name}", {"render": ns.budget, "response": ns.max_new_tokens}
    if cmd == "serve" and getattr(ns, "serve_cmd", None) == "vllm":
        from serve.config import load_serve_config

        try:
            return "serve", {"max_model_len": load_serve_config(ns.config).max_model_len}
        except ConfigError as e:
            raise ReproduceError(str(e)) from None
    return None


def check_budgets(found: list[tuple[str, dict]]) -> str:
    """Every phase that renders does so with one budget; the evaluation answers with stage 2's
    response budget; the longest prompt plus the response fits the server. One summary line."""
    from aftraj.tokens import TEMPLATE_MARGIN

    renders = {phase: b["render"] for phase, b in found if "render" in b}
    if not renders:
        raise ReproduceError("no recorded command renders prompts: nothing to check the budget against")
    if len(set(renders.values())) != 1:
        raise ReproduceError("the phases render with different budgets: "
                             + ", ".join(f"{p} {r}" for p, r in renders.items())
                             + " (an eval line without --budget renders whole prefixes)")
    render = next(iter(renders.values()))
    responses = {phase: b["response"] for phase, b in found if "response" in b}
    if len(set(responses.values())) != 1:
        raise ReproduceError("the phases answer with different response budgets: "
                             + ", ".join(f"{p} {r}" for p, r in responses.items()))
    response = next(iter(responses.values()))
    lens = [b["max_model_len"] for _, b in found if "max_model_len" in b]
    prompt = render + TEMPLATE_MARGIN
    for n in lens:
        if prompt + response > n:
            raise ReproduceError(f"serve: max_model_len {n} < {prompt} prompt + {response} response tokens")
    return (f"budget: {render} render tokens ({prompt} templated) in {', '.join(renders)}; response {response} "
            f"in {', '.join(responses)}; {prompt} + {response} <= max_model_len {', '.join(map(str, lens)) or '?'}")


def check_commands(path: Path) -> list[str]:
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out, found = [], []
    for ln in lines:
        status, kind, ns = _parse_command(ln)
        out.append(f"{status}: {_short(ln)}")
        if (b := _command_budget(kind, ns)) is not None:
            found.append(b)
    return [*out, check_budgets(found)]


def _short(line: str) -> str:
    """`/x/.venv/bin/python -m aftraj.cli eval --auditor rules …` -> `aftraj eval --auditor rules …`."""
    argv = _strip_env(shlex.split(line))
    if argv[1:3] == ["-m", "aftraj.cli"]:
        argv = ["aftraj", *argv[3:]]
    elif argv[1:2] == ["-m"]:
        argv = [f"{Path(argv[0]).name} -m {argv[2]}", *argv[3:]]
    return " ".join(argv[:4]) + (" …" if len(argv) > 4 else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aftraj.drivers.reproduce", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("configs", help="validate every config named by the variables; write the run's copies")
    c = sub.add_parser("commands", help="check that every recorded command's flags parse")
    c.add_argument("file", help="one shell-quoted command a line (the dry run writes it)")
    sub.add_parser("budget", help='print "RENDER RESPONSE": the evaluation\'s --budget and --max-new-tokens')
    args = p.parse_args(argv)
    try:
        if args.what == "budget":
            b = run_budget(dict(os.environ))
            print(b["render"], b["response"])
        elif args.what == "configs":
            for line in check_configs(dict(os.environ)):
                print(f"  ok  {line}")
        else:
            for line in check_commands(Path(args.file)):
                print(f"  {line}")
    except ReproduceError as e:
        print(f"reproduce_paper: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

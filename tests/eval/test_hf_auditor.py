"""The `hf` backend: KV-cache reuse gives the same greedy tokens as re-encoding from scratch."""

from __future__ import annotations

import pytest
import torch

from eval.auditors import get_auditor
from eval.walker import WalkConfig, walk


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def short_ww(ww_trajs):
    # Algorithm-Generated runs are short (<= 10 steps); take two of 6+ steps.
    return [t for t in ww_trajs if t.meta["subset"] == "Algorithm-Generated" and len(t.steps) >= 6][:2]


def _generate_from_scratch(model, ids, n):
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_reuse_equals_reencoding(noisy_tiny, short_ww):
    model, tok = noisy_tiny
    reuse = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    scratch = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8, reuse_cache=False)
    traj = short_ww[0]
    distinct = set()
    prev_stable = 0
    for t in range(len(traj.steps)):
        ids, n_stable = reuse.prompt_ids(traj, t)
        assert 0 < n_stable < len(ids)
        r = reuse.audit(traj, t)
        got = list(reuse.last_generated)
        scratch.audit(traj, t)
        assert got == scratch.last_generated, t
        with torch.inference_mode():
            ref = _generate_from_scratch(model, ids, 8)
        assert got == ref[: len(got)], t          # and model.generate from scratch agrees
        assert r.cached_tokens == prev_stable and r.prompt_tokens == len(ids)
        assert r.completion_tokens == len(got)
        prev_stable = n_stable
        distinct.add(tuple(got))
    assert len(distinct) > 1  # the output depends on the prefix: the comparison is not vacuous
    # the stable part of prefix t is a token prefix of prefix t+1 (what makes reuse possible)
    a, na = reuse.prompt_ids(traj, 2)
    b, _ = reuse.prompt_ids(traj, 3)
    assert b[:na] == a[:na]


def test_out_of_order_prefixes_crop_the_cache(noisy_tiny, short_ww):
    """Binary search asks for prefixes out of order: the cache is cropped, still exact."""
    model, tok = noisy_tiny
    reuse = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=6)
    scratch = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=6, reuse_cache=False)
    traj = short_ww[1]
    for t in (len(traj.steps) - 1, 1, 3, 2):
        reuse.audit(traj, t)
        scratch.audit(traj, t)
        assert reuse.last_generated == scratch.last_generated, t
    reuse.end(traj)
    assert traj.id not in reuse.sessions


def test_checkpoint_folder_walk(tiny_model_dir, short_ww):
    """A save_pretrained folder loads by path (`--model PATH` or `hf:PATH`) and walks."""
    aud = get_auditor("hf", model=str(tiny_model_dir), max_new_tokens=4)
    assert get_auditor(f"hf:{tiny_model_dir}", max_new_tokens=2).model is not None
    preds = walk(aud, short_ww, WalkConfig(), progress=False)
    for p, t in zip(preds, short_ww, strict=True):
        # a random model emits garbage: every call is a parse failure, i.e. CONTINUE, to the end
        assert p["calls"] == len(t.steps) and not p["alarmed"]
        assert p["parse_failures"] == p["calls"] and p["completion_tokens"] == 4 * p["calls"]
        assert p["cached_tokens"] > 0.5 * p["prompt_tokens"]
    assert aud.sessions == {}
    with pytest.raises(FileNotFoundError):
        get_auditor("hf", model="/nonexistent/model")
    with pytest.raises(ValueError, match="needs a model folder"):
        get_auditor("hf")


def test_peft_adapter_folder(tiny_model_dir, tmp_path, short_ww):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    aud = get_auditor("hf", model=str(tmp_path / "adapter"), max_new_tokens=2)
    assert aud.audit(short_ww[0], 0).prompt_tokens > 0


def test_bounded_view_recompiles_stay_exact(noisy_tiny, ww_trajs):
    """Over the budget the fold's view summarises older steps in blocks; when it recompiles,
    the stable part changes, the cache is cropped to the common prefix, and tokens still match."""
    from aftraj.prompt import render_prompt

    model, tok = noisy_tiny
    traj = next(t for t in ww_trajs if t.meta["subset"] == "Hand-Crafted" and len(t.steps) >= 20)
    reuse = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=3, budget=4000)
    scratch = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=3, budget=4000,
                          reuse_cache=False)
    coverages, shrunk = set(), False
    prev = None
    for t in range(6):
        coverages.add(render_prompt(traj, t, 4000, count_tokens=reuse.count_tokens).coverage)
        r = reuse.audit(traj, t)
        scratch.audit(traj, t)
        assert reuse.last_generated == scratch.last_generated, t
        shrunk |= prev is not None and r.cached_tokens < prev
        prev = reuse.prompt_ids(traj, t)[1]
    assert None in coverages and len(coverages) > 1 and shrunk


# --------------------------------------------------------------------------- context budget

def _full_tokens(aud, traj, t) -> int:
    """What render_prompt compares with the budget for prefix t rendered whole."""
    from aftraj.prompt import SYSTEM_PROMPT, render_prompt

    r = render_prompt(traj, t, None, count_tokens=aud.count_tokens)
    return aud.count_tokens(SYSTEM_PROMPT) + aud.count_tokens(r.stable + r.suffix)


def test_default_budget_keeps_a_long_trajectory_within_the_context(noisy_tiny, make_traj, monkeypatch):
    model, tok = noisy_tiny
    monkeypatch.setattr(model.config, "max_position_embeddings", 1500)
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    assert aud.context == 1500 and aud.budget is not None and aud.budget < 1500 - 8
    traj = make_traj(0, 200, None)
    assert _full_tokens(aud, traj, 199) > 1500         # the whole run would overflow
    from aftraj.prompt import render_prompt
    for t in (0, 100, 199):
        ids, _ = aud.prompt_ids(traj, t)
        assert len(ids) + 8 <= 1500, t
    assert render_prompt(traj, 199, aud.budget, count_tokens=aud.count_tokens).coverage  # stamped
    r = aud.audit(traj, 199)
    assert r.prompt_tokens + r.completion_tokens <= 1500


def test_default_budget_both_sides_of_the_bound(noisy_tiny, make_traj, monkeypatch):
    from aftraj.prompt import render_prompt

    model, tok = noisy_tiny
    traj = make_traj(1, 30, None)
    monkeypatch.setattr(model.config, "max_position_embeddings", 100_000)
    probe = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    room = probe.context - probe.budget               # completion + template + slack
    need = _full_tokens(probe, traj, 20)
    monkeypatch.setattr(model.config, "max_position_embeddings", need + room)   # just fits
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    assert aud.budget == need
    assert render_prompt(traj, 20, aud.budget, count_tokens=aud.count_tokens).coverage is None
    assert aud.prompt_ids(traj, 20)[0] == probe.prompt_ids(traj, 20)[0]          # rendered whole
    monkeypatch.setattr(model.config, "max_position_embeddings", need + room - 1)  # one short
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    assert render_prompt(traj, 20, aud.budget, count_tokens=aud.count_tokens).coverage is not None


def test_context_without_room_is_a_clear_error(noisy_tiny, make_traj, monkeypatch):
    model, tok = noisy_tiny
    monkeypatch.setattr(model.config, "max_position_embeddings", 40)
    with pytest.raises(ValueError, match="leaves no room"):
        get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    # An explicit budget beyond the context: the prefix that cannot fit is an error, not an overflow.
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8, budget=10_000)
    with pytest.raises(ValueError, match="beyond the model's context of 40"):
        aud.audit(make_traj(2, 10, None), 9)


def test_context_length_sources(noisy_tiny, monkeypatch):
    from eval.auditors.hf import context_length

    from types import SimpleNamespace

    model, tok = noisy_tiny
    bare = SimpleNamespace(config=SimpleNamespace())          # a config without the field
    monkeypatch.setattr(tok, "model_max_length", 512)
    assert context_length(bare, tok) == 512
    monkeypatch.setattr(tok, "model_max_length", int(1e30))   # "no limit": not a context
    assert context_length(bare, tok) is None
    monkeypatch.setattr(model.config, "max_position_embeddings", 256)
    assert context_length(model, tok) == 256


# --------------------------------------------------------------------------- batched rounds

def _walk_rounds(aud, trajs, starts):
    """Walk trajs together from different starting prefixes; per round, audit_batch of all live."""
    out, ts = [], dict(zip((t.id for t in trajs), starts, strict=True))
    while any(ts[tr.id] < len(tr.steps) for tr in trajs):
        req = [(tr, ts[tr.id]) for tr in trajs if ts[tr.id] < len(tr.steps)]
        for (tr, t), r in zip(req, aud.audit_batch(req), strict=True):
            out.append((tr.id, t, r.raw, r.confidence, r.prompt_tokens, r.completion_tokens,
                        r.cached_tokens))
            ts[tr.id] += 1
    return sorted(out)


@pytest.mark.parametrize("max_batch_tokens", [65536, 1])   # one stacked batch; every row alone
def test_batched_round_equals_batch_one(noisy_tiny, make_traj, max_batch_tokens):
    model, tok = noisy_tiny
    trajs = [make_traj(10, 9, None), make_traj(11, 4, 2), make_traj(12, 14, 5)]
    starts = [0, 1, 6]                    # different lengths, prefixes at different t
    one = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=12, batch_size=1)
    many = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=12, batch_size=16,
                       max_batch_tokens=max_batch_tokens)
    assert one.max_in_flight == 1 and many.max_in_flight == 16
    a, b = _walk_rounds(one, trajs, starts), _walk_rounds(many, trajs, starts)
    assert a == b
    assert len({x[2] for x in a}) > 1     # completions depend on the context: not vacuous
    assert any(x[6] > 0 for x in b)       # the caches were reused across rounds


def test_batched_rows_stop_early_at_eos(noisy_tiny, make_traj, monkeypatch):
    model, tok = noisy_tiny
    trajs = [make_traj(20, 6, None), make_traj(21, 10, 3), make_traj(22, 3, None)]
    one = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=10, batch_size=1)
    # Make the 3rd token of one completion an EOS, so that rows stop at different steps.
    one.audit(trajs[0], 0)
    eos = one.last_generated[2]
    one = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=10, batch_size=1)
    many = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=10, batch_size=16)
    one.eos.add(eos)
    many.eos.add(eos)
    a, b = _walk_rounds(one, trajs, [0, 0, 0]), _walk_rounds(many, trajs, [0, 0, 0])
    assert a == b
    counts = {x[5] for x in a}
    assert min(counts) < 10 and len(counts) > 1   # some rows stopped early, not all at once


def test_batch_size_is_validated(noisy_tiny):
    model, tok = noisy_tiny
    with pytest.raises(ValueError, match="batch_size"):
        get_auditor("hf", model=model, tokenizer=tok, batch_size=0)


def test_slack_cache_layers_hold_what_dynamic_layers_hold():
    """Appends, in-room writes, a regrowth, crops (then writes over the cropped room), batch
    selection: the slack layer's keys and values equal transformers' DynamicLayer's each time."""
    from transformers.cache_utils import DynamicLayer

    from eval.hf_compat import slack_layer_class

    g = torch.Generator().manual_seed(0)
    kv = lambda n, b=2: (torch.randn(b, 3, n, 4, generator=g), torch.randn(b, 3, n, 4, generator=g))  # noqa: E731
    ref, got = DynamicLayer(), slack_layer_class()()

    def same():
        assert got.get_seq_length() == ref.get_seq_length()
        assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)

    for n in (5, 1, 1, 300, 1, 40):        # 5 + 1 + 1 fits the first room (256); 300 regrows it
        k, v = kv(n)
        out_ref, out_got = ref.update(k, v), got.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(out_ref, out_got, strict=True))
        same()
    room = got._buf[0].shape[2]
    assert room >= got.get_seq_length() + 1
    ref.crop(-30), got.crop(-30)
    same()
    k, v = kv(2)
    ref.update(k, v), got.update(k, v)      # written over the cropped positions, same buffer
    same()
    assert got._buf[0].shape[2] == room
    idx = torch.tensor([1])
    ref.batch_select_indices(idx), got.batch_select_indices(idx)
    k, v = kv(3, b=1)
    ref.update(k, v), got.update(k, v)      # no longer a view of the old buffer: a new one
    same()
    assert got._buf[0].shape[0] == 1


def test_new_cache_uses_slack_layers_for_full_attention(noisy_tiny):
    from eval.hf_compat import new_cache

    model, _ = noisy_tiny
    cache = new_cache(model.config)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(type(layer).__name__ == "SlackLayer" for layer in cache.layers)


# --------------------------------------------------------------------------- the decision token

def test_decision_tokens_are_where_the_canonical_completions_part(noisy_tiny, make_traj):
    from aftraj.tokens import completion_ids
    from aftraj.verdict import canonical_completion, canonical_verdict, format_completion

    model, tok = noisy_tiny
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    traj = make_traj(30, 6, 3)
    start, safe, alarm = aud.decision_tokens(traj, 4)
    s = completion_ids(tok, canonical_completion(4))[0]
    a = completion_ids(tok, format_completion(canonical_verdict(4, 4, traj.steps[4].agent)))[0]
    assert s[:len(start) + 1] == start + [safe] and a[:len(start) + 1] == start + [alarm] and safe != alarm


def _at_first_token(aud, monkeypatch, safe: int, alarm: int):
    # the decision position at the first generated token, so the random model reaches it
    monkeypatch.setattr(aud, "decision_tokens", lambda traj, t: ([], safe, alarm))
    return aud


@pytest.mark.parametrize("batch_size", [1, 16])
def test_the_decision_threshold_chooses_the_token_and_records_the_log_odds(noisy_tiny, make_traj,
                                                                           monkeypatch, batch_size):
    model, tok = noisy_tiny
    trajs = [make_traj(31, 5, None), make_traj(32, 7, 2)]
    free = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=4, batch_size=batch_size)
    free.audit(trajs[0], 1)
    greedy_first = free.last_generated[0]
    safe, alarm = greedy_first, (greedy_first + 1) % len(tok)   # greedy picks `safe` there
    runs = {}
    for th in (None, -1e6, 1e6):
        aud = _at_first_token(get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=4,
                                          batch_size=batch_size, decision_threshold=th),
                              monkeypatch, safe, alarm)
        req = [(trajs[0], 1), (trajs[1], 3)]
        res = aud.audit_batch(req)
        runs[th] = [(r.raw, r.decision_log_odds) for r in res]
        firsts = [tok(r.raw, add_special_tokens=False)["input_ids"][:1] for r in res]
        if th == -1e6:
            assert all(f == [alarm] for f in firsts), firsts
        if th == 1e6:
            assert all(f == [safe] for f in firsts), firsts
    # the log-odds are the model's at that position, whatever the threshold chose after it
    for i, (traj, t) in enumerate([(trajs[0], 1), (trajs[1], 3)]):
        ids, _ = free.prompt_ids(traj, t)
        with torch.inference_mode():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        want = float(lp[alarm] - lp[safe])
        for th in runs:
            assert runs[th][i][1] == pytest.approx(want, abs=1e-4)
    assert runs[None][0][0] == runs[1e6][0][0]          # greedy picks SAFE's token here: same text
    assert runs[-1e6][0][0] != runs[None][0][0]


@pytest.mark.parametrize("batch_size, draft_tokens", [(1, 64), (1, 0), (16, 64)])
def test_a_canonical_finish_writes_the_chosen_sides_completion(noisy_tiny, make_traj, monkeypatch,
                                                               batch_size, draft_tokens):
    """decision_finish: canonical: past the decision token the completion is the chosen side's
    canonical completion to its EOS, whatever the model would write (a row trained on the decision
    token only); 'model' lets the model write it."""
    model, tok = noisy_tiny
    trajs = [make_traj(41, 5, None), make_traj(42, 7, 2)]
    free = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8)
    free.audit(trajs[0], 1)
    g = free.last_generated[0]
    eos = tok.eos_token_id
    sides = ([g, 11, 12, 13, eos], [(g + 1) % len(tok), 21, 22, 23, eos])   # part at the first token
    got = {}
    for finish in ("model", "canonical"):
        for th in (-1e6, 1e6):
            aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=8, batch_size=batch_size,
                              draft_tokens=draft_tokens, decision_threshold=th, decision_finish=finish)
            monkeypatch.setattr(aud, "drafts", lambda traj, t: sides)
            res = aud.audit_batch([(trajs[0], 1), (trajs[1], 3)])
            ids = [tok(r.raw, add_special_tokens=False)["input_ids"] for r in res]
            assert all(i[0] == (sides[1] if th < 0 else sides[0])[0] for i in ids)
            got[finish, th] = [r.raw for r in res]
            assert all(r.decision_log_odds is not None for r in res)
    assert got["canonical", -1e6] == [tok.decode(sides[1][:-1])] * 2
    assert got["canonical", 1e6] == [tok.decode(sides[0][:-1])] * 2
    assert got["model", -1e6] != got["canonical", -1e6]


def test_decision_finish_must_be_model_or_canonical(noisy_tiny):
    model, tok = noisy_tiny
    with pytest.raises(ValueError, match="decision_finish"):
        get_auditor("hf", model=model, tokenizer=tok, decision_finish="free")


def test_no_log_odds_when_the_completion_leaves_the_canonical_start(noisy_tiny, make_traj):
    model, tok = noisy_tiny
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=6, decision_threshold=0.0)
    r = aud.audit(make_traj(33, 5, None), 2)
    # the random model does not write "<think>\n..." first: nothing is decided or recorded
    assert r.decision_log_odds is None


def test_the_decision_threshold_is_validated(noisy_tiny):
    model, tok = noisy_tiny
    with pytest.raises(ValueError, match="decision_threshold"):
        get_auditor("hf", model=model, tokenizer=tok, decision_threshold=float("nan"))


def _drafted(aud, greedy, followed):
    """aud's drafts replaced (SAFE side, ALARM side): with `followed` True, the prefix's own
    greedy completion with its tokens from 5 on changed, then that greedy completion itself (a
    trained auditor's canonical completion: the first draft is left at token 5, the second
    taken up); "resync": the greedy completion with a token inserted at 5 (the completion
    leaves it there, and its last 3 tokens are found again further on); else two drafts it
    never follows."""
    def drafts(traj, t):
        g = greedy[(traj.id, t)]
        if followed == "resync":
            return g[:5] + [(g[5] + 1) % 50] + g[5:], [(x + 2) % 50 for x in g]
        if followed:
            return g[:5] + [(x + 1) % 50 for x in g[5:]], g
        return [(x + 1) % 50 for x in g], [(x + 2) % 50 for x in g]
    aud.drafts = drafts
    return aud


def _count_forwards(model):
    n = [0]
    h = model.register_forward_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    return n, h


@pytest.mark.slow
@pytest.mark.parametrize("followed", [True, "resync", False])
def test_drafts_give_the_greedy_tokens_in_fewer_forwards(noisy_tiny, make_traj, followed):
    """Greedy speculative decoding with the canonical completions as drafts: whether the model
    follows a draft (left at token 5, then the other taken up) or never does, the tokens are
    plain greedy's (confidences and decision log-odds to float32 rounding), one prefix at a time
    and in batched rounds; a draft the model follows costs fewer forwards."""
    model, tok = noisy_tiny
    trajs = [make_traj(30, 9, None), make_traj(31, 6, 2), make_traj(32, 12, 5)]
    prefixes = [(tr, t) for tr in trajs for t in range(len(tr.steps))]
    first = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=24, batch_size=1, draft_tokens=0)
    greedy = {}
    for tr, t in prefixes:
        first.audit(tr, t)
        greedy[(tr.id, t)] = list(first.last_generated)
    assert min(len(g) for g in greedy.values()) > 6       # long enough to test taking a draft up

    def walk_one(aud):
        n, h = _count_forwards(model)
        try:
            out = {}
            for tr, t in prefixes:
                r = aud.audit(tr, t)
                out[(tr.id, t)] = (r.raw, r.completion_tokens, r.confidence, r.decision_log_odds)
            return out, n[0]
        finally:
            h.remove()

    kw = dict(model=model, tokenizer=tok, max_new_tokens=24)
    ref, n_plain = walk_one(_drafted(get_auditor("hf", **kw, batch_size=1, draft_tokens=0), greedy, followed))
    got, n_draft = walk_one(_drafted(get_auditor("hf", **kw, batch_size=1), greedy, followed))
    # the same tokens; log-odds and confidence from a many-token forward agree to float32 rounding
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in ref.items()}
    for k, (_, _, conf, lo) in ref.items():
        assert got[k][2] == pytest.approx(conf, abs=1e-4) if conf is not None else got[k][2] is None
        assert got[k][3] == pytest.approx(lo, abs=1e-4) if lo is not None else got[k][3] is None
    assert ref[(trajs[0].id, 0)][3] is not None       # the decision position was reached and compared
    if followed:
        assert n_draft < n_plain / 2, (n_draft, n_plain)
    many = _drafted(get_auditor("hf", **kw, batch_size=16), greedy, followed)
    rounds = _walk_rounds(many, trajs, [0, 0, 0])
    assert {(i, t): (raw, c) for i, t, raw, _, _, c, _ in rounds} == {k: v[:2] for k, v in ref.items()}


def test_draft_tokens_is_validated(noisy_tiny):
    model, tok = noisy_tiny
    with pytest.raises(ValueError, match="draft_tokens"):
        get_auditor("hf", model=model, tokenizer=tok, draft_tokens=-1)


@pytest.mark.parametrize("batch_size", [1, 16])
def test_bf16_autocast_runs_every_forward_and_keeps_the_log_odds(noisy_tiny, make_traj, monkeypatch, batch_size):
    # mixed_precision bf16 (`aftraj eval --mixed-precision`): every forward of the walk (cache
    # extension, batched decode, drafts) runs under bf16 autocast with the float32 weights; the
    # decision log-odds stay near float32's; "no" runs none under autocast
    model, tok = noisy_tiny
    trajs = [make_traj(40, 6, None), make_traj(41, 8, 3)]
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    try:
        res = {}
        for mp in ("no", "bf16"):
            seen.clear()
            aud = _at_first_token(get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=4, batch_size=batch_size,
                                              decision_threshold=0.0, mixed_precision=mp),
                                  monkeypatch, 5, 6)
            res[mp] = _walk_rounds(aud, trajs, [0, 0])
            res[mp + "_lo"] = [r.decision_log_odds for r in aud.audit_batch([(trajs[0], 2), (trajs[1], 4)])]
            assert seen and all(s == (mp == "bf16") for s in seen)
    finally:
        hook.remove()
    assert next(model.parameters()).dtype == torch.float32
    assert all(v is not None for v in res["no_lo"]) and res["bf16_lo"] == pytest.approx(res["no_lo"], rel=0.05, abs=0.05)
    assert len(res["bf16"]) == len(res["no"])
    with pytest.raises(ValueError, match="mixed_precision"):
        get_auditor("hf", model=model, tokenizer=tok, mixed_precision="fp8")


# --------------------------------------------------------------------------- lookahead rounds

def _prefix_answers(aud, requests):
    return [(tr.id, t, r.raw, r.completion_tokens, r.prompt_tokens) for (tr, t), r in
            zip(requests, aud.audit_batch(requests), strict=True)]


@pytest.mark.parametrize("max_batch_tokens", [65536, 1])   # one stacked batch; every row alone
def test_a_round_may_hold_several_prefixes_of_one_trajectory(noisy_tiny, make_traj, max_batch_tokens):
    """The walker's lookahead: rounds with prefixes t, t+1, t+2 of one trajectory beside other
    trajectories' prefixes give what one prefix at a time gives, token for token, and leave each
    cache where the next round continues it."""
    model, tok = noisy_tiny
    a, b = make_traj(40, 9, None), make_traj(41, 7, 4)
    rounds = [[(a, 0), (b, 0), (a, 1), (a, 2)], [(a, 3), (b, 1), (b, 2), (a, 4), (b, 3)],
              [(b, 4), (a, 5), (a, 6), (a, 7), (a, 8)], [(b, 5), (b, 6)]]
    one = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=10, batch_size=1)
    many = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=10, batch_size=16,
                       max_batch_tokens=max_batch_tokens)
    assert many.lookahead
    got = [x for req in rounds for x in _prefix_answers(many, req)]
    ref = [x for req in rounds for r in req for x in _prefix_answers(one, [r])]   # one prefix a call
    assert got == ref
    assert len({x[2] for x in got}) > 1                 # completions depend on the prefix
    s = many.sessions[a.id]                              # the cache holds prefix 8's stable part
    assert s.cache.get_seq_length() == len(s.ids) == many.prompt_ids(a, 8)[1]


def test_a_round_whose_later_prefix_recompiles_the_view_stays_exact(noisy_tiny, ww_trajs):
    """Over the budget a later prefix's bounded view can rewrite the stable part an earlier row
    of the same round stands on: the rows gathered so far are decoded first, tokens still match."""
    model, tok = noisy_tiny
    traj = next(t for t in ww_trajs if t.meta["subset"] == "Hand-Crafted" and len(t.steps) >= 20)
    kw = dict(model=model, tokenizer=tok, max_new_tokens=16, budget=4000)
    many = get_auditor("hf", **kw, batch_size=16)
    scratch = get_auditor("hf", **kw, reuse_cache=False)
    stable = [many.prompt_ids(traj, t) for t in range(6)]
    assert any(s[0][:s[1]] != n[0][:s[1]] for s, n in zip(stable, stable[1:], strict=False))  # a recompile is inside
    req = [(traj, t) for t in range(6)]
    got, ref = many.audit_batch(req), [scratch.audit(traj, t) for t in range(6)]
    assert [r.raw for r in got] == [r.raw for r in ref]


def test_the_walk_with_lookahead_writes_the_records_of_the_walk_without(noisy_tiny, make_traj):
    """Two trajectories and a round of 8: spare rows audit the next prefixes; the answers a
    walk never asks for (after its first ALARM) are dropped, the records are the same."""
    model, tok = noisy_tiny
    trajs = [make_traj(50, 8, 3), make_traj(51, 6, None), make_traj(52, 5, 2)]
    kw = dict(model=model, tokenizer=tok, max_new_tokens=8, batch_size=8)
    seen = []

    def strip(recs):
        return [{k: v for k, v in r.items() if k != "latencies_s"} for r in recs]

    off = walk(get_auditor("hf", **kw), trajs, WalkConfig(max_in_flight=8, lookahead=False), progress=False)
    aud = get_auditor("hf", **kw)
    inner = aud.audit_batch
    aud.audit_batch = lambda req: seen.append([(tr.id, t) for tr, t in req]) or inner(req)
    on = walk(aud, trajs, WalkConfig(max_in_flight=8), progress=False)
    assert strip(on) == strip(off)
    assert max(len(b) for b in seen) == 8 and len(seen) < max(len(t.steps) for t in trajs)



def test_drafts_shrink_after_a_miss_and_grow_back(noisy_tiny, make_traj):
    """A rejected draft costs a forward as wide as the draft: after a miss the next draft is at
    most twice what was kept (at least 2), after a full hit twice as long again (up to
    draft_tokens). Drafts the model never follows then feed a few tokens a forward, not 65."""
    model, tok = noisy_tiny
    aud = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=24, draft_tokens=64)
    assert aud.engine.next_cap(64, [1] * 40, 0) == 2 and aud.engine.next_cap(64, [1] * 40, 5) == 10
    assert aud.engine.next_cap(2, [1, 2], 2) == 4 and aud.engine.next_cap(48, [1] * 48, 48) == 64
    assert aud.engine.next_cap(8, [], 0) == 8                  # nothing proposed: unchanged
    assert aud.engine.propose([1, 2, 3], ([1, 2, 3, 4, 5, 6, 7, 8, 9],), 3) == [4, 5, 6]

    trajs = [make_traj(60, 6, None), make_traj(61, 5, 2)]
    prefixes = [(tr, t) for tr in trajs for t in range(len(tr.steps))]
    plain = get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=24, draft_tokens=0)
    greedy = {}
    for tr, t in prefixes:
        plain.audit(tr, t)
        greedy[(tr.id, t)] = list(plain.last_generated)
    widths = []
    h = model.register_forward_pre_hook(lambda m, a, kw: widths.append(kw["input_ids"].shape[1]),
                                        with_kwargs=True)
    try:
        aud = _drafted(get_auditor("hf", model=model, tokenizer=tok, max_new_tokens=24), greedy, False)
        for tr, t in prefixes:
            aud.audit(tr, t)
            assert aud.last_generated == greedy[(tr.id, t)]
    finally:
        h.remove()
    decode = [w for w in widths if w <= 65]           # the prompt's chunks are wider
    assert max(decode) > 2 and sum(decode) < 4 * sum(len(g) for g in greedy.values()), decode


def test_batched_rounds_on_cpu_attend_without_copying_the_kv_heads(noisy_tiny, make_traj, monkeypatch):
    """transformers' SDPA path repeats grouped KV heads (a copy of the cache a forward) under a
    mask unless TRANSFORMERS_SDPA_FORCE_GQA=1 (read per call): the auditor sets it for its
    forwards on CPU, restores it after; batched rounds still give one row's tokens."""
    import transformers.integrations.sdpa_attention as sdpa
    from eval.hf_compat import masked_gqa

    model, tok = noisy_tiny
    assert model.config.num_key_value_heads < model.config.num_attention_heads   # the case at stake
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    with masked_gqa():
        assert sdpa.use_gqa_in_sdpa(torch.ones(1), torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8))
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in __import__("os").environ
    repeats = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda h, n: repeats.append(h.shape) or real(h, n))
    trajs = [make_traj(70, 6, None), make_traj(71, 5, 2), make_traj(72, 7, None)]
    kw = dict(model=model, tokenizer=tok, max_new_tokens=16)
    got = _walk_rounds(get_auditor("hf", **kw, batch_size=16), trajs, [0, 0, 0])
    ref = _walk_rounds(get_auditor("hf", **kw, batch_size=1), trajs, [0, 0, 0])
    assert repeats == [] and got == ref
    with torch.inference_mode():   # the same kind of forward outside: the library copies
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True)
        model(input_ids=torch.tensor([[8, 9]]), past_key_values=out.past_key_values,
              attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    assert repeats


# --------------------------------------------------------------------------- the transformers patches' guard

def _patches_off(monkeypatch):
    """As on a transformers release outside the line the patches are written for (5.x)."""
    import eval.hf_compat as compat

    for f in (compat.transformers_major, compat.slack_cache_applies, compat.force_gqa_applies):
        f.cache_clear()
    monkeypatch.setattr(compat, "transformers_major", lambda: compat.PATCHED_MAJOR + 1)
    for f in (compat.slack_cache_applies, compat.force_gqa_applies):
        monkeypatch.setattr(compat, f.__name__, f.__wrapped__)


def test_the_patches_apply_on_the_pinned_transformers_only(noisy_tiny, make_traj, monkeypatch):
    """On the pinned transformers (5.x) both patches apply; on another major version the engine
    takes transformers' own DynamicCache and leaves TRANSFORMERS_SDPA_FORCE_GQA alone, and the
    walk gives the same tokens, batched and one at a time."""
    import os

    import eval.hf_compat as compat

    model, tok = noisy_tiny
    assert compat.slack_cache_applies() and compat.force_gqa_applies()
    trajs = [make_traj(80, 6, None), make_traj(81, 5, 2)]
    kw = dict(model=model, tokenizer=tok, max_new_tokens=12)
    patched = [_walk_rounds(get_auditor("hf", **kw, batch_size=b), trajs, [0, 0]) for b in (1, 16)]
    _patches_off(monkeypatch)
    monkeypatch.delenv(compat.FORCE_GQA_ENV, raising=False)
    assert not compat.slack_cache_applies() and not compat.force_gqa_applies()
    assert all(type(layer).__name__ == "DynamicLayer" for layer in compat.new_cache(model.config).layers)
    with compat.masked_gqa():
        assert compat.FORCE_GQA_ENV not in os.environ
    plain = [_walk_rounds(get_auditor("hf", **kw, batch_size=b), trajs, [0, 0]) for b in (1, 16)]
    assert plain == patched and plain[0] == plain[1]

"""BPPO loss: the formula on hand-computed log-probabilities, and equality with TRL 1.16's
sigmoid DPO loss (same tiny model, same token sequences) when a batch holds one subset."""

from __future__ import annotations

import math

import pytest
import torch

from training.stage1.loss import bppo_loss, completion_logps


def _ls(x: float) -> float:  # -log σ(x)
    return math.log1p(math.exp(-x))


def test_bppo_loss_matches_formula_by_hand():
    pc = torch.tensor([-3.0, -5.0, -2.0])
    pr = torch.tensor([-4.0, -4.5, -6.0])
    rc = torch.tensor([-3.5, -5.0, -2.5])
    rr = torch.tensor([-3.5, -4.0, -5.0])
    is_pre = torch.tensor([True, True, False])
    beta, w_pre, w_post = 0.5, 2.0, 1.0
    # Δ = (pc - rc) - (pr - rr): [0.5 - (-0.5), 0 - (-0.5), 0.5 - (-1.0)] = [1.0, 0.5, 1.5]
    pre = (_ls(0.5 * 1.0) + _ls(0.5 * 0.5)) / 2
    post = _ls(0.5 * 1.5)
    expected = w_pre * pre + w_post * post          # DESIGN §5: Σ_s w_s · mean over D_s, unnormalised
    loss, m = bppo_loss(pc, pr, rc, rr, is_pre, beta=beta, weight_pre=w_pre, weight_post=w_post)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["dpo_pre"].item() == pytest.approx(pre, abs=1e-6)
    assert m["dpo_post"].item() == pytest.approx(post, abs=1e-6)
    assert m["reward_acc_pre"].item() == 1.0


def test_weights_shift_the_loss_and_policy_equal_reference_gives_ln2():
    z = torch.zeros(4)
    is_pre = torch.tensor([True, False, True, False])
    loss, _ = bppo_loss(z, z, z, z, is_pre, beta=0.1, weight_pre=0.75, weight_post=0.25)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)        # weights summing to 1: ln 2
    loss, _ = bppo_loss(z, z, z, z, is_pre, beta=0.1, weight_pre=3.0, weight_post=1.0)
    assert loss.item() == pytest.approx(4 * math.log(2), abs=1e-6)    # the weights are not normalised
    pc = torch.tensor([0.0, 2.0, 0.0, 2.0])   # post pairs better than pre pairs
    a, _ = bppo_loss(pc, z, z, z, is_pre, beta=1.0, weight_pre=1.0, weight_post=0.0)
    b, _ = bppo_loss(pc, z, z, z, is_pre, beta=1.0, weight_pre=0.0, weight_post=1.0)
    assert a.item() == pytest.approx(math.log(2), abs=1e-6)
    assert b.item() == pytest.approx(_ls(2.0), abs=1e-6)


def test_nll_term_is_mean_chosen_token_nll():
    z = torch.zeros(2)
    tok = torch.tensor([[-1.0, -3.0, 0.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, m = bppo_loss(z, z, z, z, torch.tensor([True, False]), beta=0.1, weight_pre=0.5, weight_post=0.5,
                        chosen_token_logps=tok, chosen_mask=mask, nll_coef=0.5)
    assert m["nll"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(math.log(2) + 1.0, abs=1e-6)


def test_single_subset_equals_trl_sigmoid_dpo(tiny_model_dir, tmp_path):
    """Same sequences through TRL's DPOTrainer.compute_loss and through ours, with a reference
    that differs from the policy (so the loss is not trivially ln 2)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from aftraj.models import build_tiny_model
    from training.stage1.data import TokenizedPair, collate

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref_dir = build_tiny_model(tmp_path / "ref", seed=1)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir)
    texts = [("check step 3 of the run", "SAFE because the value holds", "UNSAFE at step 2"),
             ("the agent called a tool with a wrong argument", "UNSAFE", "SAFE and nothing else")]
    pairs = [TokenizedPair(i, False, tok(p)["input_ids"], tok(c)["input_ids"] + [tok.eos_token_id],
                           tok(r)["input_ids"] + [tok.eos_token_id]) for i, (p, c, r) in enumerate(texts)]
    beta = 0.3
    ds = Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in texts])
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, bf16=False, report_to="none",
                     per_device_train_batch_size=2, use_cpu=True)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)
    trl_batch = DataCollatorForPreference(pad_token_id=tok.pad_token_id)(
        [{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in pairs])
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, trl_batch).item()
        batch = collate(pairs, tok.pad_token_id)
        pc, pr = completion_logps(trainer.model, batch).chunk(2)
        rc, rr = completion_logps(trainer.ref_model, batch).chunk(2)
        ours, _ = bppo_loss(pc, pr, rc, rr, batch["is_pre"], beta=beta, weight_pre=1.0, weight_post=1.0)
    assert abs(ours.item() - math.log(2)) > 1e-3, "the reference should differ from the policy"
    assert ours.item() == pytest.approx(trl_loss, abs=1e-5)
    mode = "train" if trainer.model.training else "eval"   # TRL logs under the model's mode
    assert pc.mean().item() == pytest.approx(trainer._metrics[mode]["logps/chosen"][-1], abs=1e-4)
    assert pr.mean().item() == pytest.approx(trainer._metrics[mode]["logps/rejected"][-1], abs=1e-4)


def test_decision_balance_weighs_safe_and_alarm_classes_one_half_each():
    # pre, post, twin, twin: three SAFE-chosen pairs, one ALARM-chosen; log-probs at the decision
    z = torch.zeros(4)
    dec = torch.tensor([-1.0, -4.0, -2.0, -3.0])
    common = dict(beta=0.1, weight_pre=0.5, weight_post=0.5, weight_twin=0.5,
                  is_twin=torch.tensor([False, False, True, True]), decision_logps=dec,
                  has_decision=torch.ones(4, dtype=torch.bool), decision_coef=1.0)
    is_pre = torch.tensor([True, False, False, False])
    _, per_pair = bppo_loss(z, z, z, z, is_pre, **common)
    _, balanced = bppo_loss(z, z, z, z, is_pre, decision_balance=True, **common)
    assert float(per_pair["decision_ce"]) == pytest.approx(10 / 4)
    assert float(balanced["decision_ce"]) == pytest.approx(0.5 * 4 + 0.5 * (1 + 2 + 3) / 3)
    # one class absent: the other's mean
    _, only_safe = bppo_loss(z, z, z, z, is_pre, decision_balance=True,
                             **{**common, "has_decision": torch.tensor([True, False, True, True])})
    assert float(only_safe["decision_ce"]) == pytest.approx(2.0)

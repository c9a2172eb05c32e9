"""The TTT forward equals inference-time drafting; hand-checked loss alignment; loss, accuracy and checkpointing."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.cache_utils import DynamicCache

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.training.ttt import (
    draft_vocab_targets,
    shift_left,
    simulated_acceptance_length,
    step_alignment,
    target_top_k,
    ttt_forward,
    ttt_loss,
)

torch.set_num_threads(1)

V = 96
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
)


def make_pair(family: str, **draft_overrides):
    torch.manual_seed(0)
    if family == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16))
    else:
        target = LlamaForCausalLM(LlamaConfig(**SHAPE))
    target.eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, **draft_overrides)
    with torch.no_grad():  # move every weight away from its init (norms at 1, ...) so that each one matters
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(torch.randn_like(param) * 0.2)
    return target, draft.eval()


def inference_logits(draft, ids, features, t, steps):
    """What decoding computes: prefill pairs (h_0..h_t, x_1..x_{t+1}), then feed back its own state `steps` times.

    Step i (1-based) feeds token x_{t+1+i} at position t+i with the previous output as `hidden_states`, attending
    to the prefix and its own earlier steps through the DynamicCache. Returns the logits of steps 0..steps.
    """
    cache = DynamicCache()
    out = draft(ids[:, 1 : t + 2], target_hidden_states=features[:, : t + 1], cache=cache)
    logits = [out.logits[:, -1]]
    hidden = out.last_hidden_state[:, -1:]
    for i in range(1, steps + 1):
        out = draft(
            ids[:, t + 1 + i : t + 2 + i], hidden_states=hidden, position_ids=torch.tensor([[t + i]]), cache=cache
        )
        logits.append(out.logits[:, -1])
        hidden = out.last_hidden_state
    return logits


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("llama", dict(norm_output=True, norm_before_residual=True, fc_norm=True)),
        ("llama", dict(num_hidden_layers=2)),
        ("qwen3", dict(num_hidden_layers=3, norm_before_residual=True)),
    ],
    ids=["llama", "qwen3-qk-norm", "llama-eagle3.1-flags", "llama-2-layers", "qwen3-3-layers"],
)
def test_training_logits_equal_inference_drafting(family, overrides):
    target, draft = make_pair(family, **overrides)
    K, S = 4, 11
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, S))
    lengths = [S, 8]  # the second row is right-padded: padding must not leak into its positions
    attention_mask = torch.zeros(2, S, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    ids = ids * attention_mask
    with torch.no_grad():
        hidden_states = target(ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        features = draft.target_features(hidden_states)
        train = ttt_forward(draft, ids, features, attention_mask, ttt_length=K)
        checked = 0
        for row, n in enumerate(lengths):
            for t in range(0, n - 1):
                steps = min(K - 1, n - 2 - t)  # step j needs x_{t+1+j} to exist
                ref = inference_logits(draft, ids[row : row + 1, :n], features[row : row + 1, :n], t, steps)
                for j in range(steps + 1):
                    torch.testing.assert_close(train[j][row, t], ref[j][0], atol=1e-5, rtol=1e-5)
                    checked += 1
    assert checked > 40


def test_hand_checked_alignment():
    # S = 6 positions; target row r puts all mass on token r, so the target argmax reveals which row a step used.
    S, Vd = 6, 8
    target_logits = torch.full((1, S, Vd), -30.0)
    target_logits[0, torch.arange(S), torch.arange(S)] = 30.0
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    # Step j, position t predicts x_{t+2+j} from target row t+1+j, supervised iff loss_mask[t+2+j]:
    #   j=0: t=0,1,2 (mask 2,3,4) rows 1,2,3     j=1: t=0,1 (mask 3,4) rows 2,3
    #   j=2: t=0 (mask 4) row 3                   j=3: mask[5] = 0 -> nothing (mask indices past the end are dropped)
    expected_supervised = {0: {0: 1, 1: 2, 2: 3}, 1: {0: 2, 1: 3}, 2: {0: 3}, 3: {}}
    for j, rows in expected_supervised.items():
        draft_pos, target_rows, mask_pos = step_alignment(S, j)
        pairs = {
            t: r for t, r, m in zip(range(S)[draft_pos], range(S)[target_rows], range(S)[mask_pos]) if loss_mask[0, m]
        }
        assert pairs == rows, j
    # Draft logits that copy the right row are right everywhere; one row off (no shift by j) is wrong where j > 0.
    right = [shift_left(target_logits, 1 + j, fill=0.0) for j in range(4)]
    out = ttt_loss(right, target_logits, loss_mask, decay=0.5)
    assert out.step_supervised.tolist() == [3, 2, 1, 0]
    assert out.step_correct.tolist() == [3, 2, 1, 0]
    assert out.step_losses.max() < 1e-6 and out.loss < 1e-6  # p is one-hot and q equals it
    wrong = [shift_left(target_logits, 1, fill=0.0) for _ in range(4)]
    assert ttt_loss(wrong, target_logits, loss_mask).step_correct.tolist() == [3, 0, 0, 0]
    # Only the last token supervised: each step learns it once, from t = 3 - j (so the last token is not lost).
    last = ttt_loss(right, target_logits, torch.tensor([[0, 0, 0, 0, 0, 1]]))
    assert last.step_supervised.tolist() == [1, 1, 1, 1] and last.step_correct.tolist() == [1, 1, 1, 1]
    # Token 1 can only be predicted from t = -1: never supervised (no wrap-around, no zero-padding position).
    assert ttt_loss(right, target_logits, torch.tensor([[0, 1, 0, 0, 0, 0]])).step_supervised.tolist() == [0] * 4


def test_loss_is_the_decayed_mean_soft_cross_entropy():
    torch.manual_seed(0)
    B, S, Vd, K = 2, 7, 5, 3
    logits = [torch.randn(B, S, Vd) for _ in range(K)]
    target = torch.randn(B, S, Vd)
    mask = torch.randint(0, 2, (B, S))
    out = ttt_loss(logits, target, mask, decay=0.8)
    expected_total = 0.0
    for j in range(K):
        terms = []
        for b in range(B):
            for t in range(S - 2 - j):
                if mask[b, t + 2 + j]:
                    p = target[b, t + 1 + j].softmax(-1)
                    terms.append(-(p * logits[j][b, t].log_softmax(-1)).sum())
        loss_j = torch.stack(terms).mean() if terms else torch.tensor(0.0)
        torch.testing.assert_close(out.step_losses[j], loss_j)
        assert out.step_supervised[j] == len(terms)
        expected_total += 0.8**j * loss_j
    torch.testing.assert_close(out.loss, torch.as_tensor(expected_total))


# A target vocabulary of 6 ids of which the draft holds 4: draft ids 0..3 are target ids 0, 1, 3, 5.
T2D = torch.tensor([True, True, False, True, False, True])


def one_step_case():
    """S = 4, one TTT step: draft positions t = 0, 1 predict from target rows 1, 2 (loss mask at 2, 3)."""
    target = torch.zeros(1, 4, 6)
    # Row 1: the target's top token is id 4, outside the draft vocabulary; the best in-vocabulary one is id 3.
    target[0, 1] = torch.tensor([0.0, 1.0, 0.5, 4.0, 5.0, 0.0])
    # Row 2: the target's top token is id 1, inside.
    target[0, 2] = torch.tensor([0.0, 6.0, 0.0, 2.0, 0.0, 1.0])
    draft = torch.zeros(1, 4, 4)
    draft[0, 0, 2] = 9.0  # draft id 2 = target id 3: the best in-vocabulary token, but not the target's top token
    draft[0, 1, 1] = 9.0  # draft id 1 = target id 1: right
    return [draft], target, torch.tensor([[0, 0, 1, 1]])


def test_accuracy_is_against_the_full_vocabulary_top_token():
    step_logits, target, mask = one_step_case()
    out = ttt_loss(step_logits, target, mask, T2D)
    # Against the best in-vocabulary token both positions would be right; against the target's own top token the
    # first is a miss, and it stays in the denominator.
    assert out.step_supervised.tolist() == [2] and out.step_in_vocab.tolist() == [1]
    assert out.step_correct.tolist() == [1]
    assert out.step_accuracy.tolist() == [0.5] and out.step_coverage.tolist() == [0.5]
    # The same from the top-k form offline features store, for any k that keeps the top token.
    for k in (1, 3, 6):
        top_logits, top_ids = target_top_k(target, k)
        topk = ttt_loss(step_logits, top_logits, mask, T2D, target_ids=top_ids)
        assert topk.step_correct.tolist() == [1] and topk.step_in_vocab.tolist() == [1]


def test_out_of_vocabulary_positions_carry_no_loss():
    step_logits, target, mask = one_step_case()
    draft = step_logits[0].clone().requires_grad_(True)
    out = ttt_loss([draft], target, mask, T2D)
    out.loss.backward()
    assert draft.grad[0, 0].abs().sum() == 0 and draft.grad[0, 1].abs().sum() > 0
    # Changing only the out-of-vocabulary position's logits (draft and target, top token still outside) changes
    # nothing; changing the in-vocabulary one's does.
    moved_draft, moved_target = step_logits[0].clone(), target.clone()
    moved_draft[0, 0] = torch.tensor([3.0, -2.0, 0.5, 7.0])
    moved_target[0, 1] = torch.tensor([2.0, 0.0, 3.0, 1.0, 8.0, 4.0])
    moved = ttt_loss([moved_draft], moved_target, mask, T2D)
    assert torch.equal(moved.loss, out.loss.detach())
    moved_target[0, 2, 5] = 3.0
    assert not torch.equal(ttt_loss([moved_draft], moved_target, mask, T2D).loss, out.loss.detach())
    # The in-vocabulary position is trained on the target restricted to the draft ids (1, 3, 5 of row 2).
    p = torch.softmax(torch.tensor([0.0, 6.0, 2.0, 1.0]), -1)
    expected = -(p * torch.log_softmax(step_logits[0][0, 1], -1)).sum()
    torch.testing.assert_close(out.loss, expected)


def test_head_on_supervised_rows_equals_the_loss_on_full_logits():
    """`ttt_forward(return_hidden=True)` + `ttt_loss(head=lm_head)` (the trainer's path: the head runs on supervised
    in-vocabulary rows only) gives the loss, gradients and counts of the head over every position."""
    target, draft = make_pair("llama")
    draft.train()
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    features = draft.target_features(out.hidden_states)
    loss_mask = torch.zeros(2, 12)
    loss_mask[0, 4:] = 1
    loss_mask[1, 7:11] = 1
    # Some supervised positions' target top token lies outside the 40-id draft vocabulary: they are certain misses.
    assert not draft.t2d[out.logits.argmax(-1)[loss_mask.bool()]].all()
    results = []
    for k in (None, 5):
        target_logits, target_ids = (out.logits, None) if k is None else target_top_k(out.logits, k)
        for use_head in (False, True):
            draft.zero_grad()
            steps = ttt_forward(draft, ids, features, ttt_length=3, return_hidden=use_head)
            result = ttt_loss(
                steps,
                target_logits,
                loss_mask,
                draft.t2d,
                target_ids=target_ids,
                head=draft.lm_head if use_head else None,
            )
            result.loss.backward()
            results.append((result, draft.fc.weight.grad.clone(), draft.lm_head.weight.grad.clone()))
    for (full, *full_grads), (headed, *head_grads) in (results[:2], results[2:]):
        torch.testing.assert_close(headed.loss, full.loss)
        for name in ("step_losses", "step_correct", "step_supervised", "step_in_vocab"):
            torch.testing.assert_close(getattr(headed, name), getattr(full, name))
        for a, b in zip(head_grads, full_grads):
            torch.testing.assert_close(a, b)
    assert results[0][0].step_correct.sum() > 0
    with pytest.raises(ValueError, match="needs t2d"):
        ttt_loss(steps, out.logits, loss_mask, head=draft.lm_head)


def test_top_k_soft_targets_restrict_to_the_draft_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(5, 6)
    logits[0, 4] = 10.0  # top token outside the draft vocabulary
    values, ids = target_top_k(logits, 3)
    assert ids.dtype == torch.int32 and torch.equal(ids[:, 0].long(), logits.argmax(-1))
    assert torch.equal(values, logits.sort(-1, descending=True).values[:, :3])
    top, in_vocab, p = draft_vocab_targets(values, ids, T2D)
    assert torch.equal(top, logits.argmax(-1)) and torch.equal(in_vocab, T2D[top])
    for row, probs in zip(in_vocab.nonzero()[:, 0].tolist(), p):
        kept = torch.full((6,), float("-inf"))
        kept[ids[row].long()] = logits[row, ids[row].long()]
        torch.testing.assert_close(probs, torch.softmax(kept[T2D], -1))  # ids outside the top 3 get nothing
    # With k = V the top-k form is the full distribution restricted to the draft vocabulary.
    full_top, full_in, full_p = draft_vocab_targets(logits, None, T2D)
    _, _, all_p = draft_vocab_targets(*target_top_k(logits, 6), T2D)
    assert torch.equal(full_top, top) and torch.equal(full_in, in_vocab)
    torch.testing.assert_close(all_p, full_p)
    with pytest.raises(ValueError, match="positive integer"):
        target_top_k(logits, 0)


def test_mismatched_target_arguments_raise():
    with pytest.raises(ValueError, match="pass t2d"):
        ttt_loss([torch.zeros(1, 2, 3)], torch.zeros(1, 2, 5), torch.ones(1, 2))
    with pytest.raises(ValueError, match="target_ids"):
        ttt_loss([torch.zeros(1, 2, 4)], torch.zeros(1, 2, 3), torch.ones(1, 2), T2D)
    with pytest.raises(ValueError, match="t2d marks 4 ids but the draft predicts 3"):
        ttt_loss([torch.zeros(1, 2, 3)], torch.zeros(1, 2, 6), torch.ones(1, 2), T2D)


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.0, 1.0]) == 1.0


@pytest.mark.parametrize("depth", [1, 2])
def test_gradient_checkpointing_gives_the_same_gradients(depth):
    target, draft = make_pair("llama", num_hidden_layers=depth)
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        features = draft.target_features(out.hidden_states)
    draft.train()

    def grads():
        draft.zero_grad()
        logits = ttt_forward(draft, ids, features, ttt_length=3)
        ttt_loss(logits, out.logits, torch.ones_like(ids), draft.t2d).loss.backward()
        return {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}

    plain = grads()
    getattr(draft, "activation_checkpointing_enable", draft.gradient_checkpointing_enable)()
    assert draft.gradient_checkpointing
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys() and "lm_head.weight" in plain
    assert depth == 1 or plain["upper_layers.0.self_attn.q_proj.weight"].abs().sum() > 0  # the upper layer trains
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


def test_bad_shapes_raise():
    target, draft = make_pair("llama")
    with pytest.raises(ValueError, match="ttt_length"):
        ttt_forward(draft, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 96), ttt_length=0)
    with pytest.raises(ValueError, match="target_hidden_states"):
        ttt_forward(draft, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, 96))

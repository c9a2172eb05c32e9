"""scripts/research/cycle_selection.py: the chain's cycles walked over teacher-forced hits are the decoded ones."""

import importlib.util
import pathlib

import pytest
import torch

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.training.evaluation import evaluate_draft
from eagle3_hf.training.features import online_features
from eagle3_hf.training.trainer import Eagle3DataCollator, install_draft_vocab
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.utils import tiny

_spec = importlib.util.spec_from_file_location(
    "cycle_selection", pathlib.Path(__file__).parents[1] / "scripts" / "research" / "cycle_selection.py"
)
cycle_selection = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cycle_selection)

torch.set_num_threads(1)


def test_walk_follows_the_chain_by_hand():
    # depth 3, answer tokens 4..13; hits[j, i]: step j predicts token i right.
    hits = torch.zeros(3, 14, dtype=torch.bool)
    hits[0, [5, 6, 10, 11, 12, 13]] = True
    hits[1, [7, 11, 12, 13]] = True
    hits[2, [8, 13]] = True
    # Token 4 comes from the prompt. Cycle at 5: steps 0, 1, 2 predict 5, 6, 7 -> 5 right, 6 wrong (step 1 at 6):
    # 1 accepted, bonus 6. Cycle at 7: step 0 at 7 wrong: 0, bonus 7. At 8: 0. At 9: 0. At 10: step 0 at 10 right,
    # step 1 at 11 right, step 2 at 12 wrong: 2, bonus 12. At 13, the last token: nothing can be accepted, bonus 13.
    assert cycle_selection.walk(hits, list(range(4, 14))) == [1, 0, 0, 0, 2, 0]
    assert cycle_selection.rates([1, 0, 0, 0, 2, 0], 3) == [2 / 6, 1 / 2, 0.0]


@pytest.fixture(scope="module")
def trained():
    """The tiny target and a draft trained on its rows until it gets about half of its tokens right (~3 s)."""
    torch.manual_seed(0)
    target = tiny.make_tiny_target()
    rows = tiny.synthetic_dataset(num_rows=6, seq_len=24)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40)
    install_draft_vocab(draft, rows)
    batch = Eagle3DataCollator()(list(rows))
    with torch.no_grad():
        features, logits, ids = online_features(target, draft, batch["input_ids"], batch["attention_mask"], 8)
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(150):
        states = ttt_forward(draft, batch["input_ids"], features, batch["attention_mask"], 3)
        loss = ttt_loss(states, logits, batch["loss_mask"], draft.t2d, target_ids=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return target, bind_target(draft.eval(), target), rows


def test_step_hits_count_what_the_evaluation_counts(trained):
    target, draft, rows = trained
    metrics = evaluate_draft(draft, target, rows, ttt_length=3, batch_size=1)
    hits = sum(cycle_selection.step_hits(draft, target, dict(row), 3).sum(1) for row in rows)
    assert metrics["acc_0"] > 0.3  # a draft that gets tokens right, so the counts below say something
    for j in range(3):
        assert int(hits[j]) == round(metrics[f"acc_{j}"] * metrics["supervised_tokens"])


def test_the_walk_over_the_decoded_text_is_the_chains_own_cycles(trained):
    target, draft, rows = trained
    accepted_drafts = 0
    with torch.no_grad():
        for row in rows:
            answer = [i for i, m in enumerate(row["loss_mask"]) if m]
            prompt = row["input_ids"][: answer[0]]
            new, accepted = cycle_selection.generate_chain(target, draft, prompt, 3, 12)
            text = {"input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)}
            hits = cycle_selection.step_hits(draft, target, text, 3)
            walked = cycle_selection.walk(hits, list(range(len(prompt), len(prompt) + len(new))))
            assert walked == accepted
            accepted_drafts += sum(accepted)
    assert accepted_drafts > 0  # cycles accepted drafted tokens, so the walks were not all zeros

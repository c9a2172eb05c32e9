"""One honest evaluation of a draft, used by training logs, `eagle3-hf evaluate`, the examples and the model card.

Teacher-forced TTT accuracy (the draft runs ``ttt_length`` steps on its own states, fed the true tokens, exactly as
`eagle3_hf.training.ttt` trains it and as drafting computes) against the target's top token over its FULL vocabulary:
a position whose target token the draft vocabulary cannot hold is a miss. Beside it: the vocabulary's coverage of the
target's tokens and the chain acceptance length those accuracies imply. Run it on conversations training never saw:
the held-out split (`eagle3_hf.training.split`) of the regenerated data, and MT-bench turn 1 answered by the target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.training.features import _base_draft, online_features
from eagle3_hf.training.trainer import Eagle3DataCollator
from eagle3_hf.training.ttt import simulated_acceptance_length, ttt_forward, ttt_loss

__all__ = ["evaluate_draft"]


@torch.no_grad()
def evaluate_draft(
    draft: Eagle3DraftModel,
    target: PreTrainedModel,
    dataset: Iterable[Mapping[str, Any]],
    ttt_length: int = 7,
    batch_size: int = 4,
    max_length: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Full-vocabulary accuracy of TTT steps ``0..ttt_length-1``, coverage and simulated acceptance length.

    Args:
        draft: the draft (PEFT-wrapped drafts are unwrapped); run in eval mode, on the target's device.
        target: its frozen target (features and top tokens are computed online).
        dataset: tokenised rows with ``input_ids`` and ``loss_mask`` (e.g. `build_dataset`'s output).
        batch_size: rows per forward (right-padded; padding is never scored).
        max_length: rows are cut to this many tokens (None: kept whole).

    Returns a dict: ``acc_0..acc_{K-1}`` (share of supervised tokens whose target top token is step j's draft top
    token), ``coverage`` (share of supervised tokens whose target top token the draft vocabulary holds, step 0),
    ``sim_accept_len`` (``1 + sum_j prod_{i<=j} acc_i``), ``supervised_tokens`` (step 0) and ``conversations``.

    Example:

    ```python
    >>> metrics = evaluate_draft(draft, target, held_out_rows)  # doctest: +SKIP
    >>> metrics["acc_0"], metrics["coverage"], metrics["sim_accept_len"]  # doctest: +SKIP
    ```
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    base = _base_draft(draft)
    rows = list(dataset)
    if not rows:
        raise ValueError("The evaluation data set is empty: there is nothing to evaluate on.")
    device = next(target.parameters()).device
    was_training = draft.training
    draft.eval()
    target.eval()
    pad = base.config.pad_token_id if base.config.pad_token_id is not None else 0
    collate = Eagle3DataCollator(pad_token_id=pad, max_length=max_length)
    correct = supervised = in_vocab = None
    try:
        for start in tqdm(range(0, len(rows), batch_size), desc="Evaluating", disable=not progress):
            batch = {k: v.to(device) for k, v in collate(rows[start : start + batch_size]).items()}
            # Only the top token matters here: one kept logit is enough for the accuracy and the coverage.
            ids, attention = batch["input_ids"], batch["attention_mask"]
            features, top_logits, top_ids = online_features(target, base, ids, attention, 1)
            states = ttt_forward(base, ids, features, attention, ttt_length, return_hidden=True)
            out = ttt_loss(states, top_logits, batch["loss_mask"], base.t2d, target_ids=top_ids, head=base.lm_head)
            counts = (out.step_correct.cpu(), out.step_supervised.cpu(), out.step_in_vocab.cpu())
            if correct is None:
                correct, supervised, in_vocab = counts
            else:
                correct, supervised, in_vocab = correct + counts[0], supervised + counts[1], in_vocab + counts[2]
    finally:
        draft.train(was_training)
    accuracy = correct.double() / supervised.clamp(min=1).double()
    metrics: dict[str, Any] = {f"acc_{j}": round(float(a), 4) for j, a in enumerate(accuracy)}
    metrics["coverage"] = round(float(in_vocab[0]) / max(int(supervised[0]), 1), 4)
    metrics["sim_accept_len"] = round(simulated_acceptance_length(accuracy), 4)
    metrics["supervised_tokens"] = int(supervised[0])
    # a template that rewrites earlier turns gives a conversation one row per answer, all under its id
    metrics["conversations"] = len({row["id"] for row in rows}) if "id" in rows[0] else len(rows)
    metrics["rows"] = len(rows)
    return metrics

"""Where a draft misses: how often the target's next token is a copy from its own context, and whether the draft copies.

Small targets decoding greedily repeat themselves: phrases, list items, whole sentences come back. A token that
continues an earlier occurrence of the current bigram can be predicted by looking it up in the context (what prompt
lookup decoding does), so a draft that reads the context should get those right. For each supervised position of a
data set's assistant turns (teacher forced, TTT step 0, the same alignment as training and `evaluate_draft`), this
script records:

* whether the bigram ``(x_t, x_{t+1})`` occurred earlier in the row, and whether the token that followed it then is
  the target's top token now ("lookup right");
* whether the draft's top token is the target's top token (full vocabulary);
* the target's own top-1 probability, to bucket the draft's accuracy by how sure the target is.

It prints and writes (``--json``) the draft's accuracy overall, on the positions the lookup gets right and elsewhere,
the lookup's own hit rate, the share "draft or lookup right", and accuracy by the target's confidence.

Usage (SmolLM2; `regen_mtbench/` from examples/data/smollm2_mtbench_turn1_regen.tar.gz):

    python examples/copy_analysis.py --draft eagle3_hf/drafts/smollm2-135m-instruct \
        --data work_data/regen_mtbench --json examples/results/copy_analysis.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from eagle3_hf.hub import load_draft_for
from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.trainer import Eagle3DataCollator
from eagle3_hf.training.ttt import step_alignment, ttt_forward

CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)
POSITION_EDGES = (0, 128, 256, 384, 512, 768, 1024)  # token position in the row: training cuts rows at --max-length


def bigram_lookup(tokens: list[int], upto: int) -> list[int | None]:
    """For each t < `upto`: the token that followed the latest earlier occurrence of ``(x_t, x_{t+1})``, if any.

    "Earlier" means the occurrence's follower lies at or before ``x_{t+1}``, i.e. inside what the draft has seen.
    """
    seen: dict[tuple[int, int], int] = {}  # bigram -> position of its second token, latest first
    guesses: list[int | None] = []
    for t in range(upto):
        if t >= 1:
            seen[(tokens[t - 1], tokens[t])] = t  # the bigram ending at x_t; its follower x_{t+1} is known
        found = seen.get((tokens[t], tokens[t + 1]))
        guesses.append(tokens[found + 1] if found is not None else None)
    return guesses


@torch.no_grad()
def analyse(draft, target, rows: list[dict], batch_size: int = 4) -> dict:
    """Counts over every supervised step-0 position of `rows` (tokenised conversations)."""
    pad = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0
    collate = Eagle3DataCollator(pad_token_id=pad)
    to_target = torch.nonzero(draft.t2d)[:, 0]  # [Vd] target id of each draft id
    names = ("positions", "draft_right", "lookup_made", "lookup_right", "draft_right_where_lookup_right",
             "draft_or_lookup_right", "in_vocab")
    counts = dict.fromkeys(names, 0)
    buckets = [[0, 0] for _ in CONFIDENCE_EDGES[1:]]  # [positions, draft right] per confidence bucket
    by_position = [[0, 0, 0, 0] for _ in POSITION_EDGES[1:]]  # [positions, draft right, lookup right, both right]
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size])
        ids, attention, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True, use_cache=False)
        states = ttt_forward(draft, ids, draft.target_features(out.hidden_states), attention, 1, return_hidden=True)
        draft_pos, target_rows, mask_pos = step_alignment(ids.shape[1], 0)
        probs = torch.softmax(out.logits[:, target_rows].float(), dim=-1)  # [B, n, V]: predicts x_{t+2}
        confidence, top = probs.max(dim=-1)  # [B, n] each
        predicted = to_target[draft.lm_head(states[0][:, draft_pos]).float().argmax(-1)]  # [B, n]
        for b in range(ids.shape[0]):
            guesses = bigram_lookup(ids[b].tolist(), draft_pos.stop)
            for t in torch.nonzero(mask[b, mask_pos]).flatten().tolist():
                right, answer, guess = bool(predicted[b, t] == top[b, t]), int(top[b, t]), guesses[t]
                counts["positions"] += 1
                counts["draft_right"] += right
                counts["in_vocab"] += bool(draft.t2d[answer])
                counts["lookup_made"] += guess is not None
                counts["lookup_right"] += guess == answer
                counts["draft_right_where_lookup_right"] += right and guess == answer
                counts["draft_or_lookup_right"] += right or guess == answer
                bucket = sum(bool(confidence[b, t] >= edge) for edge in CONFIDENCE_EDGES[1:-1])
                buckets[bucket][0] += 1
                buckets[bucket][1] += right
                where = by_position[sum(t + 2 >= edge for edge in POSITION_EDGES[1:-1])]
                for i, hit in enumerate((True, right, guess == answer, right and guess == answer)):
                    where[i] += hit
    n = max(counts["positions"], 1)
    lookup_right = max(counts["lookup_right"], 1)
    return {
        "positions": counts["positions"],
        "draft_accuracy": counts["draft_right"] / n,
        "coverage": counts["in_vocab"] / n,
        "lookup_made": counts["lookup_made"] / n,
        "lookup_hit_rate": counts["lookup_right"] / max(counts["lookup_made"], 1),
        "lookup_right": counts["lookup_right"] / n,
        "draft_accuracy_where_lookup_right": counts["draft_right_where_lookup_right"] / lookup_right,
        "draft_accuracy_elsewhere": (counts["draft_right"] - counts["draft_right_where_lookup_right"])
        / max(counts["positions"] - counts["lookup_right"], 1),
        "draft_or_lookup_right": counts["draft_or_lookup_right"] / n,
        "by_target_confidence": [
            {"from": lo, "to": hi, "share": m / n, "draft_accuracy": r / max(m, 1)}
            for (lo, hi), (m, r) in zip(zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]), buckets)
        ],
        "by_position": [
            {"from": lo, "to": hi, "share": m / n, "draft_accuracy": r / max(m, 1), "lookup_right": lr / max(m, 1),
             "draft_accuracy_where_lookup_right": both / max(lr, 1)}
            for (lo, hi), (m, r, lr, both) in zip(zip(POSITION_EDGES, POSITION_EDGES[1:]), by_position)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", action="append", required=True, help="a draft folder (repeat to compare)")
    parser.add_argument("--data", required=True, help="conversations answered by the target (DATA[:held-out])")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here ({draft: results})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    data, _, split = args.data.partition(":")
    _, rows, _ = load_tokenised_data(args.target, [data], args.max_length, args.max_conversations,
                                     split_filter(split or "all"))  # fmt: skip
    rows = list(rows)
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype).eval()
    results = {}
    for path in args.draft:
        draft = load_draft_for(args.target, target, path).to(dtype).eval()
        result = analyse(draft, target, rows)
        results[path] = {"data": args.data, "conversations": len(rows), **result}
        print(f"{path}: {json.dumps(result, indent=1)}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

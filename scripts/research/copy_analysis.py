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

With ``--attention`` it also profiles the first draft layer's step-0 attention (the only place where the draft reads
its context, and the only path by which the just-verified token ``x_{t+1}`` enters it: the layer's residual stream
carries the target's features alone): per head, the mean attention mass on the query's own position, the one before
and the first token, the mean largest weight of a query, and where the bigram lookup finds an earlier occurrence,
the largest weight any head puts on the position whose input token is the lookup's guess (what a copying head
attends to), split by whether the guess is right.

With ``--token-probe N`` it checks, at N random supervised positions, how much the draft's step 0 depends on the
just-verified token: the same prediction with ``x_{t+1}`` replaced by a random frequent draft-vocabulary token
(the target's features, computed on the true tokens, kept).

Usage (SmolLM2; `regen_mtbench/` from examples/data/smollm2_mtbench_turn1_regen.tar.gz):

    python scripts/research/copy_analysis.py --draft eagle3_hf/drafts/smollm2-135m-instruct \
        --data work_data/regen_mtbench --json scripts/research/results/copy_analysis.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.modeling.masks import causal_mask
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.tokenise import tokenise_data
from eagle3_hf.training.trainer import Eagle3DataCollator
from eagle3_hf.training.ttt import shift_left, step_alignment, ttt_forward
from eagle3_hf.training.ttt_layer import repeat_kv

CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)
POSITION_EDGES = (0, 128, 256, 384, 512, 768, 1024)  # token position in the row: training cuts rows at --max-length


def bigram_sources(tokens: list[int], upto: int) -> list[int | None]:
    """For each t < `upto`: the position ``k`` of the latest earlier occurrence ``(x_{k-1}, x_k)`` of the bigram
    ``(x_t, x_{t+1})``, if any; the lookup's guess is then ``x_{k+1}``, the token the draft reads at position ``k``.

    "Earlier" means the occurrence's follower lies at or before ``x_{t+1}``, i.e. inside what the draft has seen.
    """
    seen: dict[tuple[int, int], int] = {}  # bigram -> position of its second token, latest first
    sources: list[int | None] = []
    for t in range(upto):
        if t >= 1:
            seen[(tokens[t - 1], tokens[t])] = t  # the bigram ending at x_t; its follower x_{t+1} is known
        sources.append(seen.get((tokens[t], tokens[t + 1])))
    return sources


def step0_attention(draft, ids: torch.Tensor, features: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The first draft layer's step-0 attention weights ``[B, heads, S, S]`` (as `ttt_forward` computes them)."""
    layer = draft.draft_layers()[0]
    hidden = draft.fuse(features.to(draft.fc.weight.dtype))  # [B, S, H]
    embeds = draft.embed_tokens(shift_left(ids, 1)).to(hidden.dtype)  # position t reads x_{t+1}
    position = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    x, _ = layer.layer_input(embeds, hidden)
    q, k, _ = layer.qkv(x, draft.rotary_emb(hidden, position))
    k = repeat_kv(k, layer.self_attn.num_key_value_groups)
    mask = causal_mask(ids.shape[0], ids.shape[1], 0, attention, torch.float32, ids.device)  # [B, 1, S, S]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.self_attn.scaling
    return torch.softmax(scores + mask, dim=-1)


class AttentionProfile:
    """Running sums of `step0_attention` statistics over supervised positions (see the module docstring)."""

    def __init__(self, heads: int) -> None:
        self.queries = 0
        self.sums = {name: torch.zeros(heads) for name in ("own", "previous", "first", "largest")}
        self.source = {True: [0, 0.0, 0], False: [0, 0.0, 0]}  # lookup right -> [n, sum of max weight, n above 0.5]

    def add(self, probs: torch.Tensor, t: int, source: int | None, lookup_right: bool) -> None:
        """`probs` ``[heads, S, S]`` of one row; `t` a supervised query; `source` the lookup's source position."""
        row = probs[:, t]  # [heads, S]
        self.queries += 1
        self.sums["own"] += row[:, t]
        self.sums["previous"] += row[:, t - 1] if t > 0 else 0.0
        self.sums["first"] += row[:, 0]
        self.sums["largest"] += row.max(dim=-1).values
        if source is not None:
            weight = float(row[:, source].max())
            entry = self.source[lookup_right]
            entry[0] += 1
            entry[1] += weight
            entry[2] += weight > 0.5

    def result(self) -> dict:
        n = max(self.queries, 1)
        out = {f"{name}_by_head": [round(float(v) / n, 4) for v in total] for name, total in self.sums.items()}
        for right, (m, total, above) in self.source.items():
            key = "where_lookup_right" if right else "where_lookup_wrong"
            out[f"source_max_weight_{key}"] = total / max(m, 1)
            out[f"source_weight_above_half_{key}"] = above / max(m, 1)
        return out


@torch.no_grad()
def token_probe(draft, target, rows: list[dict], positions: int, seed: int = 0) -> dict:
    """Step-0 accuracy with the true ``x_{t+1}`` and with a random one, at `positions` random supervised positions."""
    generator = torch.Generator().manual_seed(seed)
    to_target = torch.nonzero(draft.t2d)[:, 0]  # [Vd]
    frequent = to_target[:4096]  # the lowest target ids: a BPE vocabulary's earliest merges, short tokens
    collate = Eagle3DataCollator(pad_token_id=0)
    per_row = max(1, -(-positions // len(rows)))
    counts = {"positions": 0, "right_true_token": 0, "right_random_token": 0, "same_prediction": 0}
    for row in rows:
        if counts["positions"] == positions:
            break
        batch = collate([row])
        ids = batch["input_ids"]
        out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
        features = draft.target_features(out.hidden_states)
        supervised = torch.nonzero(batch["loss_mask"][0, 2:]).flatten()  # t whose x_{t+2} carries a loss
        for t in supervised[torch.randperm(len(supervised), generator=generator)[:per_row]].tolist():
            if counts["positions"] == positions:
                break
            predictions = []
            for corrupt in (False, True):
                x = ids[:, : t + 2].clone()  # causal: nothing after x_{t+1} matters at position t
                if corrupt:
                    x[0, t + 1] = frequent[torch.randint(len(frequent), (1,), generator=generator)]
                state = ttt_forward(draft, x, features[:, : t + 2], None, 1, return_hidden=True)[0]
                predictions.append(int(to_target[draft.lm_head(state[0, t]).float().argmax()]))
            top = int(out.logits[0, t + 1].float().argmax())  # the target's x_{t+2}
            counts["positions"] += 1
            counts["right_true_token"] += predictions[0] == top
            counts["right_random_token"] += predictions[1] == top
            counts["same_prediction"] += predictions[0] == predictions[1]
    n = max(counts["positions"], 1)
    return {"positions": counts["positions"], **{k: v / n for k, v in counts.items() if k != "positions"}}


@torch.no_grad()
def analyse(draft, target, rows: list[dict], batch_size: int = 4, attention: bool = False) -> dict:
    """Counts over every supervised step-0 position of `rows` (tokenised conversations)."""
    pad = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0
    collate = Eagle3DataCollator(pad_token_id=pad)
    to_target = torch.nonzero(draft.t2d)[:, 0]  # [Vd] target id of each draft id
    names = (
        "positions",
        "draft_right",
        "lookup_made",
        "lookup_right",
        "draft_right_where_lookup_right",
        "draft_or_lookup_right",
        "in_vocab",
    )
    counts = dict.fromkeys(names, 0)
    buckets = [[0, 0] for _ in CONFIDENCE_EDGES[1:]]  # [positions, draft right] per confidence bucket
    by_position = [[0, 0, 0, 0] for _ in POSITION_EDGES[1:]]  # [positions, draft right, lookup right, both right]
    profile = AttentionProfile(draft.config.num_attention_heads) if attention else None
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size])
        ids, attention_mask, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        features = draft.target_features(out.hidden_states)
        states = ttt_forward(draft, ids, features, attention_mask, 1, return_hidden=True)
        probs = step0_attention(draft, ids, features, attention_mask) if profile else None  # [B, h, S, S]
        draft_pos, target_rows, mask_pos = step_alignment(ids.shape[1], 0)
        target_probs = torch.softmax(out.logits[:, target_rows].float(), dim=-1)  # [B, n, V]: predicts x_{t+2}
        confidence, top = target_probs.max(dim=-1)  # [B, n] each
        predicted = to_target[draft.lm_head(states[0][:, draft_pos]).float().argmax(-1)]  # [B, n]
        for b in range(ids.shape[0]):
            tokens = ids[b].tolist()
            sources = bigram_sources(tokens, draft_pos.stop)
            for t in torch.nonzero(mask[b, mask_pos]).flatten().tolist():
                guess = tokens[sources[t] + 1] if sources[t] is not None else None
                right, answer = bool(predicted[b, t] == top[b, t]), int(top[b, t])
                if profile is not None:
                    profile.add(probs[b], t, sources[t], guess == answer)
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
            {
                "from": lo,
                "to": hi,
                "share": m / n,
                "draft_accuracy": r / max(m, 1),
                "lookup_right": lr / max(m, 1),
                "draft_accuracy_where_lookup_right": both / max(lr, 1),
            }
            for (lo, hi), (m, r, lr, both) in zip(zip(POSITION_EDGES, POSITION_EDGES[1:]), by_position)
        ],
        **({"step0_attention": profile.result()} if profile else {}),
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
    parser.add_argument("--attention", action="store_true", help="also profile the first layer's step-0 attention")
    parser.add_argument(
        "--token-probe",
        type=int,
        default=0,
        metavar="N",
        help="also test N positions with the just-verified token replaced at random",
    )
    parser.add_argument("--json", default=None, help="write the results here ({draft: results})")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    data, _, split = args.data.partition(":")
    tokenizer = load_tokenizer(args.target)
    rows, _ = tokenise_data(tokenizer, [data], args.max_length, args.max_conversations, split_filter(split or "all"))
    rows = list(rows)
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype).eval()
    results = {}
    for path in args.draft:
        draft = load_draft_for(args.target, target, path).to(dtype).eval()
        result = analyse(draft, target, rows, attention=args.attention)
        if args.token_probe:
            result["token_probe"] = token_probe(draft, target, rows, args.token_probe)
        results[path] = {"data": args.data, "conversations": len(rows), **result}
        print(f"{path}: {json.dumps(result, indent=1)}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

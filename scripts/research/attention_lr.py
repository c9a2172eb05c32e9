"""Does a part of the draft learn faster with a larger learning rate: its attention's query and key projections, or
the upper layer of a grown draft?

The SmolLM2 draft's first-layer attention (the 625-step 16,384-id draft, shipped at the time) is diffuse
(`scripts/research/copy_analysis.py --attention`: a query's largest weight averages 0.2-0.36 per head, its own
position gets under 0.02), it copies from its context far less often than the target does, and its q/k weights moved
the least from their initial scale (RMS 0.025-0.027 against 0.02 at initialisation; the MLP's 0.031-0.034). Adam
moves every weight by about the learning rate per step whatever the gradient's size, so a larger learning rate on
`q_proj`/`k_proj` alone is the direct test of "the attention is under-trained". This script continues a draft on
regenerated conversations (online target features and logits, TTT, the train command's AdamW settings: betas
0.9/0.95, no weight decay, clipping 0.5; 20 warmup steps then a constant rate; batch 2 x 2 accumulated) with
`--lr-scale` times the learning rate on those projections (or on the parameters `--scaled-params` names, e.g.
`upper_layers`: the layer a grown 2-layer draft added, which starts as the identity), for a budget of process CPU
seconds, and every `--eval-every` steps writes a JSON line: step-0 accuracy against the target's full-vocabulary top
token on the first `--eval-conversations` conversations of `--eval`, the mean running training step-0 accuracy, the
mean largest attention weight of a query (how sharp the attention is) and, for a deeper draft, the RMS of its upper
layers' `o_proj`/`down_proj` weights (zero while they are the identity). The qk*.jsonl results were written before
`--scaled-params` existed (their key: `qk_lr_scale`).

Usage (one thread per run; `regen_*` folders from the archives in examples/data):

    python scripts/research/attention_lr.py --draft eagle3_hf/drafts/smollm2-135m-instruct \
        --data work_data/regen_sharegpt --eval work_data/regen_mtbench --qk-lr-scale 10 \
        --cpu-seconds 1200 --output scripts/research/results/attention_lr/qk10.jsonl

and for the added layer of a grown draft (a checkpoint folder of `eagle3-hf train --num-hidden-layers 2`):

    python scripts/research/attention_lr.py --draft work_data/draft_mix2L/checkpoint-375 \
        --data work_data/regen_sharegpt --eval work_data/regen_mtbench --scaled-params upper_layers \
        --lr-scale 30 --cpu-seconds 1350 --output scripts/research/results/attention_lr/upper30.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.tokenise import tokenise_data
from eagle3_hf.training.trainer import Eagle3DataCollator
from eagle3_hf.training.ttt import ttt_forward, ttt_loss


def sharpness(draft, ids: torch.Tensor, features: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """Mean over heads and queries (from the 65th token on) of a query's largest first-layer attention weight."""
    from copy_analysis import step0_attention  # its folder is on sys.path when this script runs

    probs = step0_attention(draft, ids, features.float(), attention_mask)  # [1, heads, S, S]
    return probs[0, :, 64:].max(dim=-1).values.mean().item()


@torch.no_grad()
def upper_rms(draft) -> dict:
    """RMS of the upper layers' output projections (the weights a grown layer starts with at zero)."""
    weights = [w for layer in draft.upper_layers for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    if not weights:
        return {}
    return {"upper_out_rms": round(torch.cat([w.float().flatten() for w in weights]).pow(2).mean().sqrt().item(), 5)}


@torch.no_grad()
def evaluate(draft, target, rows: list[dict], collate) -> dict:
    draft.eval()
    right = total = 0.0
    sharp = []
    for row in rows:
        batch = collate([row])
        ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        features = draft.target_features(out.hidden_states)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = ttt_forward(draft, ids, features, attention_mask, 1, return_hidden=True)
            result = ttt_loss(states, out.logits.float(), batch["loss_mask"].float(), draft.t2d, head=draft.lm_head)
        weight = float(batch["loss_mask"][:, 2:].sum())  # the row's supervised step-0 positions
        right += float(result.step_accuracy[0]) * weight
        total += weight
        sharp.append(sharpness(draft, ids, features, attention_mask))
    draft.train()
    return {
        "eval_acc0": round(right / max(total, 1.0), 4),
        "attention_largest_weight": round(sum(sharp) / len(sharp), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True, help="the draft folder to continue")
    parser.add_argument("--data", required=True, help="training conversations (their train split is used)")
    parser.add_argument("--eval", required=True, help="evaluation conversations answered by the target")
    parser.add_argument("--eval-conversations", type=int, default=20)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument(
        "--lr-scale",
        "--qk-lr-scale",
        dest="lr_scale",
        type=float,
        default=1.0,
        help="learning rate factor on the --scaled-params parameters",
    )
    parser.add_argument(
        "--scaled-params", default="q_proj,k_proj", help="comma-separated parts of parameter names that get --lr-scale"
    )
    parser.add_argument("--save-to", help="save the trained draft in this folder at the end")
    parser.add_argument("--cpu-seconds", type=float, default=1200, help="process CPU time for training")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSON lines, one per evaluation")
    args = parser.parse_args()
    if args.lr_scale <= 0:
        parser.error(f"--lr-scale must be positive, got {args.lr_scale}")
    scaled_parts = [part for part in args.scaled_params.split(",") if part]
    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(args.target)
    train_rows, _ = tokenise_data(tokenizer, [args.data], args.max_length, None, split_filter("train"))
    eval_rows, _ = tokenise_data(tokenizer, [args.eval], 1024, args.eval_conversations)
    train_rows, eval_rows = list(train_rows), list(eval_rows)
    target = load_target(args.target, dtype=torch.bfloat16).eval()
    draft = load_draft_for(args.target, target, args.draft).float()
    collate = Eagle3DataCollator(pad_token_id=0)
    trainable = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    is_scaled = [any(part in name for part in scaled_parts) for name, _ in trainable]
    scaled = [p for (_, p), chosen in zip(trainable, is_scaled) if chosen]
    rest = [p for (_, p), chosen in zip(trainable, is_scaled) if not chosen]
    if not scaled:
        parser.error(f"--scaled-params {args.scaled_params!r} matches no trainable parameter of the draft")
    base_lrs = (args.learning_rate, args.learning_rate * args.lr_scale)
    optimizer = torch.optim.AdamW(
        [{"params": rest}, {"params": scaled}], lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.0
    )

    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)

    def record(**fields) -> None:
        settings = {"lr_scale": args.lr_scale, "scaled_params": args.scaled_params}
        line = json.dumps({**settings, **fields, **evaluate(draft, target, eval_rows, collate), **upper_rms(draft)})
        with open(args.output, "a", encoding="utf-8") as log:
            log.write(line + "\n")
        print(line, flush=True)

    record(step=0, train_cpu_s=0)
    order = list(range(len(train_rows)))
    random.shuffle(order)
    start, step, cursor, accuracies = time.process_time(), 0, 0, []
    while time.process_time() - start < args.cpu_seconds:
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * min(1.0, (step + 1) / 20)  # warmup, then constant
        for _ in range(2):  # 2 micro-batches of 2 conversations
            batch = collate([train_rows[order[(cursor + i) % len(order)]] for i in range(2)])
            cursor += 2
            with torch.no_grad():
                out = target(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    output_hidden_states=True,
                    use_cache=False,
                )
            with torch.autocast("cpu", dtype=torch.bfloat16):
                states = ttt_forward(
                    draft,
                    batch["input_ids"],
                    draft.target_features(out.hidden_states),
                    batch["attention_mask"],
                    args.ttt_length,
                    return_hidden=True,
                )
                result = ttt_loss(states, out.logits.float(), batch["loss_mask"].float(), draft.t2d, head=draft.lm_head)
            (result.loss / 2).backward()
            accuracies.append(float(result.step_accuracy[0]))
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % args.eval_every == 0:
            used = time.process_time() - start
            recent = accuracies[-100:]
            record(step=step, train_cpu_s=round(used), train_acc0_last100=round(sum(recent) / len(recent), 4))
            start += time.process_time() - start - used  # evaluation time does not count against the budget
    record(step=step, train_cpu_s=round(time.process_time() - start), final=True)
    if args.save_to:
        draft.save_pretrained(args.save_to)


if __name__ == "__main__":
    main()

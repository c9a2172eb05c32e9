"""Compare training recipes for a draft at equal CPU time, on cached target features.

Two steps. `cache` runs the target once over some regenerated conversations and stores, per token, the three tapped
hidden states (bf16) and the target's top-64 logits over its FULL vocabulary; `run` trains one recipe variant on a
cache for a fixed budget of process CPU seconds (so runs are comparable on a busy machine) and evaluates it on held-out
caches with the project's honest metric: teacher-forced accuracy of TTT steps 0..6 against the target's
full-vocabulary top token (a target token outside the draft vocabulary counts as a miss), the vocabulary coverage,
and the simulated acceptance length. Each run appends one JSON line to `--results`.

The soft-label target of a step is the softmax of the cached top-64 logits restricted to the draft vocabulary; the
loss drops positions whose target top token is outside it (`--oov mask`, the references' choice) or trains them on
the renormalised in-vocabulary distribution (`--oov renorm`, this project's former recipe).

Usage (SmolLM2; the folders come from `examples/train_smollm2.sh` and the committed archives in `examples/data`):

    python scripts/research/recipe_sweep.py cache --data work_data/regen_sharegpt/shard_000{00..15}.jsonl \
        --max-conversations 1024 --output work_data/sweep/train.pt
    python scripts/research/recipe_sweep.py cache --data work_data/regen_mtbench --output work_data/sweep/mt.pt
    python scripts/research/recipe_sweep.py run --name cont_lr1e-4 --init-draft eagle3_hf/drafts/smollm2-135m-instruct \
        --lr 1e-4 --cpu-seconds 420 --train work_data/sweep/train.pt --eval work_data/sweep/mt.pt
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.tokenise import tokenise_data
from eagle3_hf.training.ttt import simulated_acceptance_length, ttt_forward

TOP_K = 64  # cached target logits per token


def build_cache(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(args.target)
    dataset, _ = tokenise_data(tokenizer, args.data, args.max_length, args.max_conversations)
    target = load_target(args.target, dtype=torch.bfloat16)
    layers = Eagle3DraftModel.from_target(target).config.resolved_target_layer_ids(target.config.num_hidden_layers)
    rows = []
    start = time.time()
    with torch.no_grad():
        for i in range(len(dataset)):
            ids = torch.tensor(dataset[i]["input_ids"])[None]
            out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
            top, top_ids = out.logits[0].float().topk(TOP_K, dim=-1)  # [S, K] each
            rows.append(
                {
                    "ids": ids[0],
                    "mask": torch.tensor(dataset[i]["loss_mask"], dtype=torch.bool),
                    "taps": torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)[0].to(torch.bfloat16),
                    "top": top.to(torch.bfloat16),
                    "top_ids": top_ids.to(torch.int32),
                }
            )
            if i % 100 == 0:
                print(f"{i}/{len(dataset)} conversations, {time.time() - start:.0f} s", flush=True)
    torch.save({"rows": rows, "layers": layers}, args.output)


def batchify(rows: list[dict]) -> tuple[torch.Tensor, ...]:
    """Right-pad a list of cached rows: ids, mask, attention mask [B, S]; taps [B, S, 3H]; top, top_ids [B, S, K]."""
    seq, batch = max(len(r["ids"]) for r in rows), len(rows)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    attention = torch.zeros(batch, seq, dtype=torch.long)
    taps = torch.zeros(batch, seq, rows[0]["taps"].shape[-1], dtype=torch.bfloat16)
    top = torch.full((batch, seq, TOP_K), -1e4)
    top_ids = torch.zeros(batch, seq, TOP_K, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["ids"])
        ids[b, :n], mask[b, :n], attention[b, :n], taps[b, :n] = r["ids"], r["mask"], 1, r["taps"]
        top[b, :n], top_ids[b, :n] = r["top"].float(), r["top_ids"].long()
    return ids, mask, attention, taps, top, top_ids


class Recipe:
    """The draft under training with its vocabulary maps, and the loss/metric of one TTT step."""

    def __init__(self, draft: Eagle3DraftModel, oov: str) -> None:
        self.draft = draft
        self.oov = oov
        self.keep = torch.arange(draft.config.draft_vocab_size) + draft.d2t  # draft id -> target id
        self.to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)  # target id -> draft id or -1
        self.to_draft[self.keep] = torch.arange(len(self.keep))

    def step_terms(self, logits, step, mask, top, top_ids) -> tuple[torch.Tensor, int, int, int]:
        """(loss, correct, supervised, in-vocabulary) of TTT step `step`: position t predicts x_{t+2+step}."""
        n = max(mask.shape[1] - 2 - step, 0)
        selected = mask[:, 2 + step : 2 + step + n]  # the predicted token is supervised
        draft_logits = logits[:, :n][selected].float()  # [N, Vd]
        values, ids = top[:, 1 + step : 1 + step + n][selected], top_ids[:, 1 + step : 1 + step + n][selected]
        draft_ids = self.to_draft[ids]  # [N, K], -1 outside the draft vocabulary
        dense = torch.full_like(draft_logits, -1e4)
        dense.scatter_(1, draft_ids.clamp(min=0), torch.where(draft_ids >= 0, values, torch.full_like(values, -1e4)))
        ce = -(torch.softmax(dense, -1) * torch.log_softmax(draft_logits, -1)).sum(-1)  # [N]
        in_vocab = draft_ids[:, 0] >= 0
        weight = in_vocab.float() if self.oov == "mask" else torch.ones_like(ce)
        loss = (ce * weight).sum() / weight.sum().clamp(min=1)
        correct = int((self.keep[draft_logits.argmax(-1)] == ids[:, 0]).sum())
        return loss, correct, len(ids), int(in_vocab.sum())

    @torch.no_grad()
    def evaluate(self, rows: list[dict], ttt_length: int = 7) -> dict:
        self.draft.eval()
        correct, total, covered = [0] * ttt_length, [0] * ttt_length, 0
        for i in range(0, len(rows), 4):
            ids, mask, attention, taps, top, top_ids = batchify(rows[i : i + 4])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = ttt_forward(self.draft, ids, taps, attention, ttt_length)
            for step in range(ttt_length):
                _, c, n, inside = self.step_terms(logits[step], step, mask, top, top_ids)
                correct[step], total[step] = correct[step] + c, total[step] + n
                covered += inside if step == 0 else 0
        self.draft.train()
        acc = [c / max(t, 1) for c, t in zip(correct, total)]
        return {"acc": acc, "sim_accept_len": simulated_acceptance_length(acc), "coverage": covered / max(total[0], 1)}


def make_draft(args: argparse.Namespace, train: list[dict]) -> Eagle3DraftModel:
    target = load_target(args.target, dtype=torch.float32)
    overrides = {"intermediate_size": args.intermediate} if args.intermediate else {}
    vocab = target.config.vocab_size
    if args.init_draft:
        old = Eagle3DraftModel.from_pretrained(args.init_draft, target=target, dtype=torch.float32)
        if old.config.draft_vocab_size == args.vocab and not args.intermediate:
            return old
    counts = torch.zeros(vocab)
    for r in train:
        counts.index_add_(0, r["ids"][r["mask"]], torch.ones(int(r["mask"].sum())))
    keep = counts.topk(args.vocab).indices.sort().values
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=args.vocab, **overrides)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[keep] = True
    draft.set_draft_vocab(keep - torch.arange(args.vocab), t2d)
    with torch.no_grad():
        if args.init == "head":  # the target's head rows of the draft ids and its final norm
            draft.lm_head.weight.copy_(target.lm_head.weight[keep])
            draft.norm.weight.copy_(target.model.norm.weight)
        if args.init_draft:
            grow_from(draft, old, target, keep)
    return draft


def grow_from(draft: Eagle3DraftModel, old: Eagle3DraftModel, target, keep: torch.Tensor) -> None:
    """Copy `old` into `draft`, which may have another vocabulary or a wider MLP.

    Shared tokens keep their head rows; new ones get the target's head rows, rescaled to the old rows' mean norm. A
    wider MLP keeps the old units; the new `down_proj` columns start at zero, so the draft computes the same function.
    """
    old_keep = (torch.arange(old.config.draft_vocab_size) + old.d2t).tolist()
    if old.config.draft_vocab_size == len(keep):
        keep = torch.tensor(old_keep)
        draft.set_draft_vocab(old.d2t, old.t2d)
    own = draft.state_dict()
    for name, value in old.state_dict().items():
        if name.startswith("lm_head") or name in ("d2t", "t2d"):
            continue
        if own[name].shape == value.shape:
            own[name].copy_(value)
        elif name.endswith("down_proj.weight"):
            own[name].zero_()
            own[name][:, : value.shape[1]].copy_(value)
        else:  # gate/up projections: the first rows are the old units
            own[name][: value.shape[0]].copy_(value)
    row = {t: i for i, t in enumerate(old_keep)}
    scale = old.lm_head.weight.norm(dim=1).mean() / target.lm_head.weight.norm(dim=1).mean()
    for i, t in enumerate(keep.tolist()):
        draft.lm_head.weight[i] = old.lm_head.weight[row[t]] if t in row else target.lm_head.weight[t] * scale


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    train = torch.load(args.train)["rows"][: args.max_train]  # --max-train: a fit test on a few conversations
    evals = {path: torch.load(path)["rows"] for path in args.eval}
    recipe = Recipe(make_draft(args, train).float().train(), args.oov)
    draft = recipe.draft
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order, pos, step, planned, accs, curve = list(range(len(train))), 0, 0, None, [], []
    next_eval = args.eval_every
    random.shuffle(order)
    start = time.process_time()
    while planned is None or step < planned:
        if planned is None and step == 10:  # plan the schedule from the measured cost of the first steps
            planned = int(args.cpu_seconds / ((time.process_time() - start) / 10))
        total = planned or args.probe_steps
        warmup = max(1, int(args.warmup * total))
        progress = (step - warmup) / max(1, total - warmup)
        lr = args.lr * (step + 1) / warmup if step < warmup else args.lr * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr
        for _ in range(args.accum):
            rows = []
            for _ in range(args.batch):
                if pos == len(order):
                    random.shuffle(order)
                    pos = 0
                rows.append(train[order[pos]])
                pos += 1
            ids, mask, attention, taps, top, top_ids = batchify(rows)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = ttt_forward(draft, ids, taps, attention, args.ttt)
            loss = 0.0
            for j in range(args.ttt):
                step_loss, correct, n, _ = recipe.step_terms(logits[j], j, mask, top, top_ids)
                loss = loss + 0.8**j * step_loss
                if j == 0:
                    accs.append(correct / max(n, 1))
            (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0:
            print(f"step {step}/{planned} lr {lr:.2e} loss {float(loss):.3f} train acc_0 {sum(accs[-50:]) / 50:.3f}")
        if args.eval_every and time.process_time() - start >= next_eval:  # a learning-curve point
            used = time.process_time() - start
            curve.append({"step": step, "train_cpu_s": round(used), **recipe.evaluate(evals[args.eval[0]])})
            print(json.dumps(curve[-1]), flush=True)
            start += time.process_time() - start - used  # evaluation time does not count against the budget
            next_eval += args.eval_every
    result = {
        "name": args.name,
        "steps": step,
        "train_cpu_s": round(time.process_time() - start),
        "train_acc_0_last100": sum(accs[-100:]) / max(1, len(accs[-100:])),
        "options": {k: v for k, v in vars(args).items() if k not in ("func", "train", "eval", "results")},
        "eval": {path: recipe.evaluate(rows) for path, rows in evals.items()},
        "curve": curve,
    }
    print(json.dumps(result))
    with open(args.results, "a") as f:
        f.write(json.dumps(result) + "\n")
    if args.save:
        draft.save_pretrained(args.save)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    cache = sub.add_parser("cache", help="target features and top-64 logits of some conversations")
    cache.add_argument("--target", default="smollm2")
    cache.add_argument("--data", nargs="+", required=True)
    cache.add_argument("--max-conversations", type=int, default=None)
    cache.add_argument("--max-length", type=int, default=384)
    cache.add_argument("--output", required=True)
    cache.set_defaults(func=build_cache)
    variant = sub.add_parser("run", help="train one recipe variant for a fixed CPU budget, then evaluate it")
    variant.add_argument("--name", required=True)
    variant.add_argument("--target", default="smollm2")
    variant.add_argument("--train", required=True, help="a cache written by `cache`")
    variant.add_argument("--eval", nargs="+", required=True, help="held-out caches")
    variant.add_argument("--results", default="sweep_results.jsonl")
    variant.add_argument("--save", default=None, help="save the trained draft here")
    variant.add_argument("--init-draft", default=None, help="continue this saved draft")
    variant.add_argument("--init", default="random", choices=["random", "head"], help="fresh draft initialisation")
    variant.add_argument(
        "--max-train",
        type=int,
        default=None,
        help="train on only the first N cached conversations (a fit test: can the draft learn them?)",
    )
    variant.add_argument("--vocab", type=int, default=8192)
    variant.add_argument("--intermediate", type=int, default=0, help="MLP width (0: the target's)")
    variant.add_argument("--oov", default="mask", choices=["mask", "renorm"])
    variant.add_argument("--lr", type=float, default=5e-4)
    variant.add_argument("--batch", type=int, default=2)
    variant.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    variant.add_argument("--ttt", type=int, default=7)
    variant.add_argument("--warmup", type=float, default=0.03)
    variant.add_argument("--cpu-seconds", type=float, default=420, help="process CPU time for training")
    variant.add_argument("--probe-steps", type=int, default=1000, help="schedule length assumed for the first steps")
    variant.add_argument("--eval-every", type=float, default=0, help="CPU seconds between learning-curve points")
    variant.add_argument("--seed", type=int, default=0)
    variant.set_defaults(func=run)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.func(args)


if __name__ == "__main__":
    main()

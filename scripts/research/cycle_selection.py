"""Why generation-time depth-1 acceptance sits below teacher-forced step-0 accuracy on the same tokens.

`bench`'s fixed-depth chain drafts `--depth` tokens a cycle and keeps the longest correct prefix plus the target's
bonus token, so its next cycle starts right after the first miss. Easy stretches are consumed several tokens per
cycle, hard ones one token per cycle: cycles start more often where the draft is wrong, and the share of cycles whose
first drafted token is accepted (depth-1 acceptance) is below the share of tokens the draft predicts right.

This script measures that selection effect without generating: on the target's own answers (teacher-forced, as
`eagle3-hf evaluate` runs the draft), it records for every answer token whether TTT step ``j`` predicts it right
(drafting ``j`` steps on the draft's own states equals TTT step ``j``; tested), then walks the answer as the chain
would -- a cycle's step ``j`` predicts the token ``j`` after its start, the cycle keeps the leading correct steps, the
next starts after the bonus token -- and reports step-0 accuracy over all answer tokens beside depth-1 acceptance
over the cycles. Run on `bench`'s own window (`bench_subset.py` writes it), with the models loaded as `bench` loads
them (bf16, weights prepacked), and with ``--generate 128`` also on the chain's own decoded text beside the chain's
actual cycles::

    python scripts/research/cycle_selection.py --data work_data/mtbench_every8_128.jsonl \\
        --draft eagle3_hf/drafts/smollm2-135m-instruct --generate 128

Walking given answers tells what the chain would do if it decoded that text; a drafted token is checked against the
target's top token there, as verification checks it. `bench` decodes its own text, which leaves the regenerated
answers within a few tokens on most prompts (near-ties), hence ``--generate``: the walk over the decoded text is set
beside the chain's actual cycles, and the report says after how many tokens each decoded text leaves its answer.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def step_hits(draft, target, row: dict, depth: int) -> torch.Tensor:
    """``[depth, S]`` bool: entry ``(j, i)`` is whether TTT step ``j`` predicts token ``i`` as the target's top token
    (only where ``i`` is an answer token that step ``j`` reaches; False elsewhere)."""
    from eagle3_hf.training.features import online_features
    from eagle3_hf.training.ttt import step_alignment, ttt_forward

    ids = torch.tensor([row["input_ids"]])
    mask = torch.tensor([row["loss_mask"]], dtype=torch.bool)
    attention = torch.ones_like(ids)
    features, _, top_ids = online_features(target, draft, ids, attention, 1)
    logits = ttt_forward(draft, ids, features, attention, depth)  # depth x [1, S, Vd]
    seq = ids.shape[1]
    hits = torch.zeros(depth, seq, dtype=torch.bool)
    for j, step in enumerate(logits):
        draft_pos, target_rows, token_pos = step_alignment(seq, j)
        predicted = draft.draft_to_target_ids(step[0, draft_pos].argmax(-1))
        right = predicted == top_ids[0, target_rows, 0].long()
        hits[j, token_pos] = right & mask[0, token_pos]
    return hits


def walk(hits: torch.Tensor, answer: list[int]) -> list[int]:
    """The chain's accepted drafted tokens per cycle over one answer (token indices `answer`, in order): the first
    answer token comes from the prompt's forward, each cycle then drafts from the next one and emits its accepted
    tokens and the target's bonus token, so it accepts none past the answer's second-to-last token (decoding stops at
    its last, as `max_new_tokens` stops it)."""
    depth = hits.shape[0]
    accepted, position, last = [], answer[0] + 1, answer[-1]
    while position <= last:
        n = 0
        while n < depth and position + n < last and bool(hits[n, position + n]):
            n += 1
        accepted.append(n)
        position += n + 1  # the accepted tokens and the target's bonus token
    return accepted


def generate_chain(target, draft, prompt: list[int], depth: int, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """`bench`'s fixed-depth chain on one prompt: (the new tokens, the drafted tokens accepted in each cycle)."""
    ids = torch.tensor([prompt])
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        return_dict_in_generate=True,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        tree_top_k=1,
        tree_total_tokens=depth + 1,
        adaptive_tree=False,
        context_lookup=False,
    )
    accepted = [a - 1 for a, n in zip(out.accept_lengths, out.tree_sizes) if n > 1]  # a: accepted + the bonus token
    return out.sequences[0, len(prompt) :].tolist(), accepted


def rates(cycles: list[int], depth: int) -> list[float]:
    """Acceptance at each depth d: cycles accepting >= d drafted tokens over those accepting >= d - 1."""
    reached = [sum(1 for a in cycles if a >= d) for d in range(depth + 1)]  # cycles accepting >= d
    return [reached[d] / max(reached[d - 1], 1) for d in range(1, depth + 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the target's own answers (ShareGPT JSONL)")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--depth", type=int, default=6, help="the chain's drafted tokens per cycle (bench: 6)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--generate",
        type=int,
        metavar="N",
        default=0,
        help="also decode N new tokens from each answer's prompt with bench's chain (bf16, "
        "weights prepacked, as bench loads them) and walk the decoded text beside its cycles",
    )
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    if args.depth < 1 or args.generate < 0:
        parser.error(f"--depth must be >= 1 and --generate >= 0, got {args.depth} and {args.generate}.")

    from eagle3_hf.bench.runner import load_models
    from eagle3_hf.targets import load_tokenizer
    from eagle3_hf.training.tokenise import tokenise_data

    tokenizer = load_tokenizer(args.target)
    rows, _ = tokenise_data(tokenizer, args.data, args.max_length)
    options = argparse.Namespace(target=args.target, device="cpu", draft=args.draft, no_prepack=False)
    targets, drafts, _ = load_models(options, torch.bfloat16, {torch.bfloat16})
    target, draft = targets[torch.bfloat16].eval(), drafts[torch.bfloat16].eval()
    report: dict = {"draft": args.draft, "data": args.data, "dtype": "bfloat16", "depth": args.depth}
    texts = {"answers": []}  # which text is walked: the given answers, and the chain's own output
    decoded: list[list[int]] = []  # the chain's accepted drafted tokens per cycle, per prompt
    with torch.no_grad():
        for row in rows:
            answer = [i for i, m in enumerate(row["loss_mask"]) if m]
            if len(answer) < 2:
                continue
            texts["answers"].append(row)
            if args.generate:
                prompt = row["input_ids"][: answer[0]]
                new, accepted = generate_chain(target, draft, prompt, args.depth, args.generate)
                texts.setdefault("decoded", []).append(
                    {"input_ids": prompt + new, "loss_mask": [0] * len(prompt) + [1] * len(new)}
                )
                decoded.append(accepted)
                given = row["input_ids"][answer[0] :]
                shared = next((i for i, (x, y) in enumerate(zip(new, given)) if x != y), min(len(new), len(given)))
                report.setdefault("tokens_before_the_decoded_text_leaves_the_answer", []).append(shared)
        for name, walked in texts.items():
            tokens = right = 0
            cycles: list[list[int]] = []
            for row in walked:
                answer = [i for i, m in enumerate(row["loss_mask"]) if m]
                hits = step_hits(draft, target, row, args.depth)
                tokens += sum(1 for i in answer if i >= 2)  # the tokens step 0 scores, as in the evaluation
                right += int(hits[0].sum())
                cycles.append(walk(hits, answer))
            flat = [a for c in cycles for a in c]
            report[name] = {
                "answer_tokens_scored": tokens,
                "step0_accuracy": round(right / max(tokens, 1), 4),
                "cycles": len(flat),
                "depth1_acceptance": round(rates(flat, args.depth)[0], 4),
                "acceptance_by_depth": [round(a, 4) for a in rates(flat, args.depth)],
                "tau": round(1 + sum(flat) / max(len(flat), 1), 4),
            }
            if name == "decoded":
                actual = [a for c in decoded for a in c]
                report["chain"] = {
                    "cycles": len(actual),
                    "depth1_acceptance": round(rates(actual, args.depth)[0], 4),
                    "acceptance_by_depth": [round(a, 4) for a in rates(actual, args.depth)],
                    "tau": round(1 + sum(actual) / max(len(actual), 1), 4),
                    "prompts_walked_alike": sum(1 for c, d in zip(cycles, decoded) if c == d),
                    "cycles_alike": sum(sum(1 for x, y in zip(c, d) if x == y) for c, d in zip(cycles, decoded)),
                }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

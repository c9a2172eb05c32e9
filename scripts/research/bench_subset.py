"""Write what `eagle3-hf bench` decodes as evaluation data: the target's answers to its prompts, cut to its window.

`bench` drafts on every `--every`-th MT-bench question (at most `--num-prompts`) for `--max-new-tokens` tokens;
teacher-forced accuracy on exactly those tokens is what its depth-1 acceptance should be set against:

    python scripts/research/bench_subset.py work_data/regen_mtbench work_data/mtbench_every8_128.jsonl
    eagle3-hf evaluate --data work_data/mtbench_every8_128.jsonl --split all --dtype bfloat16 --max-length 1024

The answers are the target's own (`examples/data/smollm2_mtbench_turn1_regen.tar.gz`, ids ``mtbench-QID``), cut to
their first `--max-new-tokens` tokens by the target's tokenizer.
"""

from __future__ import annotations

import argparse
import json

from eagle3_hf.targets import load_tokenizer
from eagle3_hf.training.data import read_conversations

FIRST_QUESTION_ID = 81  # MT-bench's question.jsonl starts at 81 and lists its questions in id order


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("answers", help="the target's answers to MT-bench turn 1 (a regenerate folder or file)")
    parser.add_argument("output", help="JSON-lines file to write")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--every", type=int, default=8, help="as bench's --every")
    parser.add_argument("--num-prompts", type=int, default=10, help="as bench's --num-prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="as bench's --max-new-tokens")
    args = parser.parse_args()
    for name in ("every", "num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    tokenizer = load_tokenizer(args.target)
    by_id = {c["id"]: c for c in read_conversations(args.answers)}
    count = 0
    with open(args.output, "w", encoding="utf-8") as out:
        for index in range(0, args.every * args.num_prompts, args.every):
            conversation = by_id.get(f"mtbench-{FIRST_QUESTION_ID + index}")
            if conversation is None:
                break
            question, answer = conversation["messages"][:2]
            ids = tokenizer(answer["content"], add_special_tokens=False)["input_ids"][: args.max_new_tokens]
            cut = {"role": "assistant", "content": tokenizer.decode(ids)}
            out.write(json.dumps({"id": conversation["id"], "messages": [question, cut]}, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        raise SystemExit(f"{args.answers} holds no answer with an id mtbench-{FIRST_QUESTION_ID}, ...")
    print(f"{count} answers cut to {args.max_new_tokens} tokens written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

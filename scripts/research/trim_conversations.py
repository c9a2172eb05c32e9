"""Write a compact copy of a conversation file that tokenises to the same first `--max-length` tokens.

A training run at ``--max-length`` tokens reads only the start of each conversation, so a copy that keeps each
conversation's messages up to `--max-chars` characters in all (the last one cut there) gives the same tokens, unless
those characters make fewer than `--max-length` tokens (long runs of one character can): such a conversation is kept
whole. `--check` then tokenises both files as training does and compares every conversation's tokens and masks.
Used to carry ShareGPT (125 MB as packaged, mostly text past 384 tokens) to a machine with no network and a limited
upload:

    python scripts/research/trim_conversations.py SHAREGPT.json work_data/sharegpt_trim.jsonl \
        --target smollm2 --max-length 384 --max-chars 6000 --check
"""

from __future__ import annotations

import argparse
import json

from eagle3_hf.targets import load_tokenizer
from eagle3_hf.training.data import build_dataset, normalize_conversation, tokenize_conversation
from eagle3_hf.training.data_files import read_records


def trim(conversation: dict, max_chars: int) -> dict:
    """`conversation` (normalised) with its messages kept up to `max_chars` characters of content in all."""
    kept, used = [], 0
    for message in conversation["messages"]:
        if used >= max_chars:
            break
        content = message["content"][: max_chars - used]
        kept.append({"role": message["role"], "content": content})
        used += len(content)
    return {"id": conversation["id"], "messages": kept}


def compact(conversation: dict, tokenizer, max_length: int, max_chars: int) -> dict:
    """The trimmed conversation where it still fills `max_length` tokens (or nothing was cut), else the whole one."""
    short = trim(conversation, max_chars)
    if short == conversation:
        return conversation
    if any(m["role"] == "assistant" for m in short["messages"]):
        if len(tokenize_conversation(tokenizer, short["messages"], max_length)["input_ids"]) >= max_length:
            return short
    return conversation


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="conversation file or folder, any format eagle3-hf train reads")
    parser.add_argument("output", help="JSON-lines file to write")
    parser.add_argument("--target", required=True, help="the target whose tokeniser training uses")
    parser.add_argument("--max-length", type=int, default=384, help="tokens training reads of a conversation")
    parser.add_argument("--max-chars", type=int, default=6000, help="characters kept before the tokeniser checks")
    parser.add_argument("--check", action="store_true", help="tokenise both files as training does and compare")
    args = parser.parse_args()
    if args.max_chars < 1 or args.max_length < 1:
        parser.error(f"--max-chars and --max-length must be >= 1, got {args.max_chars} and {args.max_length}")
    tokenizer = load_tokenizer(args.target)
    records = [normalize_conversation(r, i) for i, r in enumerate(read_records(args.source))]
    rows = [compact(r, tokenizer, args.max_length, args.max_chars) for r in records]
    with open(args.output, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    whole = sum(1 for a, b in zip(records, rows) if a is b)
    print(f"{len(rows)} conversations written to {args.output} ({whole} whole)")
    if args.check:
        full, _ = build_dataset(records, tokenizer, args.max_length)
        short, _ = build_dataset(list(read_records(args.output)), tokenizer, args.max_length)
        columns = ("id", "input_ids", "loss_mask", "attention_mask")
        same = full.num_rows == short.num_rows and all(list(full[c]) == list(short[c]) for c in columns)
        print(f"check: {full.num_rows} and {short.num_rows} conversations kept; identical tokens and masks: {same}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

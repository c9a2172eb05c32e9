"""What each row of a decoding call emits: its tokens one by one under its stopping criteria, the rows that leave the
batch, the streamer's columns and the output ids, as plain generate() gives them.

Rows finish on their own stopping criteria; a finished row leaves the batch (it stops costing compute) and its output
is padded with `pad_token_id` afterwards, as plain generate() pads it -- which it does only when an EOS criterion is
present; without one plain generate() lets finished rows run on, and so do batches here, until the last row stops.
A single row stops at once.
"""

from __future__ import annotations

import torch

from eagle3_hf.generation.cycle import DecodeRun
from eagle3_hf.generation.target_cache import worth_compacting
from eagle3_hf.generation.transfers import read, upload

__all__ = ["emit", "emit_plan", "retire_rows", "score_steps", "sequence_length", "sequences", "stream"]


def emit_plan(run: DecodeRun, new_tokens: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """Where each active row's new tokens go in the output: (rows, columns, tokens), one entry per token (a finished
    row running on stops at the longest possible output)."""
    em = run.emission
    rows, columns, values = [], [], []
    for row, tokens in zip(run.active, new_tokens):
        for k, token in enumerate(tokens[: em.out.shape[1] - em.lengths[row]]):
            rows.append(row)
            columns.append(em.lengths[row] + k)
            values.append(token)
    return rows, columns, values


def emit(
    run: DecodeRun,
    new_tokens: list[list[int]],
    scores: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    placed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> list[int]:
    """Append each active row's tokens, checking its stopping criteria after each (as plain generate() checks every
    row after every token). A row whose criteria fire keeps no later token when finished rows are padded (and a
    single row never does); otherwise it runs on (plain generate() keeps its real tokens) without further checks.
    Returns how many tokens each row appended. `scores`: per row, the processed scores and raw logits of its new
    tokens' steps (`[n, V]` each, read only where the output asks for them; `NodeScores.path_rows`). `placed`:
    `emit_plan`'s lists already on the device (the loop uploads them with the cycle's other lists); else uploaded
    here.

    The criteria are called on every new token's prefix first and their flags read together: one read per cycle,
    whatever the rows and tokens."""
    em = run.emission
    given = len(new_tokens[0])
    # a finished row running on stops at the longest possible output
    new_tokens = [tokens[: em.out.shape[1] - em.lengths[row]] for row, tokens in zip(run.active, new_tokens)]
    if placed is None:
        placed = tuple(upload(run.device, *emit_plan(run, new_tokens)))
    if placed[0].numel():
        em.out[placed[:2]] = placed[2]
    flags = []
    for (row, tokens), (processed, _) in zip(zip(run.active, new_tokens), scores):
        if em.stop_lengths[row] is None:
            for k in range(len(tokens)):
                ids = em.out[row : row + 1, : em.lengths[row] + k + 1]
                flags.append(em.stopping_criteria(ids, processed[k : k + 1] if em.output_scores else None))
    fired = iter(read([torch.cat(flags)])[0] if flags else [])
    emitted = []
    for (row, tokens), (processed, raw) in zip(zip(run.active, new_tokens), scores):
        count = len(tokens)
        if em.stop_lengths[row] is None:
            hits = [bool(next(fired)) for _ in tokens]
            if True in hits:
                em.stop_lengths[row] = em.lengths[row] + hits.index(True) + 1
                if em.pad_finished or em.batch_size == 1:
                    count = hits.index(True) + 1
        for k in range(count):
            if em.output_scores:
                em.scores[row].append(processed[k])
            if em.output_logits:
                em.raw_logits[row].append(raw[k])
        em.tokens[row].extend(tokens[:count])
        em.lengths[row] += count
        emitted.append(count)
    if em.batch_size == 1 and emitted[0] < given:  # (never for the prefill's one token)
        # a criterion cut the cycle short: keep the cache in step with the output (every token but the last)
        run.columns.crop(run.cache, run.cache.get_seq_length() - (given - emitted[0]))
    stream(run)
    return emitted


def retire_rows(run: DecodeRun) -> None:
    """Drop the rows that need no more tokens from the batch (caches and proposer state included); compact the
    target cache when the columns no row needs pile up."""
    em = run.emission
    stopped = [length for length in em.stop_lengths if length is not None]
    limit = max(stopped) if len(stopped) == em.batch_size else em.max_length

    def needed(row: int) -> bool:
        if em.stop_lengths[row] is None and em.lengths[row] >= em.out.shape[1]:
            em.stop_lengths[row] = em.lengths[row]  # no length criterion: stop at generate()'s max_length
        if em.stop_lengths[row] is None:
            return True
        return not em.pad_finished and em.lengths[row] < limit

    keep = [i for i, row in enumerate(run.active) if needed(row)]
    if keep and len(keep) < len(run.active):
        (index,) = upload(run.device, keep)
        run.columns.select_rows(run.cache, index)
        run.proposer.select_rows(keep, index)
        run.root_ids = run.root_ids[index]
    em.active = [run.active[i] for i in keep]
    if run.active and worth_compacting(run.columns.valid.shape[1], em.longest_cached()):
        run.columns.compact(run.cache, em.longest_cached())


def stream(run: DecodeRun, final: bool = False) -> None:
    """Hand the streamer every column all rows have reached, as plain generate() puts one token per row per step."""
    em = run.emission
    if em.streamer is None:
        return
    # a padded row can give any column, the others only those they have reached; none past the output's end
    reached = [em.lengths[row] for row, stop in enumerate(em.stop_lengths) if stop is None or not em.pad_finished]
    end = em.max_length if final or not reached else min(reached)
    if all(stop is not None for stop in em.stop_lengths):
        end = min(end, sequence_length(run))
    for column in range(em.streamed, end):
        em.streamer.put(sequences(run, column, column + 1)[:, 0].cpu())
    em.streamed = max(em.streamed, end)


def sequence_length(run: DecodeRun) -> int:
    """Plain generate() stops when every row has stopped: the longest row's stop length."""
    em = run.emission
    return max(length if length is not None else em.lengths[row] for row, length in enumerate(em.stop_lengths))


def sequences(run: DecodeRun, start: int = 0, end: int | None = None) -> torch.Tensor:
    """`[B, end - start]` output ids (by default all of them): each row's tokens, finished rows padded with
    `pad_token_id` as plain generate() pads them."""
    em = run.emission
    end = sequence_length(run) if end is None else end
    out = em.out[:, start:end].clone()
    if em.pad_finished:
        for row, stop in enumerate(em.stop_lengths):
            if stop is not None:
                out[row, max(stop - start, 0) :] = em.pad_token_id
    return out


def score_steps(run: DecodeRun) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
    """The output's `scores` and `logits` as plain generate() gives them: one `[B, V]` tensor per step. A row's
    entries are those of the nodes it accepted, and its bonus tokens'. A row that finished early and left the batch
    has no entries for the steps plain generate() still runs it through (it feeds the row `pad_token_id` and scores
    what follows): those are computed here, by one target forward over the row's padded output, only when asked
    for, with the row's processed scores as plain decoding processes them (up to the rounding of one forward over
    the tail instead of one-token steps)."""
    em = run.emission
    if not (em.output_scores or em.output_logits):
        return None, None
    output = sequences(run)  # [B, L], finished rows padded
    steps = output.shape[1] - em.prompt_length
    for row in range(em.batch_size):
        done = len(em.scores[row] if em.output_scores else em.raw_logits[row])
        if done < steps:
            _score_padding_steps(run, output, row, done, steps)
    scores = tuple(torch.stack([r[t] for r in em.scores]) for t in range(steps)) if em.output_scores else None
    logits = tuple(torch.stack([r[t] for r in em.raw_logits]) for t in range(steps)) if em.output_logits else None
    return scores, logits


def _score_padding_steps(run: DecodeRun, output: torch.Tensor, row: int, done: int, steps: int) -> None:
    """Row `row`'s steps `done..steps-1`, which plain generate() ran on its padding after the row finished: the
    logits after each prefix of its padded output (its left padding dropped, as it is masked there)."""
    em = run.emission
    tail = steps - done
    with torch.no_grad():
        out = run.model(
            input_ids=output[row : row + 1, em.starts[row] : em.prompt_length + steps - 1],
            use_cache=False,
            logits_to_keep=tail,
        )
    raw = out.logits[0].float()  # [tail, V]: the logits before steps done..steps-1
    for i in range(tail):
        if em.output_logits:
            em.raw_logits[row].append(raw[i])
        if em.output_scores:
            ids = output[row : row + 1, : em.prompt_length + done + i].expand(em.batch_size, -1)
            # processors with per-row state see the batch's shape, the row repeated (as in node_scores.py)
            em.scores[row].append(run.logits_processor(ids, raw[i].expand(em.batch_size, -1).clone())[row])

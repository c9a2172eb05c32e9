"""Acceptance rules for verifying a draft tree against the target (pure functions).

Trees follow the conventions of tree.py: node 0 is the root, ``parents[i] < i``, and a node's children in index
order are its siblings in draw order.

* ``greedy_accept`` (temperature 0): follow the child whose token equals the target's choice; the bonus token is
  the target's choice after the last accepted node.
* ``sample_accept`` (temperature > 0): recursive rejection sampling over siblings drawn without replacement
  (Jeon et al. 2024, "Recursive Speculative Decoding"). It is lossless, i.e. every emitted token is distributed
  exactly as the target's processed distribution, provided the tree was built as sampled_trees.py builds it (each
  node's children drawn without replacement from ``draft_probs[node]``, all drawn children kept).

In both cases the new tokens of the cycle are ``tokens[path[1:]] + [bonus_token]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .tree import children_lists

__all__ = ["AcceptResult", "greedy_accept", "rrs_step", "sample_accept"]


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of one verification.

    Attributes:
        path: accepted node indices, root first (the root is always included).
        bonus_token: the target's token after the last node of ``path``.
    """

    path: list[int]
    bonus_token: int


def greedy_accept(tokens: list[int], children: list[list[int]], next_of: Callable[[int], int]) -> AcceptResult:
    """Greedy verification of a tree read on the host: its tokens and each node's children (`tree.children_lists`).
    Walks from the root to the child whose token equals `next_of(current)` (the target's choice after that node,
    asked only for the nodes visited, so only their scores need computing) until there is none."""
    path = [0]
    node = 0
    while True:
        wanted = int(next_of(node))
        match = next((child for child in children[node] if tokens[child] == wanted), None)
        if match is None:
            return AcceptResult(path=path, bonus_token=wanted)
        path.append(match)
        node = match


def _normalize(dist: torch.Tensor, default: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dist / dist.sum()``, or `default` when the sum is not a positive finite number."""
    total = dist.sum()
    if not bool(torch.isfinite(total) & (total > 0)):
        return default
    return dist / total


def _rrs_stages(
    p: torch.Tensor, q: torch.Tensor, drafted: Sequence[int], point_masses: Sequence[int] = ()
) -> Iterator[tuple[float, torch.Tensor]]:
    """Yields, for each proposal in turn, ``(accept_probability, p_i)`` assuming all earlier ones were rejected;
    then yields ``(0.0, residual)`` once, the distribution left after rejecting all of them.

    The proposals are the ``point_masses`` first (each with the one-hot draft distribution on its token), then
    ``drafted``, drawn without replacement from ``q``. ``p_i`` and ``q_i`` are the residual target and proposal
    distributions at step ``i``; proposal ``x`` is accepted with probability ``min(1, p_i[x] / q_i[x])`` (for a point
    mass ``p_i[x]``). A draft token with ``q_i[x] == 0`` (impossible in exact arithmetic, since it was drawn from
    ``q_i``) counts as accepted iff ``p_i[x] > 0``.

    Degenerate residuals: rejecting ``x`` is only possible when ``p_i[x] < q_i[x]``, and then
    ``max(p_i - q_i, 0)`` has positive mass unless ``p_i == q_i``, where rejection has probability 0. If rounding
    still leaves no mass, we fall back to the remaining mass of the original ``p``: ``p`` with every rejected
    token zeroed and renormalised (and ``p`` itself if even that is empty). A draft residual ``q_i`` without mass
    stays all-zero, so later siblings are accepted iff ``p_i[x] > 0``.
    """
    work_dtype = torch.promote_types(torch.promote_types(p.dtype, q.dtype), torch.float32)
    p_orig = p.to(work_dtype)
    p_i = p_orig
    q_i = q.to(device=p.device, dtype=work_dtype)
    rejected: list[int] = []
    proposals = [(x, True) for x in point_masses] + [(x, False) for x in drafted]
    for x, point in proposals:
        if point:  # q_i = one-hot at x: max(p_i - q_i, 0) is p_i without x
            accept = min(1.0, float(p_i[x]))
            yield accept, p_i
            leftover = p_i.clone()
            leftover[x] = 0
        else:
            p_x, q_x = float(p_i[x]), float(q_i[x])
            if q_x > 0:
                accept = min(1.0, p_x / q_x)
            else:
                accept = 1.0 if p_x > 0 else 0.0
            yield accept, p_i
            leftover = (p_i - q_i).clamp(min=0)
            q_next = q_i.clone()
            q_next[x] = 0
            q_i = _normalize(q_next, default=q_next)
        rejected.append(x)
        residual = _normalize(leftover)
        if residual is None:
            fallback = p_orig.clone()
            fallback[rejected] = 0
            residual = _normalize(fallback, default=p_orig)
        p_i = residual
    yield 0.0, p_i


def rrs_step(
    p: torch.Tensor,
    q: torch.Tensor,
    drafted: Sequence[int],
    uniforms: Sequence[float],
    point_masses: Sequence[int] = (),
) -> tuple[int | None, torch.Tensor]:
    """One node of recursive rejection sampling over siblings drawn without replacement.

    Args:
        p: ``[V]`` target distribution after the node.
        q: ``[V]`` draft distribution the siblings were drawn from (zeros outside the draft vocabulary).
        drafted: sibling tokens in draw order (distinct).
        uniforms: one U[0, 1) number per proposal (point masses first, then drafted).
        point_masses: deterministic proposals (distinct), tried before the drafted ones, each with the one-hot
            distribution on its own token. A drafted token may repeat one of them: it is then never accepted.

    Returns:
        ``(index, residual_p)``: ``index`` is the position of the accepted proposal in ``[*point_masses,
        *drafted]``, or None if all were rejected; ``residual_p`` is the residual target distribution at that point
        (``p`` itself if the first proposal is accepted), from which the bonus token is drawn when nothing was
        accepted.

    Sibling ``i`` is accepted iff ``uniforms[i] < min(1, p_i[x] / q_i[x])``, where after each rejection
    ``p <- normalize(max(p - q_i, 0))`` and, for a drafted token, ``q <- normalize(q with q[x] = 0)``. See
    ``_rrs_stages`` for the degenerate cases.
    """
    if p.dim() != 1 or q.shape != p.shape:
        raise ValueError(f"expected p [V] and q [V], got {tuple(p.shape)} and {tuple(q.shape)}")
    total = len(point_masses) + len(drafted)
    if len(uniforms) != total:
        raise ValueError(f"need one uniform per proposal: {total} proposals, got {len(uniforms)} uniforms")
    vocab_size = p.shape[0]
    for name, tokens in (("drafted", drafted), ("point_masses", point_masses)):
        if any(not 0 <= int(x) < vocab_size for x in tokens):
            raise ValueError(f"`{name}` tokens must be in [0, {vocab_size}), got {list(tokens)}")
        if len(set(int(x) for x in tokens)) != len(tokens):
            raise ValueError(f"`{name}` tokens must be distinct, got {list(tokens)}")
    stages = _rrs_stages(p, q, [int(x) for x in drafted], [int(x) for x in point_masses])
    # zip reads a uniform before its stage: when they run out, the residual's stage is still there to read
    for index, (uniform, (accept, p_i)) in enumerate(zip(uniforms, stages)):
        if uniform < accept:
            return index, p_i
    return None, next(stages)[1]


def _sample(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    dist = dist.to(torch.promote_types(dist.dtype, torch.float32)).clamp(min=0)
    if _normalize(dist) is None:
        raise ValueError(f"cannot sample the bonus token: the target distribution has no positive mass ({dist})")
    return int(torch.multinomial(dist, 1, generator=generator))


def sample_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs_fn: Callable[[int], torch.Tensor],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    point_mass: torch.Tensor | Sequence[bool] | None = None,
    draws: dict[int, list[int]] | None = None,
) -> AcceptResult:
    """Verification by recursive rejection sampling without replacement.

    Args:
        tokens: ``[T]`` tree tokens (target vocabulary).
        parents: ``[T]`` parent indices; node ``i``'s draft children in index order must be draws without
            replacement, in draw order, from ``draft_probs[i]``.
        target_probs_fn: ``node -> [V]`` the target's processed distribution after ``node`` (called only for the
            nodes visited).
        draft_probs: ``[T, V]`` the draft distribution over the target vocabulary (zeros outside the draft
            vocabulary) from which each node's children were drawn. Only read for visited nodes that have draft
            children; None for a tree without any.
        generator: RNG on the distributions' device; a fixed seed reproduces the result.
        point_mass: optional ``[T]`` bools: node ``i`` is a deterministic proposal (a context lookup's token)
            rather than a draw. A node's point-mass children must come before its draft children in index order.
        draws: optional ``node -> the draft's whole draw sequence there``, where some draws were removed from the
            tree because they repeat a point-mass sibling; the remaining draft children must be exactly the other
            draws. Without an entry, a node's draft children are its draws.

    At each visited node the proposals are tried with ``rrs_step`` -- the point-mass children, then the draws --;
    the walk moves to the accepted child, or stops and draws the bonus token from the residual (from ``p`` itself
    at a leaf).

    Why mixing point masses and draws stays lossless. One step targeting ``p_i`` with a proposal ``x ~ q_i``,
    accepted with probability ``min(1, p_i(x)/q_i(x))`` and otherwise followed by anything whose output is distributed
    as ``r = normalize(max(p_i - q_i, 0))``, outputs ``p_i`` exactly: ``P(x accepted) = min(q_i(x), p_i(x))``, and
    the rejection probability is ``sum(max(q_i - p_i, 0)) = sum(max(p_i - q_i, 0))``, whose product with ``r`` is
    ``p_i - min(p_i, q_i)``. This holds for any ``q_i``, as long as ``x`` is a draw from it made independently of the
    uniforms deciding earlier steps. By induction over the proposals (the last "anything" being the bonus draw from
    the final residual), the output at a node is distributed as its ``p``. A lookup token is decided by the context
    alone, so it is a draw from the one-hot ``q_i``: accepted with probability ``p_i(x)``, leaving ``p_i`` without
    ``x``. The draft's draws, made after and independently of the lookup (their sequence conditioned on the tree
    existing is unchanged), then follow with their usual without-replacement ``q_i``; a draw repeating a rejected
    lookup token has ``p_i(x) = 0`` (exactly: it was zeroed), so it is never accepted and need not be verified, but
    it stays a step of the recursion, which is what keeps the residuals after it right. The subtrees of the draws
    that were removed are never reached. Deeper nodes are the same argument one level down, conditioned on the path.
    """
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(f"expected tokens [T] and parents [T], got {tuple(tokens.shape)} and {tuple(parents.shape)}")
    children = children_lists(parents)
    token_list = tokens.tolist()
    points = [False] * len(token_list) if point_mass is None else [bool(b) for b in point_mass]
    if len(points) != len(token_list):
        raise ValueError(f"`point_mass` must have one entry per node ({len(token_list)}), got {len(points)}")
    draws = draws or {}
    path = [0]
    node = 0
    while True:
        p = target_probs_fn(node)
        kids = children[node]
        if not kids:
            return AcceptResult(path=path, bonus_token=_sample(p, generator))
        fixed = [c for c in kids if points[c]]
        drawn = [c for c in kids if not points[c]]
        if fixed and drawn and max(fixed) > min(drawn):
            raise ValueError(f"node {node}: point-mass children {fixed} must come before the draft children {drawn}")
        sequence = _draw_sequence(node, [token_list[c] for c in drawn], [token_list[c] for c in fixed], draws)
        uniforms = torch.rand(len(fixed) + len(sequence), generator=generator, device=p.device).tolist()
        if sequence and draft_probs is None:
            raise ValueError(f"node {node} has draft children but no `draft_probs` was given")
        q = draft_probs[node] if sequence else torch.zeros_like(p)
        accepted, residual = rrs_step(p, q, sequence, uniforms, point_masses=[token_list[c] for c in fixed])
        if accepted is None:
            return AcceptResult(path=path, bonus_token=_sample(residual, generator))
        if accepted < len(fixed):
            node = fixed[accepted]
        else:
            wanted = sequence[accepted - len(fixed)]
            match = [c for c in drawn if token_list[c] == wanted]
            if not match:
                raise RuntimeError(f"node {node}: accepted the removed draw {wanted}, which has no target mass")
            node = match[0]
        path.append(node)


def _draw_sequence(node: int, drawn: list[int], fixed: list[int], draws: dict[int, list[int]]) -> list[int]:
    """The draft's draw sequence at `node`: its draft children's tokens, or `draws[node]` when some were removed
    (which must then repeat a point-mass sibling)."""
    if node not in draws:
        return drawn
    sequence = list(draws[node])
    removed = [t for t in sequence if t not in drawn]
    if [t for t in sequence if t in drawn] != drawn or any(t not in fixed for t in removed):
        raise ValueError(
            f"node {node}: draws {sequence} must be the draft children {drawn} in order plus repeats of the "
            f"point-mass children {fixed}"
        )
    return sequence

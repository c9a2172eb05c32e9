"""Acceptance rules for verifying a draft tree against the target (pure functions).

Trees follow the conventions of ``eagle3_hf.generation.tree``: node 0 is the root, ``parents[i] < i``, and a node's children
in index order are its siblings in draw order.

* ``greedy_accept`` (temperature 0): follow the child whose token equals the target's choice; the bonus token is
  the target's choice after the last accepted node.
* ``sample_accept`` (temperature > 0): recursive rejection sampling over siblings drawn without replacement
  (Jeon et al. 2024, "Recursive Speculative Decoding"). It is lossless, i.e. every emitted token is distributed
  exactly as the target's processed distribution, provided the tree was built as described in ``eagle3_hf.generation.tree``
  (each node's children drawn without replacement from ``draft_probs[node]``, all drawn children kept).

In both cases the new tokens of the cycle are ``tokens[path[1:]] + [bonus_token]`` and the acceptance length
tau is ``len(path)`` (accepted drafts + the bonus).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .tree import children_lists


__all__ = ["AcceptResult", "greedy_accept", "rrs_step", "sample_accept"]

ProbsSource = torch.Tensor | Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of one verification.

    Attributes:
        path: accepted node indices, root first (the root is always included).
        bonus_token: the target's token after the last node of ``path``.
    """

    path: list[int]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Number of accepted draft tokens (the root does not count)."""
        return len(self.path) - 1

    @property
    def tau(self) -> int:
        """Tokens emitted this cycle: accepted drafts + the bonus token."""
        return len(self.path)


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor) -> None:
    if tokens.dim() != 1 or parents.shape != tokens.shape:
        raise ValueError(
            f"expected tokens [T] and parents [T], got {tuple(tokens.shape)} and {tuple(parents.shape)}"
        )


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_next: torch.Tensor) -> AcceptResult:
    """Greedy verification.

    Args:
        tokens: ``[T]`` tree tokens (target vocabulary).
        parents: ``[T]`` parent indices.
        target_next: ``[T]`` the target's chosen token after each node (argmax of its processed logits).

    Walks from the root to the child whose token equals ``target_next[current]`` until there is none.
    """
    _check_tree(tokens, parents)
    if target_next.shape != tokens.shape:
        raise ValueError(f"`target_next` must have shape {tuple(tokens.shape)}, got {tuple(target_next.shape)}")
    children = children_lists(parents)
    token_list = tokens.tolist()
    next_list = target_next.tolist()
    path = [0]
    node = 0
    while True:
        wanted = next_list[node]
        match = next((child for child in children[node] if token_list[child] == wanted), None)
        if match is None:
            return AcceptResult(path=path, bonus_token=int(wanted))
        path.append(match)
        node = match


def _normalize(dist: torch.Tensor) -> torch.Tensor | None:
    """``dist / dist.sum()``, or None when the sum is not a positive finite number."""
    total = dist.sum()
    if not bool(torch.isfinite(total) & (total > 0)):
        return None
    return dist / total


def _rrs_stages(p: torch.Tensor, q: torch.Tensor, drafted: Sequence[int]) -> Iterator[tuple[float, torch.Tensor]]:
    """Yields, for each drafted token in turn, ``(accept_probability, p_i)`` assuming all earlier ones were
    rejected; then yields ``(0.0, residual)`` once, the distribution left after rejecting all of them.

    ``p_i`` and ``q_i`` are the residual target and draft distributions at step ``i``; ``drafted[i]`` is accepted
    with probability ``min(1, p_i[x] / q_i[x])``. A draft token with ``q_i[x] == 0`` (impossible in exact
    arithmetic, since it was drawn from ``q_i``) counts as accepted iff ``p_i[x] > 0``.

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
    for x in drafted:
        p_x, q_x = float(p_i[x]), float(q_i[x])
        if q_x > 0:
            accept = min(1.0, p_x / q_x)
        else:
            accept = 1.0 if p_x > 0 else 0.0
        yield accept, p_i
        rejected.append(x)
        residual = _normalize((p_i - q_i).clamp(min=0))
        if residual is None:
            fallback = p_orig.clone()
            fallback[rejected] = 0
            residual = _normalize(fallback)
            if residual is None:
                residual = p_orig
        p_i = residual
        q_next = q_i.clone()
        q_next[x] = 0
        q_next_normalized = _normalize(q_next)
        q_i = q_next if q_next_normalized is None else q_next_normalized
    yield 0.0, p_i


def rrs_step(
    p: torch.Tensor, q: torch.Tensor, drafted: Sequence[int], uniforms: torch.Tensor | Sequence[float]
) -> tuple[int | None, torch.Tensor]:
    """One node of recursive rejection sampling over siblings drawn without replacement.

    Args:
        p: ``[V]`` target distribution after the node.
        q: ``[V]`` draft distribution the siblings were drawn from (zeros outside the draft vocabulary).
        drafted: sibling tokens in draw order (distinct).
        uniforms: one U[0, 1) number per sibling.

    Returns:
        ``(index, residual_p)``: ``index`` is the position in ``drafted`` of the accepted sibling, or None if all
        were rejected; ``residual_p`` is the residual target distribution at that point (``p`` itself if the
        first sibling is accepted), from which the bonus token is drawn when nothing was accepted.

    Sibling ``i`` is accepted iff ``uniforms[i] < min(1, p_i[x] / q_i[x])``, where after each rejection
    ``p <- normalize(max(p - q, 0))`` and ``q <- normalize(q with q[x] = 0)``. See ``_rrs_stages`` for the
    degenerate cases.
    """
    if p.dim() != 1 or q.shape != p.shape:
        raise ValueError(f"expected p [V] and q [V], got {tuple(p.shape)} and {tuple(q.shape)}")
    if len(uniforms) != len(drafted):
        raise ValueError(f"need one uniform per drafted token: {len(drafted)} drafted, got {len(uniforms)} uniforms")
    vocab_size = p.shape[0]
    if any(not 0 <= int(x) < vocab_size for x in drafted):
        raise ValueError(f"`drafted` tokens must be in [0, {vocab_size}), got {list(drafted)}")
    if len(set(int(x) for x in drafted)) != len(drafted):
        raise ValueError(f"`drafted` tokens must be distinct (drawn without replacement), got {list(drafted)}")
    uniform_list = uniforms.tolist() if isinstance(uniforms, torch.Tensor) else list(uniforms)
    stages = _rrs_stages(p, q, [int(x) for x in drafted])
    for index, (accept, p_i) in enumerate(stages):
        if index == len(drafted):
            return None, p_i
        if uniform_list[index] < accept:
            return index, p_i
    raise RuntimeError("unreachable: _rrs_stages always yields len(drafted) + 1 stages")


def _as_row_fn(source: ProbsSource, name: str) -> Callable[[int], torch.Tensor]:
    if isinstance(source, torch.Tensor):
        if source.dim() != 2:
            raise ValueError(f"`{name}` as a tensor must be [T, V], got shape {tuple(source.shape)}")
        return lambda node: source[node]
    if callable(source):
        return source
    raise ValueError(f"`{name}` must be a [T, V] tensor or a callable node -> [V], got {type(source).__name__}")


def _sample(dist: torch.Tensor, generator: torch.Generator | None) -> int:
    dist = dist.to(torch.promote_types(dist.dtype, torch.float32)).clamp(min=0)
    if _normalize(dist) is None:
        raise ValueError(f"cannot sample the bonus token: the target distribution has no positive mass ({dist})")
    return int(torch.multinomial(dist, 1, generator=generator))


def sample_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs_fn: ProbsSource,
    draft_probs: ProbsSource,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Verification by recursive rejection sampling without replacement.

    Args:
        tokens: ``[T]`` tree tokens (target vocabulary).
        parents: ``[T]`` parent indices; node ``i``'s children in index order must be draws without replacement,
            in draw order, from ``draft_probs[i]``.
        target_probs_fn: ``node -> [V]`` the target's processed distribution after ``node`` (called only for the
            nodes visited), or a ``[T, V]`` tensor.
        draft_probs: ``[T, V]`` tensor, or ``node -> [V]``: the draft distribution over the target vocabulary
            (zeros outside the draft vocabulary) from which ``node``'s children were drawn. Only read for visited
            nodes that have children.
        generator: RNG on the distributions' device; a fixed seed reproduces the result.

    At each visited node the children are tried in draw order with ``rrs_step``; the walk moves to the accepted
    child, or stops and draws the bonus token from the residual (from ``p`` itself at a leaf).
    """
    _check_tree(tokens, parents)
    target_row = _as_row_fn(target_probs_fn, "target_probs_fn")
    draft_row = _as_row_fn(draft_probs, "draft_probs")
    children = children_lists(parents)
    token_list = tokens.tolist()
    path = [0]
    node = 0
    while True:
        p = target_row(node)
        kids = children[node]
        if not kids:
            return AcceptResult(path=path, bonus_token=_sample(p, generator))
        uniforms = torch.rand(len(kids), generator=generator, device=p.device)
        accepted, residual = rrs_step(p, draft_row(node), [token_list[c] for c in kids], uniforms)
        if accepted is None:
            return AcceptResult(path=path, bonus_token=_sample(residual, generator))
        node = kids[accepted]
        path.append(node)

"""The training objectives of a drafting step: how far the draft's distribution ``q`` is from the target's ``p``.

``p`` is the soft label the trainer already builds (`eagle3_hf.training.ttt`): the target's top-k logits (or its full
logits) softmaxed over the ids the draft vocabulary holds, so it sums to 1 over the draft vocabulary and is 0 outside
the target's top k; ``q = softmax(z)`` over the draft vocabulary. Per supervised position:

* ``forward_kl`` (default): ``-sum_x p(x) log q(x)``, the soft-label cross entropy, i.e. ``KL(p || q)`` up to the
  label's entropy, which does not depend on the draft (EAGLE-3's loss).
* ``tv``: the total variation ``1/2 sum_x |p(x) - q(x)|``, which equals ``1 - alpha`` with
  ``alpha = sum_x min(p(x), q(x))``, the probability that speculative sampling accepts a drafted token.
* ``lk``: ``-log alpha``, the negative log acceptance of the LK losses (arXiv 2602.23881). Its adaptive mix of KL and
  TV is not implemented here. ``alpha`` is summed over the label's support (the target's top k as the head loss sees
  it, renormalised over the draft vocabulary), so it is the acceptance against that truncated target.

Two forms of each: `row_losses` writes it with autograd ops (the reference, and the path of a head the fused head
loss cannot stand in for); `support_terms` gives what `eagle3_hf.training.head_loss` needs to fuse it with the head:
the loss and its gradient with respect to the logits in closed form, ``grad_z = q * scale - scatter(spread)``.
For the acceptance losses, with ``u(x) = q(x) [q(x) < p(x)]`` on the support: ``d alpha / d z = u - q sum(u)``.
"""

from __future__ import annotations

import torch

from eagle3_hf.training.arguments import LOSSES, check_loss

__all__ = ["LOSSES", "check_loss", "row_losses", "support_terms"]


def _log_acceptance(log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``log sum_x min(p, q)`` per row, in log space so that a far-off draft (q underflowing) stays finite."""
    return torch.logsumexp(torch.minimum(p.log(), log_q), dim=-1)


def row_losses(loss: str, log_q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-row loss ``[M]`` written with autograd ops.

    Args:
        loss: one of `LOSSES`.
        log_q: ``[M, k]`` the draft's log-probabilities at the label's columns (or ``[M, Vd]``, every draft id).
        p: ``[M, k]`` (or ``[M, Vd]``) the label's probabilities there, each row summing to 1; for ``tv`` and ``lk``
            a column may repeat only where its ``p`` is 0 (the placeholders of `ttt`'s sparse labels).
    """
    if check_loss(loss) == "forward_kl":
        return -(p * log_q).sum(-1)
    log_alpha = _log_acceptance(log_q, p)
    return 1 - log_alpha.exp() if loss == "tv" else -log_alpha


def support_terms(
    loss: str, picked: torch.Tensor, lse: torch.Tensor, p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row_loss [c], scale [c], spread [c, k])`` of a chunk of rows, for the fused head loss.

    `picked` ``[c, k]`` are the logits at the label's columns (``[c, Vd]``: all of them), `lse` ``[c]`` the logits'
    logsumexp over the draft vocabulary and `p` as in `row_losses`; all in the loss's (fp32 or wider) dtype. The
    gradient of ``row_loss`` with respect to the row's logits is ``softmax(z) * scale - scatter(columns, spread)``.
    """
    if check_loss(loss) == "forward_kl":
        mass = p.sum(-1)  # 1 for a softmax label; the cross entropy is linear in p
        return mass * lse - (p * picked).sum(-1), mass, p
    log_q = picked - lse[:, None]  # [c, k]
    log_alpha = _log_acceptance(log_q, p)  # [c]
    below = log_q < p.log()  # where min(p, q) is q: alpha moves with the draft there only
    if loss == "tv":  # 1 - alpha: gradient -(u - q sum u)
        spread = torch.where(below, log_q.exp(), 0.0)
        return 1 - log_alpha.exp(), spread.sum(-1), spread
    spread = torch.where(below, (log_q - log_alpha[:, None]).exp(), 0.0)  # -log alpha: gradient -(u - q sum u) / alpha
    return -log_alpha, spread.sum(-1), spread

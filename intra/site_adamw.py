"""AdamW for a site whose steps are averaged with other sites' steps.

In the DiLoCo family every site runs its own AdamW on its own batch, and the
sites' steps are averaged. AdamW divides each step by the root of its second
moment, the running mean of the squared gradient: the square of the signal plus
the gradient's noise. A site's batch is a share of the batch the averaged step
stands for, so its gradient carries 1/share times that batch's noise, its second
moment is larger than sync's, and once noise dominates the averaged step is
smaller than sync's would be. On the four-site convergence protocol that is
most of DiLoCo's gap to sync: averaging the sites' AdamW steps after every
single step ends +1.45% above sync; with this correction, at or below it (see
docs/benchmarks.md, "Convergence").

:class:`SiteAdamW` is AdamW that also estimates its gradient's noise, from the
micro-batches the gradient was accumulated over (two at least: the training
loop calls :meth:`SiteAdamW.record_micro_batch` after each one's backward pass),
keeps a running mean of it beside the second moment, and takes out the part of
it the averaged step does not carry, ``1 - batch_share`` of it, never going
below ``batch_share`` of the second moment (what pure noise would leave). The
DiLoCo-family strategies set :attr:`SiteAdamW.batch_share` (the site's tokens
over every participant's); left at 1, or fed no micro-batches, it is AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class SiteAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose second moment
    is corrected to the batch the sites' averaged step stands for (see the module).

    ``batch_share``: this site's share of that batch, in (0, 1]; 1 (the default,
    and what a lone site or sync gets) leaves AdamW as it is.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        batch_share: float = 1.0,
    ) -> None:
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"SiteAdamW: betas must be in [0, 1), got {betas!r}")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.batch_share = batch_share
        # Within one step: each parameter's gradient as last recorded, and the sum
        # of the squares of what each micro-batch added to it.
        self._recorded: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._micro_batches = 0

    @property
    def batch_share(self) -> float:
        return self._batch_share

    @batch_share.setter
    def batch_share(self, share: float) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"SiteAdamW.batch_share must be in (0, 1], got {share!r}")
        self._batch_share = float(share)

    @torch.no_grad()
    def record_micro_batch(self) -> None:
        """Call after each micro-batch's backward pass (two or more a step, each
        adding its gradient into ``.grad``, scaled or not): what it added is one
        sample of the gradient's noise. A step's records start over after
        :meth:`zero_grad` or :meth:`step`."""
        if self._micro_batches == 0 and self._recorded:
            # A new step: what each parameter held before it is nothing (one that
            # first gets a gradient in a later micro-batch added nothing before).
            torch._foreach_zero_([t for pair in self._recorded.values() for t in pair])
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if p not in self._recorded:
                self._recorded[p] = (torch.zeros_like(p.grad), torch.zeros_like(p.grad))
        if params:
            grads = [p.grad for p in params]
            lasts = [self._recorded[p][0] for p in params]
            added = torch._foreach_sub(grads, lasts)
            torch._foreach_addcmul_([self._recorded[p][1] for p in params], added, added)
            for last, grad in zip(lasts, grads, strict=True):
                last.copy_(grad)  # DTensor has no multi-tensor copy
        self._micro_batches += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A step skipped (a scaler that found inf, a loop that skips a spike) must
        # not lend its records to the next one.
        self._micro_batches = 0
        super().zero_grad(set_to_none=set_to_none)

    def _noise(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each parameter's estimated noise (variance, per element) of the gradient
        the step takes, written over its buffer of squares; empty where fewer than
        two micro-batches were recorded.

        With k micro-batches adding c_j to G = sum c_j, the sample variance of
        k c_j is (k sum c_j^2 - G^2) / (k - 1) over k, which is also the variance
        of G (scaled or not, the same form). The step may take a gradient scaled
        after the last record (clipping, or a mean taken of the sum): the noise
        scales by the square of that ratio, taken per tensor on this rank's part
        of it (a shard or a replica: the same ratio wherever the tensor is whole,
        and no collective). What is not finite (a gradient that overflowed) adds
        nothing."""
        count, self._micro_batches = self._micro_batches, 0
        if count < 2:
            return {}
        k = float(count)
        pairs = [(p, pair) for p, pair in self._recorded.items() if p.grad is not None]
        if not pairs:
            return {}
        lasts = [last for _, (last, _) in pairs]
        values = [squares for _, (_, squares) in pairs]
        # (k sum c_j^2 - G^2) / (k - 1), over the squares' own buffers.
        torch._foreach_mul_(values, k)
        torch._foreach_sub_(values, torch._foreach_mul(lasts, lasts))
        torch._foreach_div_(values, k - 1)
        torch._foreach_clamp_min_(values, 0.0)
        taken = torch._foreach_norm([_local(p.grad) for p, _ in pairs])
        recorded = torch._foreach_norm([_local(last) for last in lasts])
        for value, now, then in zip(values, taken, recorded, strict=True):
            ratio = (now / then.clamp(min=1e-30)).square()
            _local(value).mul_(ratio).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        noise = {p: value for (p, _), value in zip(pairs, values, strict=True)}
        return noise

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        noise = self._noise()
        share = self._batch_share
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p].update(
                        step=torch.zeros((), dtype=torch.float32),
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                        # Always, so a checkpoint's layout does not depend on the
                        # share at the time (a resumed run loads into it).
                        exp_noise=torch.zeros_like(p),
                    )
            # Parameters that took different numbers of steps (one without a
            # gradient on some) each get their own bias correction.
            by_step: dict[float, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["step"] += 1
                    by_step.setdefault(float(self.state[p]["step"]), []).append(p)
            for count, params in by_step.items():
                self._group_step(group, params, count, noise, share)
        return loss

    def _group_step(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        count: float,
        noise: dict[torch.Tensor, torch.Tensor],
        share: float,
    ) -> None:
        """One AdamW step of parameters of a group at the same step ``count``,
        multi-tensor (a few kernels for them all, as torch's own AdamW does on a
        GPU), with one tensor per parameter of scratch, as torch's."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        n = [s["exp_noise"] for s in states]
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        fed = [
            (s["exp_noise"], noise[p]) for p, s in zip(params, states, strict=True) if p in noise
        ]
        if fed:
            kept = [pair[0] for pair in fed]
            torch._foreach_mul_(kept, beta2)
            torch._foreach_add_(kept, [pair[1] for pair in fed], alpha=1 - beta2)
        if share < 1.0:
            # max(v - (1 - share) n, share v) = v - (1 - share) min(n, v).
            second = torch._foreach_minimum(n, v)
            torch._foreach_mul_(second, -(1 - share))
            torch._foreach_add_(second, v)
        else:
            second = torch._foreach_mul(v, 1.0)
        torch._foreach_div_(second, 1 - beta2**count)
        torch._foreach_sqrt_(second)
        torch._foreach_add_(second, group["eps"])
        torch._foreach_addcdiv_(params, m, second, value=-lr / (1 - beta1**count))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP, tensor parallel; in place, a view of
    it), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor

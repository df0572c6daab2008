"""The model's own next-token loss and accuracy over the validation tokens, in float64 (SPEC section 3: ``val_loss``,
``val_accuracy``).

Logits are formed from the features the validation pass already has (the output layer's input): ``h @ W^T + b``, then
the model's own logit transform, so the loss is the model's: Cohere's ``logit_scale`` (multiply), Granite's and
MiniCPM3's ``logits_scaling`` (divide), Gemma2/3's ``final_logit_softcapping`` (``cap * tanh(logits / cap)``). The
full-vocabulary log-sum-exp runs over a bounded number of (token, class) cells at a time.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from ncanalyze.analyzer.accumulate import Sums
from ncanalyze.analyzer.screen import Leaders
from ncanalyze.store.sources.anatomy import LogitTransform

log = logging.getLogger(__name__)


CELLS = 1 << 22  # (token, class) cells of float64 logits formed at a time (32 MB; see NextTokenLoss)
# how far the model's own logits may be from ours, relative to the largest logit, for each model dtype
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class NextTokenLoss(Sums):
    """Running sums of the full-vocabulary cross-entropy (float64) and of argmax hits over validation tokens. A float64
    head (``ncanalyze.analyzer.accumulate.float64_head``) is used as it is, not copied. Tokens are taken ``budget``
    (token, class) cells of logits at a time (32 MB of float64 by default: malloc reuses the block, where a 128 MB
    one was mapped afresh each chunk and its page faults cost a quarter of the pass on a 2-core CPU).

    ``state`` (``loss_sum`` float64, ``correct`` and ``tokens`` int64, 0-d tensors) may be given to continue from
    earlier sums (updated in place); it is part of the resume state, so a resumed pass ends bit-identical."""

    NAMES = ("loss_sum", "correct", "tokens")

    def __init__(self, classifier: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform,
                 state: dict[str, torch.Tensor] | None = None, budget: int = CELLS):
        self.w = classifier.to(torch.float64)
        self.b = None if bias is None else bias.to(self.w.device, torch.float64)
        self.transform = transform
        self.state = state if state is not None else self.zeros(self.w.device)
        self.chunk = max(1, budget // self.w.shape[0])

    @staticmethod
    def zeros(device) -> dict[str, torch.Tensor]:
        return {"loss_sum": torch.zeros((), dtype=torch.float64, device=device),
                "correct": torch.zeros((), dtype=torch.int64, device=device),
                "tokens": torch.zeros((), dtype=torch.int64, device=device)}

    def update(self, h: torch.Tensor, y: torch.Tensor,
               also: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Leaders], None] | None = None) -> None:
        """Add a batch.

        Parameters
        ----------
        h, y : the features (n x d) and labels (n).
        also : where given, ``also(h, y, logits, leaders)`` is called with each chunk (float64, int64), its head
            logits before the transform and each row's best of them (:class:`Leaders`), so that NC4's decisions share
            them (the head's float64 logits formed once).
        """
        h, y = h.to(self.w.device, torch.float64), y.to(self.w.device, torch.int64)
        same = self.transform.describe() == "none"  # the transformed logits' argmax is the head's
        for s in range(0, len(y), self.chunk):
            hc, yc = h[s:s + self.chunk], y[s:s + self.chunk]
            logits = hc @ self.w.T
            if self.b is not None:
                logits += self.b
            # one topk: the argmax here and NC4's decisions over every kept set (none needed by a transformed argmax
            # that no NC4 decision shares)
            leaders = Leaders.of(logits) if same or also is not None else None
            if also is not None:
                also(hc, yc, logits, leaders)
            logits = self.transform(logits)
            picked = logits.gather(1, yc[:, None]).squeeze(1)
            arg = leaders.decide(lambda rows: logits[rows].argmax(1)) if same else logits.argmax(1)
            peak = logits.gather(1, arg[:, None])
            # log-sum-exp in place (the chunk's logits are not read again): peak + log sum exp(logits - peak)
            nll = peak.squeeze(1) + logits.sub_(peak).exp_().sum(1).log_() - picked
            self.state["loss_sum"] += nll.sum()
            self.state["correct"] += (arg == yc).sum()
            self.state["tokens"] += len(yc)

    def sums(self) -> dict[str, torch.Tensor]:
        """The running sums (merged across parts of the validation stream)."""
        return self.state


@torch.inference_mode()
def matches_model(model, ids: torch.Tensor, h: torch.Tensor, classifier: torch.Tensor, bias: torch.Tensor | None,
                  transform: LogitTransform, dtype: torch.dtype | None = None) -> bool:
    """Whether ``transform`` of the head applied to features ``h`` (the first block's, L-1 x d) gives the model's own
    logits for that block: a model whose output differs in a way :meth:`LogitTransform.of` does not know is caught
    rather than measured wrong. ``dtype`` is the model head's own (default ``classifier``'s), for the tolerance; a
    float64 ``classifier`` is read as it is."""
    own = model(input_ids=ids[:1]).logits[0, :-1].to(torch.float64)
    ours = h.to(torch.float64) @ classifier.to(torch.float64).T
    if bias is not None:
        ours += bias.to(torch.float64)
    ours = transform(ours)
    scale = float(own.abs().max()) or 1.0
    return float((own - ours).abs().max()) <= TOLERANCE.get(dtype or classifier.dtype, 1e-2) * scale


def loss_attrs(state: dict[str, torch.Tensor], transform: LogitTransform | None) -> dict:
    """``val_loss`` (mean cross-entropy in nats), ``val_accuracy`` (None without validation tokens) and the
    ``logit_transform`` they were measured with; all None where the transform did not match the model's own logits
    (``transform`` None)."""
    n = int(state["tokens"])
    if transform is None:
        return {"val_loss": None, "val_accuracy": None, "logit_transform": "unknown (did not match the model's logits)"}
    return {"val_loss": _finite(float(state["loss_sum"]) / n) if n else None,
            "val_accuracy": int(state["correct"]) / n if n else None, "logit_transform": transform.describe()}


def _finite(x: float) -> float | None:
    """JSON-safe (the store's attributes are strict JSON): nan/inf as None."""
    return x if math.isfinite(x) else None

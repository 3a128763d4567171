"""The training objective: next-token cross-entropy in fp32, plus the auxiliary terms that
model layers report (a mixture-of-experts balance loss, a router z-loss).

One object serves the plain step, the pipeline's last stage and evaluation, so the three
compute the same thing. A layer reports a term with ``report_aux(self, name, value)``
during its forward (``value`` already weighted by its coefficient); the next call of the
loss on that model drains the terms, adds them to the language-model loss and keeps their
values for logging. The loss knows nothing of parallelism: whoever parallelizes the model
passes a ``context`` (tensor parallelism's loss-parallel cross-entropy) that wraps the
loss and its backward, and the chunked head loss to use (``head_loss``).

With ``loss_chunk_size > 0`` the model hands over its final hidden states instead of logits
(``Transformer.hidden_out``) and the loss applies the head chunk by chunk through the head
module's call (models/chunked_loss.py on one device; under tensor parallelism
parallel/tensor/vocab_loss.py), so the full fp32 logits never exist.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.chunked_loss import chunked_cross_entropy

_AUX = "_meshforge_aux_losses"


def report_aux(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Called by a layer in its forward: add ``value`` to this forward's objective under ``name``."""
    terms = module.__dict__.setdefault(_AUX, {})
    terms[name] = terms[name] + value if name in terms else value


def drain_aux(model: nn.Module | None) -> dict[str, torch.Tensor]:
    """Every term the model's layers reported since the last drain, summed per name."""
    out: dict[str, torch.Tensor] = {}
    if model is None:
        return out
    for m in model.modules():
        terms = m.__dict__.pop(_AUX, None)
        for name, v in (terms or {}).items():
            out[name] = out[name] + v if name in out else v
    return out


class LanguageModelLoss:
    """Mean (training) or summed (evaluation) next-token cross-entropy over logits
    ``(batch, seq, vocab)`` and targets ``(batch, seq)``, computed in fp32.

    ``loss_chunk_size > 0``: the model's output is its final hidden states ``(batch, seq, hidden)``
    (the model must have ``hidden_out`` set) and the head runs here, ``loss_chunk_size`` tokens at a
    time, its matmul in ``compute_dtype`` (None: the hidden states' dtype), through ``head_loss``
    (``chunked_cross_entropy``'s signature: the one-device one unless the parallelizer passes another)."""

    def __init__(
        self,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        loss_chunk_size: int = 0,
        compute_dtype: torch.dtype | None = None,
        head_loss: Callable[..., torch.Tensor] = chunked_cross_entropy,
    ):
        self.context, self.head_loss = context, head_loss
        self.loss_chunk_size, self.compute_dtype = loss_chunk_size, compute_dtype
        self.fused_chunks = False  # each chunk's math compiled (parallel/compile.py: compile_loss sets it)
        self.terms: dict[str, torch.Tensor] = {}  # the last training call's parts, detached
        self.step_terms: dict[str, torch.Tensor] = {}  # the last step's parts, mean over its calls (end_step)
        self._sums: dict[str, torch.Tensor] = {}
        self._calls = 0
        self._elsewhere: dict[str, torch.Tensor] = {}  # see add_step_terms

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """Training: the mean token loss plus the auxiliary terms ``model``'s layers reported."""
        lm = self._cross_entropy(logits, targets, model, "mean")
        # under tensor parallelism ``lm`` is a replicated DTensor (loss_parallel) and the terms are
        # plain: they are added to its local value, else their gradients would come back as DTensors
        lm_value = lm.to_local() if hasattr(lm, "to_local") else lm
        aux = drain_aux(model)
        self.terms = {"lm_loss": lm_value.detach(), **{k: v.detach() for k, v in aux.items()}}
        for k, v in self.terms.items():  # device adds only: read on logged steps
            self._sums[k] = self._sums[k] + v if k in self._sums else v
        self._calls += 1
        return lm_value + sum(aux.values()) if aux else lm

    def end_step(self) -> None:
        """After an optimizer step: the step's parts become ``step_terms`` (the mean over its
        micro-batches on this rank); the next step starts from zero."""
        self.step_terms = {k: v / self._calls for k, v in self._sums.items()}
        for k, v in self._elsewhere.items():
            self.step_terms[k] = self.step_terms[k] + v if k in self.step_terms else v
        self._sums, self._calls, self._elsewhere = {}, 0, {}

    def discard(self) -> None:
        """Forget this step's calls so far (a pipeline schedule's shape inference on stand-in
        tensors, parallel/pipeline/stage_aux.py)."""
        self._sums, self._calls, self._elsewhere = {}, 0, {}

    def add_step_terms(self, terms: dict[str, torch.Tensor]) -> None:
        """This step's means per micro-batch of terms whose gradient entered elsewhere (the MoE
        layers of pipeline stages before the last, parallel/pipeline/stage_aux.py): logged with the
        step's parts by ``end_step``."""
        for k, v in terms.items():
            self._elsewhere[k] = self._elsewhere[k] + v if k in self._elsewhere else v

    def token_sum(self, logits: torch.Tensor, targets: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """Evaluation: the summed token loss of the language model alone (``model``'s
        reported auxiliary terms are drained and dropped)."""
        drain_aux(model)
        return self._cross_entropy(logits, targets, model, "sum")

    def _cross_entropy(
        self, out: torch.Tensor, targets: torch.Tensor, model: nn.Module | None, red: str
    ) -> torch.Tensor:
        """The plain fp32 cross-entropy over logits, or the chunked one over hidden states
        (``model``'s head applied here). A model whose output does not match is refused."""
        hidden_out = getattr(model, "hidden_out", False)
        if not self.loss_chunk_size:
            if hidden_out:
                raise ValueError("the model returns hidden states (hidden_out) but the loss has no loss_chunk_size")
            return F.cross_entropy(out.float().flatten(0, 1), targets.flatten(), reduction=red)
        head = getattr(model, "output", None)
        if not hidden_out or not getattr(head, "takes_loss_fn", False):
            raise ValueError(
                "the chunked loss (train.loss_chunk_size > 0) needs the model passed to the loss, with hidden_out "
                "set and its plain head (an fp8 head cannot be chunked: keep 'output' in train.fp8_exclude)"
            )
        fn = functools.partial(
            self.head_loss,
            targets=targets,
            chunk=self.loss_chunk_size,
            reduction=red,
            compute_dtype=self.compute_dtype,
            fused=self.fused_chunks,
        )
        return head(out, loss_fn=fn)

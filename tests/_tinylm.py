"""The GPT-2-shaped model of benchmarks/ddp_step.py (tied embedding, causal attention through
F.scaled_dot_product_attention, GELU MLP) with a cross-entropy loss, and one batch for it, of
any size: what ddpc.plan's activation count is checked against, on the CPU (tests/test_plan.py,
small) and on a GPU (tests/test_gpu_wrap_model.py, GPT-2's size)."""
import contextlib
import os
import sys
from typing import Any, Callable, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from ddp_step import GPT  # noqa: E402


class TinyLM(GPT):
    """checkpoint: None, or "reentrant" / "non_reentrant": each block under
    torch.utils.checkpoint with use_reentrant True / False (Hugging Face's
    gradient_checkpointing_enable() is the first, by default)."""

    checkpoint = None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.checkpoint is None:
            logits = super().forward(ids)
        else:
            from torch.utils.checkpoint import checkpoint
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=self.checkpoint == "reentrant")
            logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def make(vocab: int = 1000, width: int = 128, heads: int = 4, layers: int = 3, batch: int = 4,
         seq: int = 256, checkpoint: Any = None) -> Tuple[Callable[[], TinyLM], Callable[[], Any]]:
    """(build, batch): the model's factory and one batch's, as ddpc.plan takes them."""
    def build() -> TinyLM:
        model = TinyLM(layers, width, heads, vocab, seq)
        model.checkpoint = checkpoint
        return model

    def one_batch() -> dict:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"ids": ids, "labels": ids}
    return build, one_batch


build, batch = make()  # (for `python -m ddpc.plan --model _tinylm:build --batch _tinylm:batch`)


_VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
          "ExpandBackward0", "AliasBackward0"}


def weight_copy(t: torch.Tensor) -> bool:
    """Whether t is autocast's cast of a parameter (or a view of such a cast, or a cast of a
    view of one): plan counts those as autocast's weight copies. Its grad_fn leads, through
    views and at least one cast alone, to a parameter."""
    fn, cast = t.grad_fn, False
    while fn is not None:
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return cast
        if name == "ToCopyBackward0":
            cast = True
        elif name not in _VIEWS:
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


def saved_bytes(model: torch.nn.Module, inputs: dict,
                autocast: Any = None) -> Tuple[int, int, Any]:
    """What autograd saves in a real forward (not the parameters, nor autocast's copies of them),
    plus the loss, as ddpc.plan counts them on the meta device: (bytes, the largest, the loss).
    With autocast (a dtype), the forward runs under CUDA autocast to it."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    got, copies = {}, set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if weight_copy(t):
            copies.add(st._cdata)
        elif st._cdata not in weights:
            got[st._cdata] = st.nbytes()
        return t
    cast = contextlib.nullcontext() if autocast is None else torch.autocast("cuda", autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        loss = model(**inputs)
    got[loss.untyped_storage()._cdata] = loss.untyped_storage().nbytes()
    for k in copies:
        got.pop(k, None)
    return sum(got.values()), max(got.values()), loss

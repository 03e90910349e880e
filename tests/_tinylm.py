"""A GPT-like language model (tied embedding, causal attention through
F.scaled_dot_product_attention, GELU MLP, cross-entropy loss) and one batch for it, of any size:
what ddpc.plan's activation count is checked against, on the CPU (tests/test_plan.py, small) and
on a GPU (tests/test_gpu_wrap_model.py, GPT-2's size)."""
from typing import Any, Callable, Tuple

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.zeros(seq, width))
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.emb.weight.t()
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))


def make(vocab: int = 1000, width: int = 128, heads: int = 4, layers: int = 3, batch: int = 4,
         seq: int = 256) -> Tuple[Callable[[], TinyLM], Callable[[], Any]]:
    """(build, batch): the model's factory and one batch's, as ddpc.plan takes them."""
    def build() -> TinyLM:
        return TinyLM(vocab, width, heads, layers, seq)

    def one_batch() -> dict:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"ids": ids, "labels": ids}
    return build, one_batch


build, batch = make()  # (for `python -m ddpc.plan --model _tinylm:build --batch _tinylm:batch`)


def saved_bytes(model: torch.nn.Module, inputs: dict) -> Tuple[int, int, Any]:
    """What autograd saves in a real forward (not the parameters), plus the loss, as ddpc.plan
    counts them on the meta device: (bytes, the largest, the loss)."""
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    got = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in weights:
            got[st._cdata] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**inputs)
    got[loss.untyped_storage()._cdata] = loss.untyped_storage().nbytes()
    return sum(got.values()), max(got.values()), loss

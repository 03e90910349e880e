"""The embedded default job: data-parallel training of a small classifier on the handwritten
digits that scikit-learn ships inside its package (no download), with ddpc.

    python -m ddpc.launch --nproc-per-node 2 examples/finetune.py

Uses the GPUs and NCCL where they exist, the CPU backend elsewhere, unchanged. Rank 0 shows a
progress bar (loss, samples/s), every rank evaluates its exact share of the held-out split
(no padded duplicates), the counts are summed with all_reduce, and rank 0 alone writes the
checkpoint.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ddpc


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """The 1797 8x8 digits, scaled to [0, 1], split once (same split on every rank)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images.reshape(len(data.images), -1) / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    as_ds = lambda idx: torch.utils.data.TensorDataset(torch.from_numpy(x[idx]),  # noqa: E731
                                                       torch.from_numpy(y[idx]))
    return as_ds(train), as_ds(test)


class DigitsNet(nn.Module):
    """A small MLP with a 'backbone' and a classification 'head', as in a fine-tuning setup."""

    def __init__(self, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.LayerNorm(hidden),
                                      nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def evaluate(model: nn.Module, dataset, batch_size: int, device: torch.device) -> Dict[str, float]:
    """Exact distributed accuracy: each sample is seen by exactly one rank (pad=False)."""
    sampler = ddpc.DistributedSampler(dataset, shuffle=False, pad=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64)  # correct, count, summed loss
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            stats[0] += (logits.argmax(1) == y).sum().item()
            stats[1] += len(y)
            stats[2] += F.cross_entropy(logits, y, reduction="sum").item()
    model.train()
    stats = stats.to(device) if ddpc.get_backend() == "nccl" else stats
    ddpc.all_reduce(stats, op="sum")
    stats = stats.cpu()
    return {"accuracy": float(stats[0] / stats[1]), "loss": float(stats[2] / stats[1]),
            "samples": int(stats[1])}


def train(epochs: int = 30, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
          out: Optional[str] = "runs/finetune", max_steps: int = 0, progress: bool = True,
          grad_dtype: Optional[str] = None) -> Dict[str, Any]:
    """Trains with every rank of the current ddpc process group; returns the final metrics.
    The process group must be initialised (ddpc.init_process_group, done by main())."""
    torch.manual_seed(seed)
    device = ddpc.device()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    train_ds, test_ds = load_digits_split(seed)
    model = DigitsNet().to(device)
    model = ddpc.wrap_model(model, grad_dtype=getattr(torch, grad_dtype) if grad_dtype else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sampler = ddpc.DistributedSampler(train_ds, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=batch_size, sampler=sampler,
                                         drop_last=False)
    steps_per_epoch = len(loader)
    total = steps_per_epoch * epochs if not max_steps else min(max_steps, steps_per_epoch * epochs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
    bar = None
    if rank == 0 and progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=f"train ({world} ranks, {device.type})", unit="step",
                   mininterval=0.5)
    step, t0, seen = 0, time.perf_counter(), 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            seen += len(y) * world
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}",
                                samples_s=f"{seen / (time.perf_counter() - t0):.0f}")
            if step >= total:
                break
        if step >= total:
            break
    if bar is not None:
        bar.close()
    metrics = evaluate(model, test_ds, 256, device)
    metrics["train_seconds"] = time.perf_counter() - t0
    metrics["steps"] = step
    if rank == 0:
        print(f"held-out accuracy {metrics['accuracy'] * 100:.2f}% on {metrics['samples']} "
              f"samples (loss {metrics['loss']:.4f}), {step} steps on {world} ranks in "
              f"{metrics['train_seconds']:.1f} s", flush=True)
        if out:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, "checkpoint.pt")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "metrics": metrics}, path)
            print(f"checkpoint written to {path}", flush=True)
    return metrics


def _number(kind: type, least: float, what: str) -> Any:
    """An argparse type: a finite number of `kind` that is at least `least`."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not np.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def _writable_folder(path: str) -> str:
    """--out: '' (no checkpoint) or a folder that can be made and written, checked before
    training rather than after it."""
    if path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot make the checkpoint folder {path!r}: "
                                             f"{e.strerror}; pass another, or '' for none")
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"the checkpoint folder {path!r} is not writable; "
                                             f"pass another, or '' for none")
    return path


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=_number(int, 1, "a whole number of epochs >= 1"), default=30)
    p.add_argument("--batch-size", type=_number(int, 1, "a batch size >= 1"), default=32,
                   help="per rank")
    p.add_argument("--lr", type=_number(float, 1e-300, "a learning rate > 0"), default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=_writable_folder, default="runs/finetune",
                   help="checkpoint folder ('' for none)")
    p.add_argument("--max-steps", type=_number(int, 0, "a step count >= 0"), default=0,
                   help="stop early (0: all epochs)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--grad-dtype", choices=["bfloat16", "float16"], default=None,
                   help="reduce gradients in this dtype")
    p.add_argument("--min-accuracy", type=_number(float, 0.0, "an accuracy from 0 to 1"),
                   default=0.0,
                   help="exit non-zero when the held-out accuracy is below this")
    args = p.parse_args(argv)
    ddpc.init_process_group()
    try:
        metrics = train(args.epochs, args.batch_size, args.lr, args.seed, args.out or None,
                        args.max_steps, not args.no_progress, args.grad_dtype)
    finally:
        ddpc.destroy_process_group()
    if metrics["accuracy"] < args.min_accuracy:
        raise SystemExit(f"held-out accuracy {metrics['accuracy']:.4f} is below "
                         f"--min-accuracy {args.min_accuracy}")
    return metrics


if __name__ == "__main__":
    main()

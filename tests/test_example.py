"""The embedded default job (examples/finetune.py) in a reduced form, through the real launcher."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("torch")
pytest.importorskip("sklearn")


def test_finetune_example_two_ranks(tmp_path):
    out = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run(
        [sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "finetune.py"), "--epochs", "8", "--no-progress",
         "--out", str(out), "--min-accuracy", "0.9"],
        capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    line = [ln for ln in r.stdout.splitlines() if "held-out accuracy" in ln]
    assert len(line) == 1 and line[0].startswith("[rank0]"), r.stdout
    # Evaluation is exact: every one of the 449 held-out samples counted once across both ranks.
    assert "on 449 samples" in line[0]
    import torch
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    keys = set(ckpt["model"])
    assert "head.weight" in keys and not any(k.startswith("module.") for k in keys)
    assert ckpt["metrics"]["accuracy"] >= 0.9


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "argument --batch-size: expected a batch size >= 1, got '0'"),
    (["--lr", "nan"], "argument --lr: expected a learning rate > 0, got 'nan'"),
    (["--out", "/proc/ddpc-no-such"], "argument --out: cannot make the checkpoint folder "
                                      "'/proc/ddpc-no-such'"),
])
def test_finetune_example_refuses_bad_arguments_before_training(tmp_path, args, message):
    """Each rank refuses them at once, and the launcher's summary quotes the reason (they used to
    fail inside torch, or, for --out, after the whole training)."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run(
        [sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "finetune.py"), "--no-progress"] + args,
        capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert "held-out accuracy" not in r.stdout


def test_torch_ddp_script_switched_by_its_imports(tmp_path):
    """examples/from_torch_ddp.py: torch DDP code whose only change is two import lines."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    r = subprocess.run(
        [sys.executable, "-m", "ddpc.launch", "--nproc_per_node=2",
         os.path.join(ROOT, "examples", "from_torch_ddp.py")],
        capture_output=True, text=True, timeout=180, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(ln.split("mean loss ")[1].split()[0]) for ln in r.stdout.splitlines()
              if "mean loss" in ln]
    assert len(losses) == 8 and losses[-1] < 0.05 < losses[0], r.stdout
    assert "over 4096 samples on 2 ranks" in r.stdout  # the sampler covered the data once
    assert "[rank0]: weights identical on every rank: True" in r.stdout

"""ddpc.DistributedSampler: index for index equal to torch.utils.data.DistributedSampler without
shuffle; with shuffle, a partition of one permutation shared by every rank and process; the exact
split (pad=False), auto_epoch, DataLoader use, argument errors, defaults from a real 2-rank
process group. Also compiles and runs the plain-C test tests/c/test_sampler.c."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from typing import Dict, List

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import DistributedSampler as TorchSampler

import ddpc
from ddpc import _C
from ddpc.sampler import DistributedSampler

from _procs import finish_all, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "tests", "c", "bin")
LENGTHS = [0, 1, 2, 3, 7, 10, 11, 100, 101]
REPLICAS = [1, 2, 3, 4, 8]
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))


class Sized:
    """A dataset that only has a length (the sampler never reads items)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def ranks(length: int, world: int, **kw) -> List[List[int]]:
    return [list(DistributedSampler(Sized(length), world, r, **kw)) for r in range(world)]


def padded_list(per_rank: List[List[int]]) -> List[int]:
    """Re-interleaves the ranks' lists: position r + k * world held per_rank[r][k]."""
    world = len(per_rank)
    out = [None] * sum(len(x) for x in per_rank)
    for r, xs in enumerate(per_rank):
        for k, v in enumerate(xs):
            out[r + k * world] = v
    assert None not in out, "rank lists do not interleave into one list"
    return out


# ------------------------------------------------------------------------- the C unit test


@pytest.mark.parametrize("sanitize", [False, True], ids=["O3", "asan_ubsan"])
def test_c_unit(sanitize):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc/cc) on PATH")
    os.makedirs(BIN, exist_ok=True)
    exe = os.path.join(BIN, "test_sampler" + ("_asan" if sanitize else ""))
    opt = (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all"] if sanitize else ["-O3"])
    cmd = [cc, "-std=c11", "-D_GNU_SOURCE", *opt, "-Wall", "-Wextra", "-Werror", "-pthread",
           "-I", os.path.join(ROOT, "csrc"), os.path.join(ROOT, "tests", "c", "test_sampler.c"),
           os.path.join(ROOT, "csrc", "sampler.c"), os.path.join(ROOT, "csrc", "common.c"),
           os.path.join(ROOT, "csrc", "settings.c"), "-lm", "-o", exe]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"compiling failed:\n{' '.join(cmd)}\n{res.stderr}"
    res = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"test_sampler failed:\n{res.stdout}\n{res.stderr}"
    assert res.stdout.startswith("ok: "), res.stdout


# ------------------------------------------------------------------------- torch's split


@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_torch_without_shuffle(drop_last):
    for n in LENGTHS:
        for world in REPLICAS:
            for r in range(world):
                ours = DistributedSampler(Sized(n), world, r, shuffle=False, drop_last=drop_last)
                theirs = TorchSampler(Sized(n), world, r, shuffle=False, drop_last=drop_last)
                where = f"len={n} replicas={world} rank={r} drop_last={drop_last}"
                assert list(ours) == list(theirs), where
                assert len(ours) == len(theirs), where
                assert ours.num_samples == theirs.num_samples, where
                assert ours.total_size == theirs.total_size, where
                assert ours.indices().tolist() == list(theirs), where


@pytest.mark.parametrize("drop_last", [False, True])
def test_shuffle_is_torch_split_of_one_permutation(drop_last):
    for n in LENGTHS:
        for world in REPLICAS:
            per_rank = ranks(n, world, seed=3, drop_last=drop_last)
            theirs = len(TorchSampler(Sized(n), world, 0, drop_last=drop_last))
            assert all(len(x) == theirs for x in per_rank), (n, world)
            full = padded_list(per_rank)
            head = full[:n] if not drop_last else full
            where = f"len={n} replicas={world} drop_last={drop_last}"
            # every index at most once before the padding; all of them without drop_last
            assert len(set(head)) == len(head) and set(head) <= set(range(n)), where
            if not drop_last:
                assert sorted(head) == list(range(n)), where
                # padding repeats the permutation from its front, as often as needed
                assert full[n:] == [head[i % n] for i in range(len(full) - n)], where
            else:
                assert len(full) == (n // world) * world, where
            # every rank saw the same permutation: the same one replicas=1 yields
            perm = list(DistributedSampler(Sized(n), 1, 0, seed=3))
            assert head == perm[:len(head)], where


def test_permutation_depends_on_seed_and_epoch_only():
    n, world = 1000, 4
    s = DistributedSampler(Sized(n), world, 1, seed=11)
    first = list(s)
    assert first == list(s) == list(DistributedSampler(Sized(n), world, 1, seed=11))
    s.set_epoch(1)
    second = list(s)
    assert second != first
    s.set_epoch(0)
    assert list(s) == first
    assert list(DistributedSampler(Sized(n), world, 1, seed=12)) != first
    # unlike torch (seed + epoch), seed and epoch are hashed separately
    t = DistributedSampler(Sized(n), world, 1, seed=10)
    t.set_epoch(1)
    assert list(t) != first


def test_large_negative_seeds_wrap_like_torch():
    a = DistributedSampler(Sized(50), 2, 0, seed=-1)
    b = DistributedSampler(Sized(50), 2, 0, seed=2**64 - 1)
    assert list(a) == list(b)
    a.set_epoch(-5)
    b.set_epoch(2**64 - 5)
    assert list(a) == list(b)


PROC_SCRIPT = """
import hashlib, sys
import numpy as np
from ddpc.sampler import DistributedSampler
class Sized:
    def __len__(self): return 3_000_017
s = DistributedSampler(Sized(), num_replicas=3, rank=1, seed=2024)
s.set_epoch(7)
print(hashlib.sha256(s.indices().tobytes()).hexdigest())
"""


def test_same_order_in_separate_processes_and_thread_counts():
    """Two fresh interpreters (one single-threaded, one on 3 threads) and this process agree on a
    bucketed, threaded shuffle of 3M indices."""
    digests = []
    for threads in ("1", "3"):
        env = dict(ENV, DDPC_SAMPLER_THREADS=threads)
        res = subprocess.run([sys.executable, "-c", PROC_SCRIPT], env=env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        digests.append(res.stdout.strip())
    s = DistributedSampler(Sized(3_000_017), num_replicas=3, rank=1, seed=2024)
    s.set_epoch(7)
    here = hashlib.sha256(s.indices().tobytes()).hexdigest()
    assert digests == [here, here]


# ------------------------------------------------------------------------- beyond torch


@pytest.mark.parametrize("shuffle", [False, True])
def test_unpadded_split_is_exact(shuffle):
    for n in LENGTHS + [1001]:
        for world in REPLICAS:
            per_rank = ranks(n, world, shuffle=shuffle, pad=False, seed=5)
            every = [i for xs in per_rank for i in xs]
            assert sorted(every) == list(range(n)), (n, world)
            lens = [len(x) for x in per_rank]
            assert max(lens) - min(lens) <= (1 if n else 0), (n, world, lens)
            assert lens == [len(DistributedSampler(Sized(n), world, r, pad=False))
                            for r in range(world)]
            assert DistributedSampler(Sized(n), world, 0, pad=False).total_size == n
            if shuffle and n:
                perm = list(DistributedSampler(Sized(n), 1, 0, seed=5))
                assert padded_list(per_rank) == perm


def test_auto_epoch():
    n = 500
    plain = DistributedSampler(Sized(n), 2, 0, seed=1)
    by_epoch = []
    for e in range(3):
        plain.set_epoch(e)
        by_epoch.append(list(plain))
    assert list(plain) == by_epoch[2], "without auto_epoch a second pass repeats the order"

    auto = DistributedSampler(Sized(n), 2, 0, seed=1, auto_epoch=True)
    assert np.array_equal(auto.indices(), by_epoch[0]), "indices() must not start a pass"
    passes = [list(auto) for _ in range(3)]
    assert passes == by_epoch and auto.epoch == 2
    assert auto.indices().tolist() != by_epoch[2], "indices() shows the next pass (epoch 3)"
    auto.set_epoch(1)  # set_epoch wins over the automatic step, for exactly the next pass
    assert list(auto) == by_epoch[1] and auto.epoch == 1
    assert list(auto) == by_epoch[2] and auto.epoch == 2
    # every rank advances in step, so the ranks still partition each epoch
    other = DistributedSampler(Sized(n), 2, 1, seed=1, auto_epoch=True)
    again = DistributedSampler(Sized(n), 2, 0, seed=1, auto_epoch=True)
    for _ in range(3):
        both = list(again) + list(other)
        assert sorted(both) == list(range(n))


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def test_dataloader_sampler():
    ds = Squares(23)
    seen = []
    for r in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=r, seed=9)
        assert isinstance(sampler, torch.utils.data.Sampler)
        loader = DataLoader(ds, batch_size=4, sampler=sampler)
        assert len(loader) == 2  # ceil(ceil(23 / 3) / 4)
        got = torch.cat(list(loader))
        assert torch.equal(got[:, 1], got[:, 0] ** 2)
        assert got[:, 0].tolist() == sampler.indices().tolist()
        seen += got[:, 0].tolist()
    assert set(seen) == set(range(23)) and len(seen) == 24  # one padded repeat


def test_indices_array_and_iterator_object():
    s = DistributedSampler(Sized(10), 3, 1, shuffle=False)
    a = s.indices()
    assert a.dtype == np.int64 and a.shape == (4,) and a.tolist() == [1, 4, 7, 0]
    a[0] = 99  # the caller owns it: a fresh buffer each call
    assert s.indices().tolist() == [1, 4, 7, 0]
    it = iter(s)
    assert isinstance(it, _C.SamplerIndices) and it.__length_hint__() == 4
    assert next(it) == 1 and it.__length_hint__() == 3
    view = memoryview(it)
    assert view.format == "q" and view.shape == (4,) and view.tolist() == [1, 4, 7, 0]
    assert list(it) == [4, 7, 0] and it.__length_hint__() == 0
    assert len(np.frombuffer(iter(DistributedSampler(Sized(0), 2, 1)), np.int64)) == 0


def test_pickle_round_trip():
    s = DistributedSampler(list(range(40)), 4, 3, seed=8, auto_epoch=True)
    list(s)
    t = pickle.loads(pickle.dumps(s))
    assert (t.epoch, t.num_replicas, t.rank, t.seed) == (0, 4, 3, 8)
    assert list(t) == list(s)


def test_repr_and_attributes():
    s = DistributedSampler(Sized(10), 4, 2, shuffle=False, seed=3, drop_last=True)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last, s.pad, s.auto_epoch) == \
        (4, 2, False, 3, True, True, False)
    assert (s.num_samples, s.total_size, len(s)) == (2, 8, 2)
    assert "num_replicas=4" in repr(s) and "rank=2" in repr(s)
    with pytest.raises(AttributeError):
        s.rank = 1


# ------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(num_replicas=0, rank=0), ValueError, ["num_replicas=0"]),
    (dict(num_replicas=2, rank=2), ValueError, ["rank=2", "num_replicas=2"]),
    (dict(num_replicas=2, rank=-1), ValueError, ["rank=-1"]),
    (dict(num_replicas=2.0, rank=0), TypeError, ["num_replicas", "float"]),
    (dict(num_replicas=True, rank=0), TypeError, ["num_replicas", "bool"]),
    (dict(num_replicas=2, rank="0"), TypeError, ["rank", "str"]),
    (dict(num_replicas=2, rank=0, seed=1.5), TypeError, ["seed"]),
    (dict(num_replicas=2, rank=0, seed=2**64), ValueError, ["seed", "2**64"]),
    (dict(num_replicas=2, rank=0, shuffle="yes"), TypeError, ["shuffle", "bool"]),
    (dict(num_replicas=2, rank=0, drop_last=True, pad=False), ValueError,
     ["drop_last=True", "pad=False"]),
    (dict(num_replicas=2**31, rank=0), ValueError, ["num_replicas"]),
])
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc) as info:
        DistributedSampler(Sized(10), **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_dataset_without_len():
    with pytest.raises(TypeError, match="__len__"):
        DistributedSampler(iter(range(5)), 2, 0)


def test_needs_group_or_explicit_ranks():
    assert not ddpc.is_initialized()
    for kw in ({}, {"num_replicas": 2}, {"rank": 0}):
        with pytest.raises(ValueError, match=r"init_process_group\(\).*num_replicas and rank"):
            DistributedSampler(Sized(10), **kw)


def test_bad_epoch_and_changed_length():
    s = DistributedSampler(Sized(10), 2, 0)
    with pytest.raises(TypeError, match="epoch"):
        s.set_epoch(1.0)
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-(2**63) - 1)
    ds = list(range(10))
    s = DistributedSampler(ds, 2, 0)
    ds.append(10)
    with pytest.raises(RuntimeError, match="length changed from 10 to 11"):
        iter(s)


def test_core_rejects_bad_arguments_too():
    with pytest.raises(ValueError, match="rank 3 is outside"):
        _C.SamplerIndices(10, 3, 3, True, 0, 0, False, True)
    with pytest.raises(ValueError, match="negative"):
        _C.SamplerIndices.num_samples(-1, 1, 0, False, True)


# ------------------------------------------------------------------------- real process group


GROUP_SCRIPT = """
import json, sys
import ddpc
rank, path = int(sys.argv[1]), sys.argv[2]
ddpc.init_process_group(backend="cpu", init_method="file://" + path, rank=rank, world_size=2,
                        timeout=60)
from ddpc.sampler import DistributedSampler
s = DistributedSampler(list(range(101)), seed=4)
print(json.dumps({"replicas": s.num_replicas, "rank": s.rank, "indices": list(s)}))
ddpc.destroy_process_group()
"""


def test_defaults_from_process_group(tmp_path):
    path = str(tmp_path / "rendezvous")
    procs = [start([sys.executable, "-c", GROUP_SCRIPT, str(r), path], ENV) for r in range(2)]
    outs: Dict[int, dict] = {}
    for r, (rc, out, err) in enumerate(finish_all(procs, 90)):
        assert rc == 0, f"rank {r} failed:\n{err}"
        outs[r] = json.loads(out.strip().splitlines()[-1])
    assert [outs[r]["replicas"] for r in range(2)] == [2, 2]
    assert [outs[r]["rank"] for r in range(2)] == [0, 1]
    full = padded_list([outs[0]["indices"], outs[1]["indices"]])
    assert sorted(full[:101]) == list(range(101)) and full[101:] == full[:1]
    assert full == list(DistributedSampler(Sized(101), 1, 0, seed=4)) + full[:1]

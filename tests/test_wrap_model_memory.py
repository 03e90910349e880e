"""wrap_model's memory habits, on 2 real processes (cpu backend): parameters and buffers are
broadcast in bounded chunks (never a full-size copy of the model; any dtype, layout and shape),
and the bucket layout learnt in the first step replaces the old buckets without keeping both.
"""
import gc
import multiprocessing as mp
import os
import queue
import socket
import traceback
import weakref

import pytest
import torch

WORLD = 2
CHUNK = 256  # bytes: forces many chunks on a small model


class Odd(torch.nn.Module):
    """Parameters larger and smaller than a chunk, and buffers of awkward kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(40, 30)         # 4800 bytes of weight: alone in its chunk
        self.small = torch.nn.Linear(3, 2)         # several small ones share a chunk
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.register_buffer("count", torch.tensor(7))                   # 0-dim int64
        self.register_buffer("mask", torch.rand(6) > 0.5)                # bool
        self.register_buffer("t", torch.randn(8, 4).t())                 # not contiguous
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x):
        return self.small(self.big(x)[:, :3]) * self.frozen[:2]


def sc_broadcast(rank):
    import ddpc
    from ddpc import parallel
    parallel.BROADCAST_CHUNK_BYTES = CHUNK
    sizes = []
    real = parallel.dist.broadcast

    def spy(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    parallel.dist.broadcast = spy
    torch.manual_seed(rank)  # every rank starts different
    model = Odd()
    ddpc.wrap_model(model)
    parallel.dist.broadcast = real
    torch.manual_seed(0)
    want = Odd()
    same = {name: torch.equal(a, b) for (name, a), (_, b) in
            zip(list(model.named_parameters()) + list(model.named_buffers()),
                list(want.named_parameters()) + list(want.named_buffers()))}
    return {"same": same, "sizes": sizes,
            "total": sum(t.numel() * t.element_size()
                         for t in list(want.parameters()) + list(want.buffers()))}


def sc_rebuild(rank):
    import ddpc
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    wrapped = ddpc.wrap_model(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out = {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=g)
        opt.zero_grad(set_to_none=True)
        before = [weakref.ref(b) for b in wrapped._buckets]
        wrapped(x).square().mean().backward()
        gc.collect()
        out[f"released_{step}"] = all(r() is None for r in before)
        out[f"views_{step}"] = all(
            any(b.data_ptr() <= p.grad.data_ptr() < b.data_ptr() + b.numel() * 4
                for b in wrapped._buckets) for p in model.parameters())
        opt.step()
    return out


SCENARIOS = [("broadcast", sc_broadcast), ("rebuild", sc_rebuild)]


def _worker(rank, port, results):
    os.environ["DDPC_TOKEN"] = "test-wrap-model-memory"
    torch.set_num_threads(1)
    import ddpc
    ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=30)
    out = {}
    for name, fn in SCENARIOS:
        try:
            out[name] = ("ok", fn(rank))
        except BaseException:
            out[name] = ("error", traceback.format_exc())
    results.put((rank, out))
    ddpc.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(WORLD):
            rank, out = results.get(timeout=90)
            got[rank] = out
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(got))} did not report within 90 s")
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return got


def result(runs, name):
    outs = []
    for rank in range(WORLD):
        status, value = runs[rank][name]
        assert status == "ok", f"rank {rank} failed in scenario {name}:\n{value}"
        outs.append(value)
    return outs


def test_parameters_and_buffers_arrive_in_bounded_chunks(runs):
    for r in result(runs, "broadcast"):
        assert all(r["same"].values()), r["same"]
        assert r["sizes"] == result(runs, "broadcast")[0]["sizes"]  # same collectives everywhere
        big = 40 * 30 * 4
        assert big in r["sizes"]  # broadcast alone, in place
        assert all(s <= CHUNK for s in r["sizes"] if s != big), r["sizes"]
        assert len(r["sizes"]) > 3
        # every byte once, plus at most 15 bytes of alignment padding per packed tensor
        assert r["total"] <= sum(r["sizes"]) < r["total"] + 15 * 10, (r["sizes"], r["total"])


def test_first_step_rebuild_releases_the_old_buckets(runs):
    for r in result(runs, "rebuild"):
        assert all(r[f"views_{s}"] for s in range(3)), r
        assert r["released_1"], r  # the layout of step 0 was replaced and freed at step 1
        assert not r["released_2"], r  # and after that the buckets stay

"""A training script written for torch DDP, switched to ddpc by its import lines alone.

    python -m ddpc.launch --nproc-per-node 2 examples/from_torch_ddp.py      # or torchrun-style flags

The two commented lines are what the torch version imports; the rest is unchanged torch DDP code
(a regression on synthetic data, so it runs anywhere: on GPUs when there are some, else on CPUs).
"""
import os

import torch

# import torch.distributed as dist
# from torch.nn.parallel import DistributedDataParallel as DDP
import ddpc as dist
from ddpc import DistributedDataParallel as DDP
from ddpc import DistributedSampler  # torch.utils.data.distributed's needs torch's group


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same data on every rank; the sampler splits it
    x = torch.randn(4096, 16)
    y = x @ torch.arange(1.0, 17.0) / 16 + 0.01 * torch.randn(4096)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=64, sampler=sampler)

    torch.manual_seed(rank)  # different initial weights: DDP starts every rank from rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DDP(model.to(device), device_ids=[local_rank] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    for epoch in range(8):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(1), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(xb), torch.tensor(len(xb), device=device)])
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"epoch {epoch}: mean loss {total[0].item() / total[1].item():.4f} over "
                  f"{int(total[1].item())} samples on {world} ranks", flush=True)

    # Every rank must end with the same weights.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [None] * world
    dist.all_gather_object(gathered, flat.cpu())
    if rank == 0:
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"weights identical on every rank: {same}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

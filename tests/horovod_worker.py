"""Runs under torchrun (tests/test_horovod_shim.py): every horovod.torch call the
applications make, on tensors that depend on the rank; saves the results."""
import sys

import torch


def rank_tensor(r: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) + r


def main(out: str) -> None:
    import horovod.torch as hvd
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # different weights per rank until broadcast
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    inplace = rank_tensor(r)
    hvd.allreduce_(inplace, op=hvd.Sum)
    grouped_inplace = [rank_tensor(r), torch.tensor([r + 1.0])]
    hvd.grouped_allreduce_(grouped_inplace, op=hvd.Max)
    bcast_inplace = rank_tensor(r)
    hvd.broadcast_(bcast_inplace, root_rank=1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    results = {
        "size": hvd.size(), "rank": r, "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "average": hvd.allreduce(rank_tensor(r)),
        "average_flag": hvd.allreduce(rank_tensor(r), average=True),
        "sum": hvd.allreduce(rank_tensor(r), op=hvd.Sum),
        "sum_flag": hvd.allreduce(rank_tensor(r), average=False),
        "min": hvd.allreduce(rank_tensor(r), op=hvd.Min),
        "int_sum": hvd.allreduce(torch.tensor(r + 3), op=hvd.Sum),
        "scaled": hvd.allreduce(rank_tensor(r), op=hvd.Sum, prescale_factor=2.0,
                                postscale_factor=0.5),
        "fp16": hvd.allreduce(rank_tensor(r), compression=hvd.Compression.fp16),
        "inplace": inplace,
        "grouped": hvd.grouped_allreduce([rank_tensor(r), torch.tensor([r + 1.0])],
                                         op=hvd.Average),
        "grouped_inplace": grouped_inplace,
        "allgather": hvd.allgather(torch.full((r + 1, 2), float(r))),
        "allgather_scalar": hvd.allgather(torch.tensor(float(r))),
        "broadcast": hvd.broadcast(rank_tensor(r), root_rank=1),
        "broadcast_inplace": bcast_inplace,
        "object": hvd.broadcast_object({"seed": 100 + r}, root_rank=1),
        "objects": hvd.allgather_object(r * 10),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
    }
    hvd.barrier()
    torch.save(results, f"{out}/rank{r}.pt")
    # A clean end, as a real program: both ranks leave the group together (one rank
    # tearing gloo down at exit while the other still saves can abort the other).
    hvd.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

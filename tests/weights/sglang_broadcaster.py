"""The broadcasting half of an SGLang-speaking trainer, in a process of its own (as it is in
slime and AReaL: torch registers a group name once per process). It joins with SGLang's and
AReaL's `init_custom_process_group` recipe at rank 0 and broadcasts the buckets saved in
argv[4], in order: a flattened bucket as one uint8 tensor, else each tensor. Then it destroys
its group, unless told to exit without (`exit`: a trainer process that ends, or dies, leaving
the server's side of the group behind, as a slime trainer does; it ends when its standard
input closes, i.e. once the trainer's flow is done, never in the middle of the server's
join). With `nccl`, the group is NCCL's, the tensors on the host's last CUDA device (a GPU
host's check).

    python sglang_broadcaster.py PORT WORLD_SIZE GROUP_NAME BUCKETS_FILE [exit] [nccl]"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def main(
    port: int, world_size: int, name: str, path: str, destroy: bool = True, nccl: bool = False
) -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=60)
    store, rank, size = next(
        c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        size,
        rank,
        [],
        "nccl" if nccl else "gloo",
        dist.PrefixStore(name, store),
        group_name=c10d.GroupName(name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    for flat, on_host in torch.load(path):
        tensors = [t.to(device) for t in on_host]
        if flat:
            payload = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
            dist.broadcast(payload, src=0, group=group)
        else:
            handles = [
                dist.broadcast(t.contiguous(), src=0, group=group, async_op=True) for t in tensors
            ]
            for handle in handles:
                handle.wait()
    if destroy:
        dist.destroy_process_group(group)
    else:
        sys.stdin.read()  # the flow is done when the test closes this
        os._exit(0)  # gone at once, the group's teardown never run (as a killed trainer)


if __name__ == "__main__":
    flags = sys.argv[5:]
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        sys.argv[3],
        sys.argv[4],
        destroy="exit" not in flags,
        nccl="nccl" in flags,
    )

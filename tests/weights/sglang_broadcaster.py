"""The broadcasting half of an SGLang-speaking trainer, in a process of its own (as it is in
slime and AReaL: torch registers a group name once per process). It joins with SGLang's and
AReaL's `init_custom_process_group` recipe at rank 0 and broadcasts the buckets saved in
argv[4], in order: a flattened bucket as one uint8 tensor, else each tensor. Then it destroys
its group, unless told to exit without (`exit`: a trainer process that ends, or dies, leaving
the server's side of the group behind, as a slime trainer does).

    python sglang_broadcaster.py PORT WORLD_SIZE GROUP_NAME BUCKETS_FILE [exit]"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def main(port: int, world_size: int, name: str, path: str, destroy: bool = True) -> None:
    timeout = datetime.timedelta(seconds=60)
    store, rank, size = next(
        c10d.rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        size,
        rank,
        [],
        "gloo",
        dist.PrefixStore(name, store),
        group_name=c10d.GroupName(name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    for flat, tensors in torch.load(path):
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
        os._exit(0)  # gone at once, the group's teardown never run (as a killed trainer)


if __name__ == "__main__":
    leave = sys.argv[5:] != ["exit"]
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], destroy=leave)

"""The broadcasting half of an SGLang-speaking trainer, in a process of its own (as it is in
slime and AReaL: torch registers a group name once per process). It joins with SGLang's and
AReaL's `init_custom_process_group` recipe at rank 0 and broadcasts the buckets saved in
argv[4], in order: a flattened bucket as one uint8 tensor, else each tensor.

    python sglang_broadcaster.py PORT WORLD_SIZE GROUP_NAME BUCKETS_FILE"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def main(port: int, world_size: int, name: str, path: str) -> None:
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
    dist.destroy_process_group(group)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])

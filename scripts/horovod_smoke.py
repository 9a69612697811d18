"""Horovod allreduce smoke test.

Run with:  PATH=$PWD/.venv/bin:$PATH horovodrun -np 2 --gloo -H localhost:2 python scripts/horovod_smoke.py

Every rank contributes a tensor filled with (rank + 1); the summed allreduce must equal
size * (size + 1) / 2 everywhere, and the averaged one that divided by size. Rank 0 prints OK.
"""

from __future__ import annotations

import sys

import horovod.torch as hvd
import torch


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((4, 3), float(rank + 1))
    total = hvd.allreduce(x, op=hvd.Sum, name="smoke_sum")
    mean = hvd.allreduce(x, op=hvd.Average, name="smoke_avg")
    want_sum = size * (size + 1) / 2
    ok = bool(torch.all(total == want_sum)) and bool(torch.allclose(mean, torch.full_like(x, want_sum / size)))
    # Agree on the verdict, so rank 0 reports a failure seen by any rank.
    all_ok = int(hvd.allreduce(torch.tensor([int(ok)]), op=hvd.Min, name="smoke_ok").item()) == 1
    print(
        f"rank {rank}/{size} local_rank {hvd.local_rank()}: sum={total[0, 0].item()} "
        f"(want {want_sum}), mean={mean[0, 0].item()}",
        flush=True,
    )
    if rank == 0:
        print("OK" if all_ok else "FAIL", flush=True)
    hvd.shutdown()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A torchrun-style training script for sparkdl.compat.TorchDistributor.run("file.py", ...)."""
import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--steps", type=int, default=1)
args = parser.parse_args()
assert not dist.is_initialized()
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"script rank={dist.get_rank()} world={dist.get_world_size()} lr={args.lr} steps={args.steps} "
      f"local_rank={os.environ['LOCAL_RANK']} sum={value.item():g}")
dist.destroy_process_group()

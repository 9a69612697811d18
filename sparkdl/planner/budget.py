"""What one rank may hold, the one budget every memory check of the planner prices against (data
parallel, hybrid, IST, sharded, and the embedding tables' placement)."""
from __future__ import annotations

import math

from sparkdl.config import LaunchConfig, parse_bytes
from sparkdl.planner.cluster import ClusterInfo


def rank_memory_budget(launch: LaunchConfig, cluster: ClusterInfo) -> float | None:
    """What one rank may hold: launch.max_memory_per_rank, and spark.executor.pyspark.memory, which
    Spark divides among the executor's task slots and enforces on each Python worker (as an
    address-space limit, so the RSS a rank reaches is below it), whichever is less."""
    limits = []
    if launch.max_memory_per_rank is not None:
        limits.append(parse_bytes(launch.max_memory_per_rank, "launch.max_memory_per_rank"))
    if cluster.pyspark_memory:
        per_executor = parse_bytes(cluster.pyspark_memory if any(c.isalpha() for c in cluster.pyspark_memory)
                                   else f"{cluster.pyspark_memory}m", "spark.executor.pyspark.memory")
        executors = max(1, len(cluster.executors))
        slots_each = max(1, math.ceil((cluster.slots or launch.num_workers) / executors))
        limits.append(per_executor / slots_each)
    return min(limits) if limits else None

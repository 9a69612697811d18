"""The three all-to-alls of a step, packed over every table at once (one message per peer each):
requests (distinct ids, as rows of their owner's shard), rows back to the requesters, and gradients of
those rows to the owners. Buffers are laid out rank-major, table-minor; `counts[r, t]` rows of table t
go to (or come from) rank r. Rows of tables of different widths travel as one flat float buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkdl.comm.base import Communicator

INDEX_BYTES = 8  # int64 ids and counts


@dataclass(frozen=True)
class Routes:
    """Who asks whom for how many rows this step. `sent[r, t]`: rows of table t this rank asked rank r
    for; `received[r, t]`: rows of table t rank r asked this rank for; `dims[t]`: table t's width."""

    sent: torch.Tensor
    received: torch.Tensor
    dims: torch.Tensor

    def floats(self, counts: torch.Tensor) -> torch.Tensor:
        return counts * self.dims.unsqueeze(0)


def others(rank: int, per_rank: torch.Tensor) -> int:
    """Sum over every rank but this one (what leaves the host)."""
    return int(per_rank.sum()) - int(per_rank[rank].sum())


def exchange_counts(comm: Communicator, sent: torch.Tensor, dims: torch.Tensor) -> Routes:
    """sent: [W, T] int64. Every rank learns how many rows of each table every peer wants from it."""
    ones = [1] * comm.size
    received = comm.all_to_all(sent.contiguous(), ones, ones)
    return Routes(sent, received, dims)


def pack(chunks: list[list[torch.Tensor]], flat: bool) -> torch.Tensor:
    """chunks[r][t] in rank-major, table-minor order; rows flattened when `flat` (floats of any width)."""
    parts = [c.reshape(-1) if flat else c for per_rank in chunks for c in per_rank]
    return torch.cat(parts) if parts else torch.empty(0)


def unpack(buffer: torch.Tensor, counts: torch.Tensor, dims: torch.Tensor | None) -> list[list[torch.Tensor]]:
    """The inverse of pack: [r][t] chunks of counts[r, t] rows (each dims[t] wide when given)."""
    world, tables = counts.shape
    sizes = (counts * dims.unsqueeze(0) if dims is not None else counts).reshape(-1).tolist()
    pieces = torch.split(buffer, sizes)
    out: list[list[torch.Tensor]] = []
    for r in range(world):
        row = []
        for t in range(tables):
            piece = pieces[r * tables + t]
            row.append(piece.view(-1, int(dims[t])) if dims is not None else piece)
        out.append(row)
    return out


def send_requests(comm: Communicator, routes: Routes, requests: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """requests[r][t]: local rows of table t wanted from rank r -> [r][t]: rows rank r wants from us."""
    buffer = pack(requests, flat=False).to(torch.int64)
    got = comm.all_to_all(buffer, routes.sent.sum(1).tolist(), routes.received.sum(1).tolist())
    return unpack(got, routes.received, None)


def return_rows(comm: Communicator, routes: Routes, rows: list[list[torch.Tensor]],
                dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """rows[r][t]: what rank r asked us for -> [r][t]: what we asked rank r for."""
    return _swap_rows(comm, routes, rows, dtype, routes.received, routes.sent)


def send_gradients(comm: Communicator, routes: Routes, grads: list[list[torch.Tensor]],
                   dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """grads[r][t]: gradients of the rows we got from rank r -> [r][t]: gradients of the rows rank r got from us."""
    return _swap_rows(comm, routes, grads, dtype, routes.sent, routes.received)


def _swap_rows(comm: Communicator, routes: Routes, rows: list[list[torch.Tensor]], dtype: torch.dtype,
               outgoing: torch.Tensor, incoming: torch.Tensor) -> list[list[torch.Tensor]]:
    """One all-to-all of rows: `outgoing[r][t]` / `incoming[r][t]` count the ids whose rows go to /
    come from rank r (the rows' direction is opposite to the ids' that asked for them)."""
    buffer = pack(rows, flat=True).to(dtype)
    got = comm.all_to_all(buffer, routes.floats(outgoing).sum(1).tolist(), routes.floats(incoming).sum(1).tolist())
    return unpack(got, incoming, routes.dims)


def step_bytes(rank: int, routes: Routes, float_bytes: int) -> dict[str, int]:
    """Bytes this rank sends to its peers in one training step, by exchange."""
    tables = routes.sent.shape[1]
    return {"counts": INDEX_BYTES * tables * (routes.sent.shape[0] - 1),
            "ids": INDEX_BYTES * others(rank, routes.sent),
            "rows": float_bytes * others(rank, routes.floats(routes.received)),
            "gradients": float_bytes * others(rank, routes.floats(routes.sent))}

"""The built-in training loop every rank runs when no custom train_fn is given."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from sparkdl.launch.objectives import build_model, build_optimizer, loss_function
from sparkdl.strategies import strategy_class

if TYPE_CHECKING:
    from sparkdl.launch.worker import WorkerContext


def train(ctx: "WorkerContext") -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    from sparkdl.launch.checkpoint import Position, RunCheckpoints

    config = ctx.spec.config
    torch.manual_seed(config.train.seed)
    model = build_model(ctx.spec.model, config.train.seed)
    plan = _placed_plan(ctx)
    strategy = strategy_class(config.train.strategy)(ctx.comm, plan, config.train)
    loss_fn = loss_function(config.train)
    strategy.setup(model, lambda params: build_optimizer(config.train, params), loss_fn)
    del model  # a strategy may keep only part of it (a pipeline stage): let the rest go
    _emulate_and_balance(ctx, strategy)
    checkpoints = RunCheckpoints.for_run(ctx, strategy)
    history: list[dict[str, Any]] = []
    start, progress = Position(0, 0, 0), {}
    resumed = checkpoints.restore() if checkpoints is not None else None
    if resumed is not None:
        start, progress = resumed
        history = list(progress.get("history", []))
        if progress.get("batch_shares"):  # the shares the run started with, not a new measurement
            from sparkdl.launch.balance import loss_weight

            ctx.batch_shares = list(progress["batch_shares"])
            strategy.loss_weight = loss_weight(ctx.batch_shares, ctx.rank)
        if ctx.rank == 0:
            print(f"sparkdl: resumed from the checkpoint of step {start.global_step} (epoch {start.epoch}, "
                  f"step {start.step} of it); steps after it are trained again", flush=True)
    device = ctx.comm.device
    reporter = ctx.reporter
    steps = ctx.steps_per_epoch
    if reporter is not None:
        reporter.start(epochs=config.train.epochs, steps_per_epoch=steps, world_size=ctx.world_size,
                       rows=sum(ctx.row_counts), hosts=sorted(set(ctx.world.hosts)), device=str(device),
                       gpus=list(ctx.world.gpus))
    global_step = start.global_step
    for epoch in range(start.epoch, config.train.epochs):
        resuming = resumed is not None and epoch == start.epoch
        bytes_before = ctx.comm.bytes_sent
        started = time.perf_counter()
        # on device: no sync per step
        loss_sum = torch.tensor(float(progress.get("loss_sum", 0.0)) if resuming else 0.0, dtype=torch.float64,
                                device=device)
        samples = int(progress.get("samples", 0)) if resuming else 0
        step = start.step if resuming else 0
        for index, (features, labels) in enumerate(ctx.batches(epoch)):
            if index < step:
                continue  # trained before the checkpoint; the batches of an epoch are deterministic
            step_started = time.perf_counter()
            features = features.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = strategy.train_step(features, labels)
            loss_sum += loss.double() * strategy.loss_rows(features.shape[0])
            samples += features.shape[0]
            step += 1
            global_step += 1
            if reporter is not None and reporter.due(global_step, step == steps):
                step_s = time.perf_counter() - step_started
                reporter.step(global_step, {
                    "loss": float(loss), "lr": strategy.learning_rate(), "step_time_s": step_s,
                    "samples_per_sec": features.shape[0] * ctx.world_size / step_s if step_s > 0 else 0.0,
                    "epoch": epoch}, log=global_step % reporter.log_every == 0 or step == steps)
            if checkpoints is not None and step < steps and checkpoints.due(global_step):
                checkpoints.save(Position(epoch, step, global_step),
                                 _progress(ctx, history, float(loss_sum.cpu()), samples))
        if epoch == config.train.epochs - 1:
            strategy.finish()
        strategy.end_epoch()
        totals = torch.tensor([float(loss_sum.cpu()), float(samples)], dtype=torch.float64)
        ctx.comm.allreduce(totals, op="sum")
        seconds = time.perf_counter() - started
        record: dict[str, Any] = {
            "epoch": epoch,
            "loss": float(totals[0] / max(totals[1], 1.0)),
            "samples": int(totals[1]),
            "steps": step,
            "seconds": seconds,
            "samples_per_sec": float(totals[1]) / seconds if seconds > 0 else 0.0,
            "bytes_sent": ctx.comm.bytes_sent - bytes_before,
            "lr": strategy.learning_rate(),
        }
        if resuming:
            record["resumed_from_step"] = start.global_step
        if ctx.batch_shares:
            record["batch_rows_per_rank"] = list(ctx.batch_shares)
        if hasattr(plan, "grid"):
            record["hybrid_grid"] = [list(ranks) for ranks in plan.grid]
        local = dict(strategy.epoch_metrics(), bytes_sent=float(record["bytes_sent"]))
        for name, values in _gather_metrics(ctx, local).items():
            if name == "bytes_sent":
                record["bytes_sent_all_ranks"] = int(sum(values))  # "bytes_sent" is rank 0's own
            else:
                record[f"max_{name}_per_rank"] = max(values)
        record.update(validate(ctx, strategy, loss_fn))
        history.append(record)
        if reporter is not None:
            reporter.epoch(record)
        if checkpoints is not None and epoch < config.train.epochs - 1:
            checkpoints.save(Position(epoch + 1, 0, global_step), _progress(ctx, history, 0.0, 0))
    return strategy.result_state(), history


def _placed_plan(ctx: "WorkerContext") -> Any:
    """The driver's plan; a hybrid grid is placed on the executors this job's ranks got."""
    plan = ctx.spec.plan
    if hasattr(plan, "placed"):
        plan = plan.placed(tuple(ctx.world.executors))
        if plan is not ctx.spec.plan and ctx.rank == 0:
            print(f"sparkdl: hybrid grid placed on measured links: {[list(r) for r in plan.grid]} "
                  "(grid[replica][stage] = rank)", flush=True)
    return plan


def _emulate_and_balance(ctx: "WorkerContext", strategy: Any) -> None:
    """launch.emulate_speed, and data-parallel batches shared by rank speed (launch/balance.py)."""
    config = ctx.spec.config
    emulated_speeds = config.launch.emulate_speed
    if emulated_speeds:
        strategy.compute_speed = float(emulated_speeds[ctx.rank])
        if ctx.rank == 0:
            print(f"sparkdl: EMULATED compute speeds {list(emulated_speeds)} (launch.emulate_speed); data-parallel "
                  "steps are stretched, timings are not this cluster's", flush=True)
    if config.train.batch_balance == "speed" and strategy.name == "data_parallel" and ctx.world_size > 1 \
            and ctx.row_counts:
        from sparkdl.launch.balance import agree_on_shares, loss_weight

        ctx.batch_shares = agree_on_shares(ctx.comm, ctx.rank, config.data.batch_size, emulated_speeds)
        strategy.loss_weight = loss_weight(ctx.batch_shares, ctx.rank)


def _progress(ctx: "WorkerContext", history: list[dict[str, Any]], loss_sum: float, samples: int) -> dict[str, Any]:
    """This rank's part of a checkpoint besides the strategy's state: running sums, history (rank 0)."""
    return {"loss_sum": loss_sum, "samples": samples, "history": history if ctx.rank == 0 else [],
            "batch_shares": list(ctx.batch_shares or [])}


def _gather_metrics(ctx: "WorkerContext", local: dict[str, float]) -> dict[str, list[float]]:
    gathered = ctx.comm.allgather_object(local)
    return {name: [float(m.get(name, 0.0)) for m in gathered] for name in local}


def validate(ctx: "WorkerContext", strategy: Any, loss_fn: Any) -> dict[str, float]:
    """val_loss (and val_accuracy for class labels) over every rank's validation rows."""
    if ctx._validation is None:  # noqa: SLF001 - same package
        return {}
    classification = ctx.spec.layout is not None and ctx.spec.layout.label_dtype == "int64"
    sums = strategy.evaluate(ctx.validation_batches(), loss_fn, classification)  # loss * rows, correct, rows
    ctx.comm.allreduce(sums, op="sum")
    if sums[2] == 0:
        return {}
    result = {"val_loss": float(sums[0] / sums[2])}
    if classification:
        result["val_accuracy"] = float(sums[1] / sums[2])
    return result

"""The built-in training loop every rank runs when no custom train_fn is given.

`train` reads top-down: build the strategy (placed on this job's executors), resume from a
checkpoint when a retried attempt has one, then one epoch after another, each ending in the epoch
record every rank agrees on. The context arrives complete (executor/context.py) and is never written.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from sparkdl.config.training import early_stopping_options
from sparkdl.data.epochs import accumulation, optimizer_steps
from sparkdl.executor.checkpoint import CheckpointStore, Position, Resume
from sparkdl.executor.checkpoint_async import RunCheckpoints
from sparkdl.executor.context import WorkerContext
from sparkdl.executor.epoch_record import EpochTotals, epoch_record
from sparkdl.executor.loss_watch import LossWatch
from sparkdl.executor.memory import mark_model_start, reset_cuda_peak
from sparkdl.comm.base import blocked_seconds
from sparkdl.executor.rebalance import Rebalancer
from sparkdl.executor.replan import Replanner
from sparkdl.model.objectives import build_model, build_optimizer, enable_activation_checkpointing, loss_function
from sparkdl.wire.stopping import REGROUP, REGROUP_KEY, EarlyStopping, Verdict, epoch_verdict
from sparkdl.executor.validation import run_metrics, validate
from sparkdl.strategies import Strategy, strategy_class
from sparkdl.strategies.inputs import batch_rows, to_device
from sparkdl.strategies.lr_schedule import build_scheduler

History = list[dict[str, Any]]


def train(ctx: WorkerContext, resume: Resume | None = None, store: CheckpointStore | None = None
          ) -> tuple[dict[str, torch.Tensor] | None, History]:
    """`store`: the run's checkpoint store (None: no checkpoints); `resume`: what it held when this
    attempt started (both read by executor/worker.py before the context was built)."""
    spec = ctx.spec
    reset_cuda_peak(ctx.comm.device)
    mark_model_start()
    torch.manual_seed(spec.train.seed)
    strategy = build_strategy(ctx)
    loss_fn = loss_function(spec.train)
    with strategy.model_building():
        model = build_model(spec.model, spec.train.seed, strategy.layers_to_build(), lazy=strategy.builds_layer_by_layer)
    if spec.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    strategy.setup(model, lambda params: build_optimizer(spec.train, params),
                   loss_fn)  # a strategy may keep only part of the model (a pipeline stage): the rest goes
    checkpoints = RunCheckpoints(store, ctx.comm, strategy, spec.train.checkpoint_every,
                                 spec.launch.timeout_s) if store else None
    balancer = _rebalancer(ctx, strategy, resume)
    try:
        history, stopper = _train_epochs(ctx, strategy, loss_fn, resume, checkpoints, balancer)
        if checkpoints is not None:
            checkpoints.finish()  # the last save recorded in the manifest before the result leaves
    except BaseException:
        if checkpoints is not None:
            checkpoints.abandon()  # no collectives: a peer may be gone
        raise
    stopper.restore_best(strategy, history)
    return strategy.result_state(), history


def _train_epochs(ctx: WorkerContext, strategy: Strategy, loss_fn: Any, resume: Resume | None,
                  checkpoints: RunCheckpoints | None, balancer: Rebalancer | None) -> tuple[History, "_Stopper"]:
    """Every epoch from the resumed position on, each ending in its agreed record; stops early on
    the epoch verdict (the same on every rank)."""
    spec = ctx.spec
    start, progress, history = _resume(ctx, strategy, resume)
    stopper = _Stopper.of(spec.train, progress if resume is not None else {})
    metrics = run_metrics(ctx)
    _report_start(ctx)
    global_step = start.global_step
    replanner = Replanner.of(spec, strategy)
    watch = LossWatch(spec.train.nonfinite_loss, ctx.rank, ctx.world.hosts[ctx.rank] if ctx.world.hosts else "",
                      ctx.comm.device)
    for epoch in range(start.epoch, spec.train.epochs):
        resuming = resume is not None and epoch == start.epoch
        bytes_before, started = ctx.comm.bytes_sent, time.perf_counter()
        totals = EpochTotals(torch.tensor(float(progress.get("loss_sum", 0.0)) if resuming else 0.0,
                                           dtype=torch.float64, device=ctx.comm.device),
                              int(progress.get("samples", 0)) if resuming else 0,
                              start.step if resuming else 0, global_step, ctx.transform_seconds, balancer=balancer,
                             watch=watch)
        watch.start_epoch(global_step)
        run_epoch(ctx, strategy, epoch, totals, checkpoints, history, stopper)
        global_step = totals.global_step
        last = epoch == spec.train.epochs - 1
        if last:
            strategy.finish()
        strategy.end_epoch()
        if checkpoints is not None:
            totals.checkpoint = checkpoints.timings.take()
        totals.skipped = watch.end_epoch(epoch, totals.step - (start.step if resuming else 0))
        record = epoch_record(ctx, strategy, epoch, totals, time.perf_counter() - started,
                              ctx.comm.bytes_sent - bytes_before)
        if replanner is not None:  # auto's data parallel corrected by what the epoch measured (executor/replan.py)
            replanner.after_epoch(record, epoch, last)
        if resuming:
            record["resumed_from_step"] = start.global_step
            record.update(resume.history_fields())  # a fall-back past damaged checkpoints, named
            if resume.written_by:  # an elastic run's new size: the driver adds who left or joined
                record["resized_from_workers"] = resume.written_by
        record.update(validate(ctx, strategy, loss_fn, metrics, _triples(ctx, ctx.validation_batches())))
        verdict = stopper.close_epoch(ctx, strategy, record)
        regroup = verdict.stop and verdict.stopped_by == REGROUP and checkpoints is not None and not last
        if regroup:  # the driver has more workers for this run: checkpoint, end, go on in the next job
            record.pop("stopped_by", None)
            record[REGROUP_KEY] = record.pop("stop_reason", "") or "more workers"
        history.append(record)
        if verdict.stop and not regroup:
            if not last:  # end on the weights this epoch validated (DiLoCo's global model, IST's last write-back)
                strategy.restore(strategy.snapshot())
            break
        if checkpoints is not None and not last:
            checkpoints.save(Position(epoch + 1, 0, global_step),
                             _progress(ctx, strategy, history, 0.0, 0, stopper, balancer))
        if regroup:
            break
    return history, stopper


@dataclass
class _Stopper:
    """Early stopping's patience and the best epoch's weights (this rank's part), and the epoch
    verdict (wire/stopping.py); both saved in checkpoints so a resumed run stops where it would have."""

    early: EarlyStopping | None
    best: dict[str, torch.Tensor] | None = None

    @classmethod
    def of(cls, train: Any, progress: dict[str, Any]) -> "_Stopper":
        early = EarlyStopping.of(early_stopping_options(train.early_stopping))
        if early is not None and progress.get("early_stopping"):
            early.load(progress["early_stopping"])
        return cls(early, progress.get("best_weights"))

    def close_epoch(self, ctx: WorkerContext, strategy: Strategy, record: dict[str, Any]) -> Verdict:
        reason = None
        if self.early is not None:
            improved, reason = self.early.update(record)
            if improved and self.early.restore_best:
                self.best = strategy.snapshot()
            if reason is not None:
                record.update(stopped_by="early_stopping", stop_reason=reason)
        verdict = epoch_verdict(ctx, record, reason)
        if verdict.stop:
            record.update(stopped_by=verdict.stopped_by, stop_reason=verdict.reason)
        return verdict

    def restore_best(self, strategy: Strategy, history: History) -> None:
        """The best epoch's weights, when early stopping ended the fit or it ran every epoch; a
        callback's "stop" keeps the weights of the epoch it stopped after (what it asked for)."""
        if self.early is None or not self.early.restore_best or self.best is None or not history \
                or history[-1].get(REGROUP_KEY):
            return
        if str(history[-1].get("stopped_by", "early_stopping")) != "early_stopping":
            return
        if self.early.best_epoch != history[-1]["epoch"]:
            strategy.restore(self.best)
        history[-1]["best_epoch"] = self.early.best_epoch
        history[-1]["restored_best"] = True

    def progress(self, ctx: WorkerContext, strategy: Strategy) -> dict[str, Any]:
        if self.early is None:
            return {}
        # Ranks holding the same weights keep one copy of the best ones: rank 0's (it returns the model).
        keep = self.best is not None and (ctx.rank == 0 or not strategy.replicated_state)
        return {"early_stopping": self.early.state(), **({"best_weights": self.best} if keep else {})}


def build_strategy(ctx: WorkerContext) -> Strategy:
    """The configured strategy with its layout placed on the executors this job's ranks got."""
    spec = ctx.spec
    speeds = spec.launch.emulate_speed
    if speeds and ctx.rank == 0:
        print(f"sparkdl: EMULATED compute speeds {list(speeds)} (launch.emulate_speed); data-parallel "
              "steps are stretched, timings are not this cluster's", flush=True)
    from sparkdl.executor.balance import loss_weight

    total_steps = spec.train.epochs * optimizer_steps(ctx.steps_per_epoch, spec.train.accumulate_steps)
    strategy = strategy_class(spec.train.strategy)(
        ctx.comm, spec.strategy_layout, spec.train,
        loss_weight=loss_weight(ctx.batch_shares, ctx.rank) if ctx.batch_shares else 1.0,
        compute_speed=float(speeds[ctx.rank]) if speeds else 1.0,
        schedule=functools.partial(build_scheduler, spec.train, total_steps=total_steps,
                                   steps_per_epoch=optimizer_steps(ctx.steps_per_epoch, spec.train.accumulate_steps)))
    note = strategy.place(tuple(ctx.world.executors))
    if note and ctx.rank == 0:
        print(note, flush=True)
    return strategy


def _rebalancer(ctx: WorkerContext, strategy: Strategy, resume: Resume | None) -> Rebalancer | None:
    """batch_balance="dynamic" on data parallel (DiLoCo's replicas too: their rounds then take about
    as long on every replica, DyLU's aim, with pseudo-gradients weighted by rows) or sharded: from the
    speeds a checkpoint remembers, else the declared ones, else equal."""
    train = ctx.spec.train
    if train.batch_balance != "dynamic" or ctx.world_size < 2 or train.strategy not in ("data_parallel", "sharded"):
        return None
    remembered = resume.progress.get("rank_speeds") if resume is not None else None
    return Rebalancer.start(ctx.comm, train.rebalance_every, remembered, ctx.world.executors or ctx.world.hosts,
                            ctx.world.hosts, ctx.spec.launch.emulate_speed)


def _resume(ctx: WorkerContext, strategy: Strategy, resume: Resume | None
            ) -> tuple[Position, dict[str, Any], History]:
    """(start position, this rank's saved running sums, history so far): a fresh start, or the
    checkpoint a retried attempt found, loaded into the strategy."""
    if resume is None:
        return Position(0, 0, 0), {}, []
    resume.apply(strategy)
    start = resume.position
    if ctx.rank == 0:
        print(f"sparkdl: resumed from the checkpoint of step {start.global_step} (epoch {start.epoch}, "
              f"step {start.step} of it); steps after it are trained again", flush=True)
    return start, resume.progress, list(resume.progress.get("history", []))


def _report_start(ctx: WorkerContext) -> None:
    if ctx.reporter is None:
        return
    ctx.reporter.start(epochs=ctx.spec.train.epochs, steps_per_epoch=ctx.steps_per_epoch,
                       world_size=ctx.world_size, rows=sum(ctx.row_counts), hosts=sorted(set(ctx.world.hosts)),
                       rank_hosts=list(ctx.world.hosts), device=str(ctx.comm.device), gpus=list(ctx.world.gpus))


def run_epoch(ctx: WorkerContext, strategy: Strategy, epoch: int, totals: EpochTotals,
              checkpoints: RunCheckpoints | None, history: History, stopper: "_Stopper") -> None:
    """Train the epoch's steps from `totals.step` on (earlier ones ran before the checkpoint; the
    batches of an epoch are deterministic, and the earlier ones are not even made), reporting and
    checkpointing as due. A checkpoint falls due at a step but is taken at the end of its
    accumulation window (accumulated gradients are not saved)."""
    device, reporter, steps = ctx.comm.device, ctx.reporter, ctx.steps_per_epoch
    accumulate, save_due = ctx.spec.train.accumulate_steps, False
    fetch_started = time.perf_counter()
    balancer = totals.balancer
    batches = _triples(ctx, ctx.batches(epoch, start=totals.step))
    if balancer is not None:
        batches = balancer.exchanged(batches, ctx.epoch, totals.step, totals.global_step)
    for inputs, labels, weights in batches:
        step_started, blocked_before = time.perf_counter(), blocked_seconds()
        totals.data_seconds += step_started - fetch_started
        inputs, rows = to_device(inputs, device), batch_rows(inputs)
        labels = labels.to(device, non_blocking=True)
        weights = None if weights is None else weights.to(device, non_blocking=True)
        micro = accumulation(totals.step, steps, accumulate)
        if balancer is not None:
            strategy.loss_weight = balancer.loss_weight  # this rank's part of the step's rows
        loss = strategy.train_step(inputs, labels, weights, micro)
        step_s, waited = time.perf_counter() - step_started, blocked_seconds() - blocked_before
        totals.step_seconds += step_s
        totals.wait_seconds += waited
        if balancer is not None:
            balancer.record(rows, step_s - waited)
        totals.samples += rows
        totals.step += 1
        totals.global_step += 1
        if totals.watch is not None:  # a NaN/inf loss raises here (or is left out: nonfinite_loss="skip")
            loss = totals.watch.observe(loss, rows, totals.global_step, epoch)
        totals.loss_sum += loss.double() * strategy.loss_rows(rows)
        if totals.global_step == 1 and ctx.task_started:
            totals.first_step_s = time.perf_counter() - ctx.task_started
        if reporter is not None and reporter.due(totals.global_step, totals.step == steps):
            step_s = time.perf_counter() - step_started
            reporter.step(totals.global_step, {
                "loss": float(loss), "lr": strategy.learning_rate(), "step_time_s": step_s,
                "samples_per_sec": rows * ctx.world_size / step_s if step_s > 0 else 0.0,
                "epoch": epoch}, log=totals.global_step % reporter.log_every == 0 or totals.step == steps)
        save_due = save_due or (checkpoints is not None and checkpoints.due(totals.global_step))
        if save_due and micro.last and totals.step < steps:
            save_due = False
            if totals.watch is not None:
                totals.watch.check(epoch)  # never a checkpoint of weights a bad step already touched
            checkpoints.save(Position(epoch, totals.step, totals.global_step),  # type: ignore[union-attr]
                             _progress(ctx, strategy, history, float(totals.loss_sum.cpu()), totals.samples, stopper,
                                       balancer))
        fetch_started = time.perf_counter()


def _triples(ctx: WorkerContext, batches: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, Any, Any]]:
    """(inputs, labels, weights) whatever the layout: feature_cols batches have no weights. Labels
    with ignored positions (-100) under cross_entropy, and every causal_lm batch (its last position
    never counts; padding does not either), get weights of 1, so that the loss is the mean over the
    positions that count in the *global* batch (a mean of per-rank means is not), and a batch with
    none left gives 0, not NaN."""
    layout = ctx.spec.layout
    loss = ctx.spec.train.loss
    if layout is not None and ((layout.label_ignores and loss == "cross_entropy") or loss == "causal_lm"):
        return ((inputs, labels, torch.ones(labels.shape[0]) if weights is None else weights)
                for inputs, labels, weights in batches)
    if layout is not None and (layout.tensor_inputs or layout.weight_column):
        return iter(batches)  # type: ignore[arg-type]
    return ((features, labels, None) for features, labels in batches)


# The checkpoint figures too: a save's stall is the slowest rank's (the next collective waits for it).
def _progress(ctx: WorkerContext, strategy: Strategy, history: History, loss_sum: float, samples: int,
              stopper: _Stopper, balancer: Rebalancer | None = None) -> dict[str, Any]:
    """This rank's part of a checkpoint besides the strategy's state: running sums, history (rank 0),
    early stopping's state, this rank's part of the best weights and the ranks' last measured speeds."""
    speeds = balancer.remembered(ctx.world.executors or ctx.world.hosts, ctx.world.hosts) if balancer else {}
    return {"loss_sum": loss_sum, "samples": samples, "history": history if ctx.rank == 0 else [],
            "batch_shares": list(ctx.batch_shares or []), **({"rank_speeds": speeds} if speeds else {}),
            **stopper.progress(ctx, strategy)}

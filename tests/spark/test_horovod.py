"""The Horovod backend inside barrier tasks: same training as torch.distributed, right local ranks,
clean failures. Built by `make horovod` (part of `make test`); skipped only where it is absent."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import sparkdl
from sparkdl import TorchEstimator
from sparkdl.errors import ConfigError, TrainingError

# Horovod is imported by each test, not here: `make test` collects this module while it still builds
# Horovod. tests/conftest.py fails these tests where Horovod does not import and SPARKDL_REQUIRE_HOROVOD
# is set (`make test` built it), and skips them elsewhere.
pytestmark = pytest.mark.horovod


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def rows_df(spark):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(80, 6))
    y = rng.integers(0, 3, size=80)
    return spark.createDataFrame([(*map(float, r), int(t)) for r, t in zip(x, y)],
                                 [f"f{i}" for i in range(6)] + ["label"])


def test_horovod_and_torch_give_the_same_weights_after_5_steps(rows_df) -> None:  # type: ignore[no-untyped-def]
    def train(backend: str) -> dict[str, torch.Tensor]:
        est = TorchEstimator(model=factory, feature_cols=[f"f{i}" for i in range(6)], label_col="label",
                             optimizer="sgd", lr=0.3, momentum=0.9, batch_size=8, epochs=1, num_workers=2,
                             shuffle=False, seed=3, backend=backend, tracking=False, progress=False,
                             strategy="data_parallel")
        model = est.fit(rows_df)
        assert model.history[0]["steps"] == 5
        return model.torch_module().state_dict()

    with_torch, with_horovod = train("torch"), train("horovod")
    for name in with_torch:
        assert torch.allclose(with_torch[name], with_horovod[name], atol=1e-5), name


def test_horovod_takes_schedules_accumulation_and_bf16_like_torch(rows_df) -> None:  # type: ignore[no-untyped-def]
    """The training essentials on Horovod: a warm-up schedule stepped per optimizer step, two
    accumulated micro-batches per step (averaged once, through sparkdl's allreduce) and bf16
    autocast give torch.distributed's weights."""
    def train(backend: str) -> dict[str, torch.Tensor]:
        est = TorchEstimator(model=factory, feature_cols=[f"f{i}" for i in range(6)], label_col="label",
                             optimizer="sgd", lr=0.3, batch_size=4, epochs=2, num_workers=2, shuffle=False, seed=3,
                             lr_schedule="linear", warmup_steps=2, accumulate_steps=2, precision="bf16",
                             backend=backend, tracking=False, progress=False, strategy="data_parallel")
        model = est.fit(rows_df)
        assert model.history[-1]["lr"] == pytest.approx(0.0)  # linear decay to min_lr=0 at the last step
        return model.torch_module().state_dict()

    with_torch, with_horovod = train("torch"), train("horovod")
    for name in with_torch:
        assert torch.allclose(with_torch[name], with_horovod[name], atol=1e-4), name


def test_horovod_env_reaches_hvd_init_and_a_train_fn_may_shut_horovod_down(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """launch.horovod_env is in place before hvd.init() (the timeline it names gets written), and a
    script ending in hvd.shutdown() still returns rank 0's value instead of failing the run."""
    timeline = tmp_path / "timeline.json"

    def train_fn(ctx):  # type: ignore[no-untyped-def]
        import horovod.torch as hvd_in_task

        total = hvd_in_task.allreduce(torch.tensor([float(ctx.rank + 1)]), op=hvd_in_task.Sum)
        fusion = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        hvd_in_task.shutdown()  # what a Horovod script ends with
        return {"sum": float(total), "fusion": fusion}

    result = sparkdl.run(train_fn, num_workers=2, backend="horovod",
                         horovod_env={"HOROVOD_FUSION_THRESHOLD": 1 << 20, "HOROVOD_TIMELINE": str(timeline)})
    assert result == {"sum": 3.0, "fusion": str(1 << 20)}
    assert timeline.exists() and timeline.stat().st_size > 0
    with pytest.raises(ConfigError, match="sparkdl sets for Horovod's rendezvous"):
        sparkdl.run(train_fn, num_workers=2, backend="horovod", horovod_env={"HOROVOD_RANK": 0})


def test_two_ranks_on_one_host_get_distinct_local_ranks(spark) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        import horovod.torch as hvd_in_task

        total = torch.tensor([float(ctx.rank + 1)])
        ctx.comm.allreduce(total)
        mine = (hvd_in_task.rank(), hvd_in_task.local_rank(), hvd_in_task.local_size(), hvd_in_task.cross_rank(),
                ctx.world.hosts[ctx.rank])
        return {"sum": total.item(), "ranks": ctx.comm.allgather_object(mine)}

    result = sparkdl.run(train_fn, num_workers=2, backend="horovod")
    assert result["sum"] == 3.0
    ranks = sorted(result["ranks"])
    assert [r[0] for r in ranks] == [0, 1]
    assert ranks[0][4] == ranks[1][4]  # local-cluster: both executors on this host
    assert [r[1] for r in ranks] == [0, 1] and all(r[2] == 2 for r in ranks)


def test_a_failing_rank_is_a_clear_error_not_a_hang(rows_df) -> None:  # type: ignore[no-untyped-def]
    def train_fn(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 0:
            raise RuntimeError("rank zero gave up")
        ctx.comm.allreduce(torch.ones(4))  # the peer is gone: must end within the timeout

    with pytest.raises(TrainingError, match="rank 0: RuntimeError: rank zero gave up"):
        sparkdl.run(train_fn, df=rows_df, num_workers=2, backend="horovod", timeout_s=20,
                    peer_failure_delay_s=0.5)


def test_horovod_trains_token_sequences_with_weights_like_torch(spark) -> None:  # type: ignore[no-untyped-def]
    """Tensor columns on Horovod: int64 token ids in, per-position classes out, per-row weights,
    the same weights as torch.distributed after one epoch."""
    from pyspark.sql import functions as F

    from sparkdl.datasets import synthetic_tokens_dataframe
    from sparkdl_test_models import TOKEN_LEN, TOKEN_VOCAB, tiny_gpt

    df = synthetic_tokens_dataframe(spark, rows=128, seq_len=TOKEN_LEN, vocab=TOKEN_VOCAB, seed=2) \
        .withColumn("w", (F.element_at("tokens", 1) % 3).cast("double")).repartition(2).cache()

    def train(backend: str) -> dict[str, torch.Tensor]:
        model = TorchEstimator(model=tiny_gpt, input_cols=["tokens"], label_col="targets", weight_col="w",
                               optimizer="sgd", lr=0.3, batch_size=16, epochs=1, num_workers=2, shuffle=False, seed=3,
                               backend=backend, tracking=False, progress=False, strategy="data_parallel").fit(df)
        assert model.history[0]["steps"] == 4
        return model.torch_module().state_dict()

    with_torch, with_horovod = train("torch"), train("horovod")
    for name in with_torch:
        torch.testing.assert_close(with_torch[name], with_horovod[name], atol=1e-5, rtol=1e-5)


def test_streaming_diloco_fragments_with_quantized_syncs_on_horovod_match_torch(rows_df) -> None:  # type: ignore[no-untyped-def]
    """Horovod has no second process group (no overlap: fragment_sync_delay is refused) and no
    send/recv: its fragments' int8 syncs go by allgather + fp32 sum, torch's by a ring. Both land
    the same outer steps at the same inner steps: weights agree to the int8 rounding."""
    def train(backend: str, **extra: object) -> dict[str, torch.Tensor]:
        est = TorchEstimator(model=factory, feature_cols=[f"f{i}" for i in range(6)], label_col="label",
                             optimizer="sgd", lr=0.3, batch_size=4, epochs=2, num_workers=2, shuffle=False, seed=3,
                             strategy="data_parallel", sync="diloco", sync_every=4, fragments=2, sync_dtype="int8",
                             backend=backend, tracking=False, progress=False, **extra)
        return est.fit(rows_df).torch_module().state_dict()

    with_torch, with_horovod = train("torch"), train("horovod")
    for name in with_torch:
        assert torch.allclose(with_torch[name], with_horovod[name], atol=2e-2), name
    with pytest.raises(ConfigError, match="fragment_sync_delay=1 overlaps"):
        train("horovod", fragment_sync_delay=1)


def test_horovod_waits_are_measured_and_a_slow_rank_is_named(rows_df) -> None:  # type: ignore[no-untyped-def]
    from slow_rank import SlowOnRank

    # Horovod averages inside its DistributedOptimizer, outside the Communicator: its wait still counts.
    model = TorchEstimator(model=factory, feature_cols=[f"f{i}" for i in range(6)], label_col="label",
                           loss=SlowOnRank(rank=1, seconds=0.05), batch_size=8, epochs=1, num_workers=2,
                           backend="horovod", strategy="data_parallel", tracking=False, progress=False).fit(rows_df)
    record = model.history[-1]
    assert record["wait_seconds_by_rank"][0] > 0.15, record  # 5 steps, rank 0 waits ~0.05 s in each
    assert [entry["rank"] for entry in record["slow_ranks"]] == [1], record

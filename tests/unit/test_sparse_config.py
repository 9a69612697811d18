"""data.sparse_cols (sparkdl/config/sparse.py): both forms, shared tables, conflicts and errors,
through the real RunConfig entry points (keywords, TOML, --set)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sparkdl.config import RunConfig, SparseInput
from sparkdl.config.sparse import SparseTable, sparse_inputs
from sparkdl.errors import ConfigError


def _config(sparse_cols: object, **kwargs: object) -> RunConfig:
    return RunConfig.from_kwargs(feature_cols=("f0", "f1"), sparse_cols=sparse_cols, **kwargs).validate()


def test_python_and_toml_forms_resolve_alike(tmp_path: Path) -> None:
    listed = _config([SparseInput("user", num_rows=1000, dim=16),
                      SparseInput("tags", table="tag_table", num_rows=50, weights_col="tag_w", out_of_range="refuse")])
    path = tmp_path / "run.toml"
    path.write_text('[data]\nfeature_cols = ["f0", "f1"]\n'
                    '[data.sparse_cols.user]\nnum_rows = 1000\ndim = 16\n'
                    '[data.sparse_cols.tags]\ntable = "tag_table"\nnum_rows = 50\nweights_col = "tag_w"\n'
                    'out_of_range = "refuse"\n', encoding="utf-8")
    from_toml = RunConfig.from_toml(path)
    a, b = sparse_inputs(listed.data.sparse_cols), sparse_inputs(from_toml.data.sparse_cols)
    assert a == b
    assert a is not None
    assert a.tables == (SparseTable("user", 1000, 16, ("user",)), SparseTable("tag_table", 50, None, ("tags",)))
    assert a.inputs[1].table == "tag_table" and a.inputs[1].out_of_range == "refuse"
    assert a.columns == ("user", "tags", "tag_w")
    # a list from keywords is kept as a tuple (frozen configs), and logs as plain values
    assert isinstance(listed.data.sparse_cols, tuple)
    assert listed.flat()["data.sparse_cols"][0] == {"column": "user", "table": None, "num_rows": 1000, "dim": 16,
                                                    "weights_col": None, "out_of_range": "hash"}


def test_a_shared_table_is_sized_once() -> None:
    resolved = sparse_inputs({"item": {"table": "items", "num_rows": 500, "dim": 8},
                              "clicked_item": "items", "viewed": {"table": "items", "num_rows": 500}})
    assert resolved is not None
    assert resolved.tables == (SparseTable("items", 500, 8, ("item", "clicked_item", "viewed")),)
    assert [(i.column, i.table, i.num_rows, i.dim) for i in resolved.inputs] == \
        [("item", "items", 500, 8), ("clicked_item", "items", 500, 8), ("viewed", "items", 500, 8)]


def test_set_override_declares_a_column() -> None:
    config = RunConfig.from_kwargs(feature_cols=("f0",)).with_overrides(['data.sparse_cols={page = {num_rows = 7}}']).validate()
    resolved = sparse_inputs(config.data.sparse_cols)
    assert resolved is not None and resolved.table("page").num_rows == 7


@pytest.mark.parametrize("sparse_cols, pattern", [
    ({"a": {"table": "t", "num_rows": 10}, "b": {"table": "t", "num_rows": 20}},
     r"table 't' is declared with num_rows=10 by column 'a' and num_rows=20 by column 'b'"),
    ({"a": {"table": "t", "num_rows": 10, "dim": 4}, "b": {"table": "t", "dim": 8}},
     r"table 't' is declared with dim=4 by column 'a' and dim=8 by column 'b'"),
    ({"a": "t", "b": "t"}, r"table 't' \(used by 'a', 'b'\) has no num_rows"),
    ({"a": {"num_rows": 0}}, r"data.sparse_cols\['a'\].num_rows must be a positive integer, got 0"),
    ({"a": {"num_rows": True}}, r"num_rows must be a positive integer, got True"),
    ({"a": {"num_rows": 10, "dim": -1}}, r"data.sparse_cols\['a'\].dim must be a positive integer"),
    ({"a": {"num_rows": 10, "out_of_range": "clip"}}, r"out_of_range must be one of 'hash', 'refuse'"),
    ({"a": {"num_rows": 10, "num_row": 3}}, r"unknown option data.sparse_cols\['a'\].num_row"),
    ({"a": {"num_rows": 10, "weights_col": "a"}}, r"weights_col is the id column itself"),
    ({"a": {"num_rows": 10, "weights_col": "b"}, "b": {"num_rows": 10}}, r"'b' is itself a sparse column"),
    ({"a": {"num_rows": 10, "weights_col": "w"}, "b": {"num_rows": 10, "weights_col": "w"}},
     r"columns 'a' and 'b' both weigh by 'w'"),
    ({}, r"data.sparse_cols is empty"),
    ({"a": 3}, r"must be a table name or a table of options"),
    ("user", r"data.sparse_cols must be a table"),
    (["user"], r"data.sparse_cols holds 'user', not a SparseInput"),
    ((SparseInput("a", num_rows=3), SparseInput("a", num_rows=3)), r"declares column 'a' twice"),
])
def test_bad_declarations_are_refused_naming_the_fix(sparse_cols: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        _config(sparse_cols)
    assert info.value.hint


def test_unknown_option_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError) as info:
        _config({"a": {"num_row": 3}})
    assert "did you mean 'num_rows'" in str(info.value)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"sparse_cols": {"f0": {"num_rows": 3}}}, r"column 'f0' is both in data.sparse_cols and in data.feature_cols"),
    ({"sparse_cols": {"label": {"num_rows": 3}}}, r"reads column 'label', which is also data.label_col"),
    ({"sparse_cols": {"a": {"num_rows": 3, "weights_col": "w"}}, "weight_col": "w"},
     r"reads column 'w', which is also data.weight_col"),
])
def test_sparse_columns_are_no_other_column(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        RunConfig.from_kwargs(feature_cols=("f0", "f1"), **kwargs).validate()


def test_input_cols_runs_are_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"column 'q' is both in data.sparse_cols and in data.input_cols"):
        RunConfig.from_kwargs(input_cols={"query": "q"}, sparse_cols={"q": {"num_rows": 3}}).validate()
    with pytest.raises(ConfigError, match="goes with feature_cols"):
        RunConfig.from_kwargs(input_cols=["pixels"], sparse_cols={"user": {"num_rows": 3}}).validate()


def test_sparse_runs_train_with_the_embeddings_strategy_and_refuse_what_it_cannot_do() -> None:
    ok = RunConfig.from_kwargs(feature_cols=[], sparse_cols={"user": {"num_rows": 3}}, embedding_lr=0.05,
                               embedding_optimizer="adam", embedding_staleness=2).validate()
    assert ok.embeddings.embedding_lr == 0.05 and ok.train.strategy == "auto"
    assert RunConfig.from_kwargs(feature_cols=["f"], sparse_cols={"u": {"num_rows": 3}},
                                 strategy="embeddings").validate().train.strategy == "embeddings"
    with pytest.raises(ConfigError, match="data.feature_cols is empty"):
        RunConfig.from_kwargs(feature_cols=[]).validate()
    with pytest.raises(ConfigError, match="not train.strategy='hybrid'"):
        RunConfig.from_kwargs(feature_cols=["f"], sparse_cols={"u": {"num_rows": 3}}, strategy="hybrid").validate()
    with pytest.raises(ConfigError, match="data.sparse_cols is not set"):
        RunConfig.from_kwargs(feature_cols=["f"], strategy="embeddings").validate()
    for option, value in (("accumulate_steps", 2), ("precision", "bf16"), ("nonfinite_loss", "skip"),
                          ("backend", "horovod"), ("gpus_per_worker", 1), ("sync_dtype", "int8")):
        with pytest.raises(ConfigError, match="not supported with data.sparse_cols"):
            RunConfig.from_kwargs(feature_cols=["f"], sparse_cols={"u": {"num_rows": 3}}, checkpoint_dir="/tmp/c",
                                  **{option: value}).validate()
    elastic = RunConfig.from_kwargs(feature_cols=["f"], sparse_cols={"u": {"num_rows": 3}}, checkpoint_dir="/tmp/c",
                                    min_workers=1).validate()  # shards are re-cut for the new size
    assert elastic.launch.min_workers == 1
    for option, value in (("embedding_optimizer", "sgd"), ("embedding_lr", -1.0), ("embedding_staleness", -1),
                          ("embedding_eps", float("nan"))):
        with pytest.raises(ConfigError, match=f"embeddings.{option}"):
            RunConfig.from_kwargs(feature_cols=["f"], sparse_cols={"u": {"num_rows": 3}}, **{option: value}).validate()


def test_unset_means_no_sparse_inputs() -> None:
    assert RunConfig.from_kwargs(feature_cols=("f0",)).validate().data.sparse_cols is None
    assert sparse_inputs(None) is None

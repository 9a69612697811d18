"""The tensor-column DataFrames of sparkdl.datasets: schema and values as the array builders make them."""
from __future__ import annotations

import numpy as np


def test_digits_images_dataframe_has_pixels_png_and_label(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.datasets import decode_digit_png, digits_images_dataframe, load_digits

    df = digits_images_dataframe(spark, indices=np.array([5, 0, 7]))
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
        ("pixels", "array<float>"), ("png", "binary"), ("label", "bigint")]
    rows = df.collect()
    counts, labels = load_digits()
    assert [r["label"] for r in rows] == labels[[5, 0, 7]].tolist()
    np.testing.assert_allclose(np.array([r["pixels"] for r in rows]), counts[[5, 0, 7]] / 16, atol=1e-7)
    decoded = decode_digit_png({"png": [r["png"] for r in rows]})["png"]
    np.testing.assert_allclose(decoded.reshape(3, 64), np.array([r["pixels"] for r in rows]), atol=0.5 / 255 + 1e-6)


def test_token_dataframes_hold_int_arrays(spark) -> None:  # type: ignore[no-untyped-def]
    from sparkdl.datasets import synthetic_tokens_dataframe, text_tokens_dataframe

    synthetic = synthetic_tokens_dataframe(spark, rows=8, seq_len=5, vocab=16)
    text = text_tokens_dataframe(spark, seq_len=6, max_rows=10)
    for df, length in ((synthetic, 5), (text, 6)):
        assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
            ("tokens", "array<int>"), ("targets", "array<int>")]
        rows = df.collect()
        assert all(len(r["tokens"]) == len(r["targets"]) == length for r in rows)
        assert all(r["tokens"][1:] == r["targets"][:-1] for r in rows)
    assert synthetic.count() == 8 and text.count() == 10

"""Images in a DataFrame: a small CNN on the 8x8 digits, stored as PNG bytes and decoded on the executors.

    python examples/cnn_images.py [--master local[2]] [--epochs 8] [--input png|pixels]

`--input png` (the default) reads the binary column `png` and decodes each batch on the executors with
`transform_fn=decode_digit_png` (a module-level function: it pickles by reference); `--input pixels`
reads the array<float> column `pixels` and reshapes each row to 1x8x8 with `input_shapes`. Either
way the model sees float32 (B, 1, 8, 8) batches; transform() applies the same input handling.
"""
from __future__ import annotations

import argparse
import time

from pyspark.sql import SparkSession
from torch import nn

from sparkdl import TorchEstimator
from sparkdl.datasets import decode_digit_png, digits_images_dataframe, train_test_split_digits


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 4 x 4
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--input", choices=("png", "pixels"), default="png")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    spark = SparkSession.builder.master(args.master).getOrCreate()  # an active session (notebook) wins
    train_idx, test_idx = train_test_split_digits(seed=0)
    train = digits_images_dataframe(spark, indices=train_idx)
    test = digits_images_dataframe(spark, indices=test_idx)
    if args.input == "png":
        inputs = dict(input_cols=["png"], transform_fn=decode_digit_png)
    else:
        inputs = dict(input_cols=["pixels"], input_shapes={"pixels": [1, 8, 8]})

    started = time.perf_counter()
    model = TorchEstimator(model=cnn, **inputs, label_col="label", strategy="data_parallel", optimizer="adam",
                           lr=3e-3, batch_size=32, epochs=args.epochs, num_workers=args.workers, seed=0,
                           progress=False).fit(train)
    seconds = time.perf_counter() - started
    rows = model.transform(test).select("label", "prediction").collect()
    accuracy = sum(r["label"] == r["prediction"] for r in rows) / len(rows)
    print(f"CNN on {args.input} input: loss {model.history[-1]['loss']:.4f}, test accuracy {accuracy:.3f} "
          f"({len(rows)} images), fit {seconds:.1f} s")
    return {"test_accuracy": accuracy, "seconds": seconds, "history": model.history}


if __name__ == "__main__":
    main()

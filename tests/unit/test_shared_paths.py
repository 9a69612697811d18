"""Which paths the shared-directory check applies to (sparkdl/storage/shared_paths.py); the check itself
runs on the multi-host bed (tests/spark/test_multihost.py), where hosts have their own disks."""
from __future__ import annotations

from sparkdl.storage.shared_paths import is_cluster_master, local_directory


def test_only_local_paths_are_checked() -> None:
    assert local_directory("/mnt/ckpt") == "/mnt/ckpt"
    assert local_directory("relative/dir") == "relative/dir"
    assert local_directory("file:///mnt/ckpt") == "/mnt/ckpt"
    assert local_directory("file:/mnt/ckpt") == "/mnt/ckpt"
    for remote in ("s3://bucket/ckpt", "gs://b/c", "hdfs://nn:8020/c", "dbfs:/ckpt", "abfss://c@a.dfs/x"):
        assert local_directory(remote) is None, remote
    assert local_directory(None) is None and local_directory("") is None


def test_local_masters_share_one_disk_and_are_not_checked() -> None:
    assert not is_cluster_master("local[2]") and not is_cluster_master("local-cluster[2,1,1024]")
    assert not is_cluster_master("local")
    assert is_cluster_master("spark://198.18.0.2:7077") and is_cluster_master("yarn")
    assert is_cluster_master("k8s://https://api:6443")

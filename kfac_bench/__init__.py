"""kfac-bench: distributed K-FAC engine and benchmark harness."""

"""User-facing benchmarks (`moeserve bench serve | decode | prefill | protocol | churn | tp_decode`): each prints a
table and writes JSON under --out. Nothing else in the package imports them. The kernel and collective
micro-benchmarks are developer tools outside the package: benchmarks/kernels/ in the repository."""

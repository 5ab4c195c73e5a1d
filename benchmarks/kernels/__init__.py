"""Developer benchmarks of the kernels and collectives (not installed with the package; run from a clone, from the
repository root: `python -m benchmarks.kernels.<name>`). They may call private kernel functions; the package
never imports them."""

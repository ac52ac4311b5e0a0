"""Commands around the method: the benchmark, its shipped summary, the asset builder and the trace recorder."""

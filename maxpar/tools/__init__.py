"""Developer tools beside the training spine: benchmarks, golden shardings, simulated devices."""

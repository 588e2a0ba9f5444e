"""Developer tools, built on the training loop: benchmarks, golden shardings, measurement records and their page."""

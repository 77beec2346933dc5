"""Plan: model config, hardware specs, deployment matrix, per-rank problems. Imports nothing else of k3tune
but its errors and shipped-data locations."""

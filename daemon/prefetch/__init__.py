"""Prefetch: the next-layer predictor and the prefetcher that reads its experts ahead."""

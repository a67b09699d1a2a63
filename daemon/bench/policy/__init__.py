"""Offline replay of routing traces through every eviction policy and Belady's MIN."""

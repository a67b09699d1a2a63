"""Reliability: the soak driver, protocol fuzzing, kill -9 of heat writers."""

"""The mapped pool: every expert in host memory, the hottest in GPU memory, routed experts gathered per step."""

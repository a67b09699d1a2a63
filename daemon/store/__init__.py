"""The expert store: `convert` writes it from an mlx-lm model folder; the layout and
manifest are defined in `moestream.shared.store_format`."""

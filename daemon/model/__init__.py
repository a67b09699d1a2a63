"""The model side of the engine: the streaming model and its loading, the streaming MoE
layer, generation, speculative decoding, diagnostics."""

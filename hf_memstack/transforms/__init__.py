"""What prepare_model applies to a model, one module per transformation."""

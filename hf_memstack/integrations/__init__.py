"""Integrations with training frameworks (Transformers Trainer)."""

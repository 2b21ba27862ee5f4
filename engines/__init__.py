"""Inference engines built on the Holdfast SDK: the reference transformer engine and adapters."""

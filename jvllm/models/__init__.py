"""The model families, one file each, registered by their HF architectures name (registry.py)."""

"""Saving and loading model state."""

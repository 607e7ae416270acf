"""Lowering: routing plans to tile task graphs (forward and backward)."""

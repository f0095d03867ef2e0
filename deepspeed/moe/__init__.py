# compat: upstream `deepspeed.moe`.
"""Mixture of Experts: the names code imports (upstream's test models do, at module level)."""

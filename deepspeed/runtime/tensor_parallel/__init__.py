"""Upstream's `deepspeed.runtime.tensor_parallel` path; AutoTP lives in deepspeed/module_inject."""

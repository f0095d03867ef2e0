# compat: upstream package deepspeed.runtime.fp16; the scalers live in deepspeed.runtime.precision.

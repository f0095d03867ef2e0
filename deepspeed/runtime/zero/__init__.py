"""ZeRO: the sharding core shared by stages 1-3 (stage 3 to come)."""

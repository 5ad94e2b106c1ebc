"""Scale-out helpers: span-aware routing (host only) and Ray Data replicas (optional `ray` extra).

`ray_data` is imported on use only, so `minipic_jax.distributed.routing` works without ray.
"""

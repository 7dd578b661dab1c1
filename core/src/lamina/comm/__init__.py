"""Layer 2, communication scheduling: gradient buckets planned from the static graph."""

from lamina.comm.buckets import Bucket, BucketPlan, BucketSlot, ParamSpec, plan_buckets

__all__ = ["Bucket", "BucketPlan", "BucketSlot", "ParamSpec", "plan_buckets"]

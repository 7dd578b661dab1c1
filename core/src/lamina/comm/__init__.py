"""Layer 2, communication scheduling: gradient buckets planned from the static graph."""

from lamina.comm.buckets import (
    Bucket,
    BucketPlan,
    BucketSlot,
    ParamSpec,
    auto_bucket_cap,
    plan_buckets,
)

__all__ = ["Bucket", "BucketPlan", "BucketSlot", "ParamSpec", "auto_bucket_cap", "plan_buckets"]

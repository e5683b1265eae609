"""The memory planner (S1.4-S1.5, S2.2, S3.2-S3.4): profile, memory model, plan, estimates.

Plain functions over measured figures; it knows nothing of job files or gRPC, so the
coordinator's planning step and ``pstrain plan`` call it with what they parsed.
"""

"""What all three services share at run time and is not part of the wire contract.

Transport (servers, channels, status mapping), security (mTLS, token), the member-process
lifecycle, job-spec factories, the flat parameter layout, the shard map, the optimizer
registry, the LR schedule, the PS client, atomic file writes, logging and metrics. The
services depend on this package and ``pstrain.protos``, never on each other.
"""

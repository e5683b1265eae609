"""pstrain coordinator: the job file, the plan, membership, data shards and the job's end.

``job.Job`` holds the protocol as a plain object; ``service`` adapts it to gRPC; ``main``
runs ``pstrain-coordinator``; ``local_cluster`` runs a whole cluster on localhost.
"""

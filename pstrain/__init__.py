"""pstrain: distributed PyTorch training with a sharded CPU parameter server over gRPC.

The repository keeps one folder per part of the design, installed under this one name:

=====================  ==========================================================
``pstrain.protos``     the wire contract: ``pstrain.proto``, its generated code, the tensor codec
``pstrain.runtime``    what every service shares: transport, security, member lifecycle,
                       factories, the flat parameter layout, shard map, optimizer registry
``pstrain.ps_server``  one parameter-server shard (``pstrain-ps``)
``pstrain.worker``     the worker of one host and its devices (``pstrain-worker``)
``pstrain.coordinator`` the job: plan, membership, data shards, export (``pstrain-coordinator``)
``pstrain.planner``    the memory planner: profiler, memory model, S2.2 estimates
``pstrain.launcher``   the ``pstrain`` command: ``pstrain local``, ``pstrain plan``
=====================  ==========================================================
"""

__version__ = "0.2.0"

"""The pstrain wire contract: ``pstrain.proto``, the code generated from it, and the tensor codec.

Nothing else lives here: what the services share at run time is ``pstrain.runtime``.
"""

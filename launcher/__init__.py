"""The user's command ``pstrain``: ``pstrain local`` runs a whole cluster on localhost, ``pstrain plan``
prints the plan. It drives the services as processes and uses only their public entry points."""

"""What crosses Redis between the API tier and the engine workers: key names and JSON messages.

Tiny and dependency-free (stdlib only) so both ``api`` (no torch) and ``worker`` import it.
"""

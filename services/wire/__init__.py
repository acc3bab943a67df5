"""gRPC plumbing every service shares: server, client, auth, metrics, errors.

Importing this package itself is free; its modules import grpc when used.
"""

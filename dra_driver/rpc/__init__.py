"""The kubelet-facing gRPC server: HTTP/2 and gRPC's unary and server-streaming calls on a unix socket.

Why our own and not grpcio's server: on a small node a grpc.aio server spends ~0.4 ms of
CPU per call before a handler runs, which was most of a Prepare and made 16 concurrent
calls queue behind one another (benchmarks/prepare.py; figures in the README).
The kubelet is the only client (one grpc-go connection per plugin, root-only socket),
so the server implements what that client uses and answers everything else with a clear
error. Clients (the liveness probe, the tests) still use grpcio.
"""

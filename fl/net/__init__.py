"""The network edge: everything that opens a socket or guards one.

Certificates, node keys and allow-lists for deployments (`tls`), the Fleet-only gate in
front of a SuperLink (`gate`), and the bulk side channel that carries large tensors over
gRPC streams or NIXL/RDMA beside Flower's own messages (`transport`).
"""

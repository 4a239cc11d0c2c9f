"""Generated protobuf and gRPC code for kvtier.v1 (see scripts/gen_proto.py)."""

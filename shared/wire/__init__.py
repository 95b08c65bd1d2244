"""The wire: payload codec, chunking, checksums and byte accounting.

The generated protobuf modules (fedattn_pb2*.py) are produced by scripts/gen_proto.py.
"""

"""Short names for the generated protobuf modules (see ``scripts/generate_proto.py``)."""

from meshnode.gen.meshnet.shard.v1 import shard_runtime_pb2 as shard
from meshnode.gen.meshnode.v1 import mesh_pb2 as mesh

__all__ = ["mesh", "shard"]

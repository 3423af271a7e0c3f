"""Tensor bundle codec throughput against a plain bytes copy measured in the same run.

    python bench/codec.py [--seconds 0.5]

For each size (8 KiB: one decode step at n_embd 4096 in bfloat16; 1 MiB; 8 MiB)
it measures, from array to serialized bundle bytes ("encode") and from received
bundle bytes to a verified array ("decode+verify": the bundle read in place,
fragment tiling proof, CRC32C over the uncompressed bytes, zstd when used: what
the data plane's worker does with a received activation chunk), and prints
each as GB/s and as a ratio to copying the same number of bytes. For comparison
it also measures decoding through protobuf objects ("pb decode+verify": what a
receiver that parses the whole message with the protobuf runtime pays, two copies
of every payload) and the checksum alone ("crc32c").
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from meshnode.wire.crc32c import crc32c, simd_in_use
from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import decode_bundle, decode_bundle_bytes, encode_bundle, encode_tensor

SIZES = [("8 KiB", 8 * 1024), ("1 MiB", 1024 * 1024), ("8 MiB", 8 * 1024 * 1024)]


def throughput(fn: Callable[[], object], nbytes: int, seconds: float) -> float:
    """Best-of-5 bytes/second over batches that each run for about seconds/5."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds / 5:
            break
        calls *= 2
    best = elapsed
    for _ in range(4):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return nbytes * calls / best


def activations(nbytes: int) -> np.ndarray:
    # Smooth activations, not random bytes: zstd should see realistic float data.
    count = nbytes // 2
    values = np.sin(np.arange(count, dtype=np.float32) * 0.01).astype(np.float32)
    bits = values.view(np.uint32) >> np.uint32(16)
    return bits.astype(np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=0.5, help="time budget per measurement")
    args = parser.parse_args()

    checksum = "meshnode's AVX2+VPCLMULQDQ extension" if simd_in_use() else "google-crc32c"
    print(f"CRC32C by {checksum}")
    print(f"{'size':>6} {'compression':>11} {'op':>16} {'GB/s':>7} {'memcpy GB/s':>11} {'ratio':>6}")
    for label, nbytes in SIZES:
        source = np.random.default_rng(0).bytes(nbytes)
        memcpy = throughput(lambda source=source: bytearray(source), nbytes, args.seconds)
        rate = throughput(lambda source=source: crc32c(source), nbytes, args.seconds)
        print(
            f"{label:>6} {'-':>11} {'crc32c':>16} {rate / 1e9:7.2f} {memcpy / 1e9:11.2f} {rate / memcpy:5.2f}x"
        )
        array = activations(nbytes)
        for compression in (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD):

            def encode(array=array, compression=compression) -> bytes:
                tensor = encode_tensor("hidden_states", shard.DTYPE_BFLOAT16, array, compression=compression)
                return encode_bundle([tensor]).SerializeToString()

            wire = encode()

            def decode(wire=wire) -> object:
                return decode_bundle_bytes(wire)

            def decode_pb(wire=wire) -> object:
                return decode_bundle(shard.TensorBundle.FromString(wire))

            assert decode()["hidden_states"].array.tobytes() == array.tobytes()
            assert decode_pb()["hidden_states"].array.tobytes() == array.tobytes()
            name = shard.Compression.Name(compression).removeprefix("COMPRESSION_").lower()
            for op, fn in (("encode", encode), ("decode+verify", decode), ("pb decode+verify", decode_pb)):
                rate = throughput(fn, nbytes, args.seconds)
                print(
                    f"{label:>6} {name:>11} {op:>16} {rate / 1e9:7.2f} {memcpy / 1e9:11.2f} "
                    f"{rate / memcpy:5.2f}x"
                )


if __name__ == "__main__":
    main()

"""Tensor bundle codec throughput against a plain bytes copy measured in the same run.

    python bench/codec.py [--seconds 0.5]

For each size (8 KiB: one decode step at n_embd 4096 in bfloat16; 1 MiB; 8 MiB)
it measures, from array to serialized bundle bytes ("encode") and from received
bundle bytes to a verified array ("decode+verify": protobuf parse, fragment
tiling proof, CRC32C over the uncompressed bytes, zstd when used: what the
data plane's worker does with a received chunk), and prints
each as GB/s and as a ratio to copying the same number of bytes.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from meshnode.wire.pb import shard
from meshnode.wire.tensor_codec import decode_bundle, encode_bundle, encode_tensor

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

    print(f"{'size':>6} {'compression':>11} {'op':>14} {'GB/s':>7} {'memcpy GB/s':>11} {'ratio':>6}")
    for label, nbytes in SIZES:
        source = np.random.default_rng(0).bytes(nbytes)
        memcpy = throughput(lambda source=source: bytearray(source), nbytes, args.seconds)
        array = activations(nbytes)
        for compression in (shard.COMPRESSION_NONE, shard.COMPRESSION_ZSTD):

            def encode(array=array, compression=compression) -> bytes:
                tensor = encode_tensor("hidden_states", shard.DTYPE_BFLOAT16, array, compression=compression)
                return encode_bundle([tensor]).SerializeToString()

            wire = encode()

            def decode(wire=wire) -> object:
                return decode_bundle(shard.TensorBundle.FromString(wire))

            assert decode()["hidden_states"].array.tobytes() == array.tobytes()
            name = shard.Compression.Name(compression).removeprefix("COMPRESSION_").lower()
            for op, fn in (("encode", encode), ("decode+verify", decode)):
                rate = throughput(fn, nbytes, args.seconds)
                print(
                    f"{label:>6} {name:>11} {op:>14} {rate / 1e9:7.2f} {memcpy / 1e9:11.2f} "
                    f"{rate / memcpy:5.2f}x"
                )


if __name__ == "__main__":
    main()

"""meshnode: pool machines to run one large language model.

Each node serves a contiguous layer range of a GGUF model through llama.cpp and
passes activations to the next node over QUIC (ALPN ``mesh-llm/1``), or through
a relay when it sits behind NAT.
"""

__version__ = "0.1.0"

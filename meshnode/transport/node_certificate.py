"""The certificates a node shows its peers, all of them made with its own Ed25519 key.

A node id is the raw Ed25519 public key, and every certificate here carries that key
and is signed with it, so a handshake's CertificateVerify proves possession of the key
and :func:`certificate_node_id` reads the authenticated node id straight out of the
peer's certificate. Nothing else in a certificate is trusted.

* QUIC links: :func:`self_signed_certificate`. aioquic lets the verifier skip chain
  validation, so a self-signed certificate is all it needs.
* The TLS-over-TCP bulk lane (:mod:`meshnode.transport.tls_lane`): OpenSSL, as Python's
  ``ssl`` drives it, asks for a client certificate only when it validates the chain,
  and has no callback to accept a key instead. So there each node shows a certificate
  *issued* under a name made of its node id (:func:`lane_certificate`), and the
  verifier builds, from a node id it would accept, a trust anchor with that name and
  that key (:func:`trust_anchor`). OpenSSL then checks the shown certificate's signature
  with the anchor's key, which only the holder of the node key can satisfy; it never
  checks an anchor's own signature (not unless ``X509_V_FLAG_CHECK_SS_SIGNATURE``), so
  the verifier signs anchors with a key of its own. After the handshake the key is still
  compared with the node id expected, as on QUIC.
"""

from __future__ import annotations

import datetime
import functools

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from meshnode.identity import NodeIdentity, public_key_bytes

# Certificates are never checked for dates by the QUIC side (the key is what is pinned), but
# a sane validity window keeps generic TLS tooling quiet and satisfies OpenSSL on the bulk lane.
_CERT_VALIDITY = datetime.timedelta(days=3650)
# Anchors are built by the verifier and never leave it: their window only has to cover any
# certificate a node shows.
_ANCHOR_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_ANCHOR_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)
_NODE_ORGANIZATION = "meshnode node"


def self_signed_certificate(identity: NodeIdentity) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshnode {identity.short_id}")])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + _CERT_VALIDITY)
        .sign(identity.private_key, algorithm=None)
    )


def node_name(node_id: bytes) -> x509.Name:
    """The issuer name of ``node_id``'s bulk-lane certificate and the subject of its anchor."""
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _NODE_ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, node_id.hex()),
        ]
    )


def lane_certificate(identity: NodeIdentity) -> x509.Certificate:
    """The node's certificate on the bulk lane: its key, issued (and signed) under its node id's name."""
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshnode {identity.short_id}")])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(node_name(identity.node_id))
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + _CERT_VALIDITY)
        .sign(identity.private_key, algorithm=None)
    )


@functools.cache
def _anchor_signer() -> Ed25519PrivateKey:
    # Any key will do (OpenSSL does not check an anchor's signature); one per process.
    return Ed25519PrivateKey.generate()


def trust_anchor(node_id: bytes) -> x509.Certificate:
    """A trust anchor that accepts exactly the certificates signed by ``node_id``'s key under its name."""
    name = node_name(node_id)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(Ed25519PublicKey.from_public_bytes(node_id))
        .serial_number(1)
        .not_valid_before(_ANCHOR_NOT_BEFORE)
        .not_valid_after(_ANCHOR_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(_anchor_signer(), algorithm=None)
    )


def certificate_node_id(certificate: x509.Certificate) -> bytes | None:
    """The raw Ed25519 key of ``certificate`` (the node id it authenticates), or ``None``."""
    key = certificate.public_key()
    if not isinstance(key, Ed25519PublicKey):
        return None
    return public_key_bytes(key)


__all__ = [
    "certificate_node_id",
    "lane_certificate",
    "node_name",
    "self_signed_certificate",
    "trust_anchor",
]

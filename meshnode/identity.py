"""Node identity: one Ed25519 key pair per node, kept in the node's data directory.

The node id is the 32-byte raw public key. QUIC certificates are self-signed with
the same key, so the transport authenticates node ids directly (see
``meshnode.transport.tls``). Humans see :func:`short_id`, a base32 prefix.

Secret files are created with mode 0600 from the start (never chmod-ed after a
world-readable write) and replaced atomically.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

NODE_ID_BYTES = 32
SIGNATURE_BYTES = 64
NODE_KEY_FILE = "node_key.pem"
DATA_DIR_ENV = "MESHNODE_DATA_DIR"
SHORT_ID_CHARS = 12


class IdentityError(Exception):
    """The data directory holds no usable identity (missing, corrupt, wrong permissions)."""


def default_data_dir() -> Path:
    """``$MESHNODE_DATA_DIR``, else ``$XDG_DATA_HOME/meshnode``, else ``~/.local/share/meshnode``."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "meshnode"


def short_id(node_id: bytes) -> str:
    """A short, printable, case-insensitive form of a 32-byte id (for logs and humans)."""
    return base64.b32encode(node_id).decode("ascii").lower()[:SHORT_ID_CHARS]


def ensure_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def write_private_file(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``, readable by the owner only."""
    ensure_private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is filtered by umask; be explicit
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        # A write on a descriptor names no file: say which one could not be written.
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_private_file(path: Path) -> bytes:
    """Read a secret file, refusing one that others can read."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise IdentityError(f"{path} is readable by others (mode {mode:o}); expected 0600")
    return path.read_bytes()


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_key_seed(key: Ed25519PrivateKey) -> bytes:
    """The 32-byte seed; handle as a secret."""
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``."""
    if len(public_key) != NODE_ID_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True, repr=False)
class NodeIdentity:
    private_key: Ed25519PrivateKey
    node_id: bytes

    @classmethod
    def generate(cls) -> NodeIdentity:
        key = Ed25519PrivateKey.generate()
        return cls(private_key=key, node_id=public_key_bytes(key))

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeIdentity:
        key = Ed25519PrivateKey.from_private_bytes(seed)
        return cls(private_key=key, node_id=public_key_bytes(key))

    @property
    def short_id(self) -> str:
        return short_id(self.node_id)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def __repr__(self) -> str:  # never print the key
        return f"NodeIdentity({self.short_id})"


def node_key_path(data_dir: Path) -> Path:
    return data_dir / NODE_KEY_FILE


def load_identity(data_dir: Path) -> NodeIdentity:
    path = node_key_path(data_dir)
    if not path.exists():
        raise IdentityError(f"no node identity in {data_dir} (run `meshnode init`)")
    try:
        key = serialization.load_pem_private_key(read_private_file(path), password=None)
    except ValueError as exc:
        raise IdentityError(f"{path} is not a PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} is not an Ed25519 key")
    return NodeIdentity(private_key=key, node_id=public_key_bytes(key))


def create_identity(data_dir: Path) -> NodeIdentity:
    """Create a new identity; refuses to overwrite an existing one."""
    path = node_key_path(data_dir)
    if path.exists():
        raise IdentityError(f"{path} already exists")
    identity = NodeIdentity.generate()
    write_private_file(path, identity.to_pem())
    return identity


def load_or_create_identity(data_dir: Path) -> tuple[NodeIdentity, bool]:
    """The identity in ``data_dir``, creating it on first use; the flag says it was created."""
    if node_key_path(data_dir).exists():
        return load_identity(data_dir), False
    return create_identity(data_dir), True


__all__ = [
    "NODE_ID_BYTES",
    "IdentityError",
    "NodeIdentity",
    "create_identity",
    "default_data_dir",
    "load_identity",
    "load_or_create_identity",
    "private_key_seed",
    "public_key_bytes",
    "read_private_file",
    "short_id",
    "verify_signature",
    "write_private_file",
]

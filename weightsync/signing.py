"""Signed versions for buckets that others can write (Ed25519, the ``cryptography`` library).

The trainer signs every manifest and every ``latest.json`` it writes; a reader configured with
trusted public keys refuses a manifest or pointer that is unsigned, signed by another key, or
altered after signing (:class:`UnsignedVersionError`, :class:`BadSignatureError`), before it
fetches any object of that version. Without trusted keys a reader accepts both, as before.

The signature covers the manifest, and the manifest binds the bytes of each object by its
SHA-256 (``ObjectRef.sha256``, and every part's for a sharded object), which the reader checks
before decoding: a reader with trusted keys refuses a signed manifest whose objects lack it
(:class:`UnhashedObjectError`). The xxh3-128 next to it is not enough on its own: xxh3 is not a
cryptographic hash, and a block of an object can be replaced by other bytes with the same
xxh3-128. Tensor and state digests stay xxh3: they catch accidental damage, and they sit inside
the signed manifest and the SHA-256-bound objects.

What is signed: the JSON document without its ``"signature"`` member, canonicalized as
``json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` in UTF-8, so
the signature does not depend on how the writer formatted the file. The member is
``{"key_id": <16 hex digits: first 8 bytes of SHA-256 of the raw public key>, "ed25519":
<base64 of the 64-byte signature>}``.

Keys: a private key file holds the 32-byte Ed25519 seed as 64 hex digits (``deltarl delta
keygen`` writes one, mode 0600, and prints the public key); a public key is given as 64 hex
digits. Rotation: give the readers both the old and the new public key, switch the trainer to
the new private key, and drop the old public key once no version signed by it is still needed
(after the next anchor has become every reader's starting point).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from deltarl.weightsync.errors import CorruptDeltaError

if TYPE_CHECKING:
    from deltarl.weightsync.manifest import ObjectRef

SIGNATURE = "signature"


class UnsignedVersionError(CorruptDeltaError):
    """A reader that trusts keys met a manifest or pointer without a signature."""


class BadSignatureError(CorruptDeltaError):
    """A signature by an untrusted key, or one that does not match the document."""


class UnhashedObjectError(CorruptDeltaError):
    """A signed manifest with an object (or part) whose SHA-256 is not recorded: its signature
    would not bind that object's bytes (a trainer that predates ``ObjectRef.sha256``)."""


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(public)).hexdigest()[:16]


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The signed bytes of ``doc``: every member but the signature, canonical JSON."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _hex32(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{what} must be 64 hexadecimal digits (32 bytes)")
    return raw


class Signer:
    """The trainer's signing key."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key()
        self.key_id = key_id(self.public)

    @classmethod
    def from_file(cls, path: str | Path) -> Signer:
        """Read a key written by :func:`generate_key` (64 hex digits of seed)."""
        text = Path(path).read_text()
        return cls(Ed25519PrivateKey.from_private_bytes(_hex32(text, f"private key {path}")))

    @property
    def public_hex(self) -> str:
        return _raw(self.public).hex()

    def sign(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """``doc`` with its ``"signature"`` member set."""
        sig = self._private.sign(canonical(doc))
        return {
            **doc,
            SIGNATURE: {"key_id": self.key_id, "ed25519": base64.b64encode(sig).decode()},
        }

    def sign_json(self, body: bytes) -> bytes:
        """Sign a JSON document given as bytes; returns the signed document's bytes."""
        return json.dumps(self.sign(json.loads(body)), indent=1).encode()


def generate_key(path: str | Path) -> Signer:
    """Write a new private key to ``path`` (mode 0600, refusing to overwrite)."""
    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes_raw().hex()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(seed + "\n")
    return Signer(private)


class Verifier:
    """The public keys a reader trusts (several during a rotation)."""

    def __init__(self, public_keys: Iterable[str]) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for text in public_keys:
            public = Ed25519PublicKey.from_public_bytes(_hex32(text, "a trusted public key"))
            self._keys[key_id(public)] = public
        if not self._keys:
            raise ValueError("no trusted public key given")

    def verify(self, raw: bytes, what: str) -> None:
        """Refuse ``raw`` (a JSON document) unless a trusted key signed exactly its content."""
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptDeltaError(f"{what} is not JSON ({e})") from None
        sig = doc.get(SIGNATURE) if isinstance(doc, dict) else None
        if sig is None:
            raise UnsignedVersionError(
                f"{what} is not signed, and this reader trusts only signed versions"
            )
        if not isinstance(sig, dict) or not isinstance(sig.get("key_id"), str):
            raise BadSignatureError(f"{what}: malformed signature")
        public = self._keys.get(sig["key_id"])
        if public is None:
            raise BadSignatureError(
                f"{what} is signed by key {sig['key_id'][:16]!r}, which this reader does not trust"
            )
        try:
            public.verify(base64.b64decode(str(sig.get("ed25519")), validate=True), canonical(doc))
        except (InvalidSignature, ValueError):
            raise BadSignatureError(
                f"{what}: the signature does not match its content (altered after signing?)"
            ) from None

    @staticmethod
    def require_hashes(objects: Iterable[ObjectRef], what: str) -> None:
        """Refuse a signed manifest unless SHA-256 binds every object (and every part)."""
        bare = [o.key for o in objects if not o.hashed]
        if bare:
            raise UnhashedObjectError(
                f"{what} is signed but records no SHA-256 for {len(bare)} object(s), e.g. "
                f"{bare[0]}: the signature would not bind their bytes (xxh3 is not "
                "cryptographic); publish with a trainer that writes ObjectRef.sha256"
            )

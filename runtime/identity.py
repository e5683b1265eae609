"""Members bound to their identity: a per-member credential the coordinator hands out at registration.

Why: the bearer token (``security.py``) only says "this caller belongs to the cluster"; it does not
say *which* member is calling. Without more, any peer that can reach a shard may push for worker
``w`` before ``w`` does (the real push then counts as a duplicate), report steps for ``w`` or take
``w``'s data shards. So every member proves who it is on every call.

Design:

* The coordinator draws a random **job key** when it starts: an Ed25519 private key. Registering as
  ``role`` ``id`` returns a credential ``role:id:incarnation:signature``, the job key's signature of
  ``"role:id:incarnation"``. The incarnation counts registrations of that slot: a member that restarts
  and registers again gets a new credential, and the old process's calls are refused by the
  coordinator from then on.
* Members send it as the call metadata ``x-pstrain-member`` on every call of their channels
  (``IdentityAttach``, a client interceptor installed by ``open_channel``), so the PS client and
  the trainer are unchanged; ``MemberProcess.join`` adopts the credential from the registration reply.
* The coordinator checks each worker/PS call against its issued incarnations (``MemberRegistry``).
* A PS shard receives the job's **public** key at its own registration and verifies workers' pushes
  by checking the signature (``MemberVerifier``; each credential once, then from a cache): no table
  to keep in step with the coordinator's, no call to the coordinator per push. A shard can check
  credentials but not make them: before 2026-11-27 the shards held the one HMAC key that also
  minted them, so whoever registered as a shard (anyone with the bearer token, while that shard id
  was free) could act as any worker. What a shard cannot see is the incarnation being current; a
  superseded process would have to still be alive *and* push for a step its replacement has not
  pushed, and the coordinator has failed or re-planned the job by then.
* Without TLS the credential travels in clear, like the token: the token or mTLS keeps outsiders
  off the port; the credential keeps one member (or an outsider on an open port) from acting as
  another. The job key and credentials never reach a log (``repr`` hides them).

A call that lacks the credential, carries a wrong one, or one of another member is refused with
``PermissionDenied`` (PERMISSION_DENIED) before anything changes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

HEADER = "x-pstrain-member"
_CREDENTIAL = re.compile(r"([a-z]+):(0|[1-9][0-9]{0,9}):(0|[1-9][0-9]{0,9}):([0-9a-f]{128})", re.ASCII)
KEY_BYTES = 32  # an Ed25519 private key (its seed) and public key alike
VERIFIED_KEPT = 4096
"""Credentials a verifier remembers as checked: a job has a few per member (one per registration), so the
signature check runs once per credential; past this many (made-up ones that verified? none can) it starts over."""


class IdentityError(Exception):
    """Base of identity failures."""


class PermissionDenied(IdentityError):
    """The call does not carry the credential of the member it acts for (PERMISSION_DENIED)."""


class NotIssued(IdentityError):
    """No credential was ever issued for that member by this coordinator (NOT_FOUND: register first)."""


@dataclass(frozen=True)
class Credential:
    role: str
    member_id: int
    incarnation: int
    signature: str  # hex: the job key's Ed25519 signature of ``subject``

    @property
    def subject(self) -> str:
        return f"{self.role}:{self.member_id}:{self.incarnation}"

    @property
    def name(self) -> str:
        return f"{self.role} {self.member_id}"

    def encode(self) -> str:
        return f"{self.subject}:{self.signature}"

    @classmethod
    def parse(cls, text: str) -> Credential:
        """PermissionDenied unless ``text`` is exactly what ``encode`` writes: ASCII digits (``str.isdigit`` takes
        "²", which ``int`` refuses) and a lower-case hex signature of its length, so one credential has one
        spelling (a verifier remembers checked ones by their text)."""
        match = _CREDENTIAL.fullmatch(text)
        if match is None:
            raise PermissionDenied(f"malformed {HEADER} credential")
        role, member_id, incarnation, signature = match.groups()
        return cls(role, int(member_id), int(incarnation), signature)

    def __repr__(self) -> str:  # a bearer credential: whoever holds it acts as the member, so it stays out of logs
        return f"Credential({self.subject})"


def presented(metadata: Iterable[tuple[str, str | bytes]] | None) -> Credential:
    """The credential in a call's metadata; PermissionDenied when there is none."""
    for key, value in metadata or ():
        if key == HEADER:
            return Credential.parse(value.decode() if isinstance(value, bytes) else value)
    raise PermissionDenied(f"no {HEADER} credential: register with the coordinator first")


class MemberVerifier:
    """Verifies credentials with the job's public key (a PS shard's; the coordinator's ``MemberKeys`` is one)."""

    def __init__(self, public_key: bytes) -> None:
        if len(public_key) != KEY_BYTES:
            raise ValueError(f"a job's public key has {KEY_BYTES} bytes, got {len(public_key)}")
        self._public = Ed25519PublicKey.from_public_bytes(public_key)
        self._verified: set[str] = set()  # encoded credentials whose signature checked out

    @property
    def public_key(self) -> bytes:
        return self._public.public_bytes(Encoding.Raw, PublicFormat.Raw)

    def verify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Credential:
        """The caller's credential, checked against the key; PermissionDenied if forged or absent."""
        credential = presented(metadata)
        encoded = credential.encode()
        if encoded in self._verified:
            return credential
        try:
            self._public.verify(bytes.fromhex(credential.signature), credential.subject.encode())
        except (InvalidSignature, ValueError):
            raise PermissionDenied(f"the credential for {credential.name} was not issued by this job") from None
        if len(self._verified) >= VERIFIED_KEPT:
            self._verified.clear()
        self._verified.add(encoded)
        return credential

    def require(self, metadata: Iterable[tuple[str, str | bytes]] | None, role: str, member_id: int) -> Credential:
        """Verify and check that the caller *is* ``role`` ``member_id``."""
        credential = self.verify(metadata)
        if (credential.role, credential.member_id) != (role, member_id):
            raise PermissionDenied(f"the caller is {credential.name}; it may not act for {role} {member_id}")
        return credential

    def __repr__(self) -> str:
        return f"{type(self).__name__}(<hidden>)"


class MemberKeys(MemberVerifier):
    """The coordinator's side: mints credentials with the job key and verifies them like a shard does."""

    def __init__(self, job_key: bytes) -> None:
        if len(job_key) != KEY_BYTES:
            raise ValueError(f"a job key has {KEY_BYTES} bytes, got {len(job_key)}")
        self._private = Ed25519PrivateKey.from_private_bytes(job_key)
        super().__init__(self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    @classmethod
    def generate(cls) -> MemberKeys:
        key = Ed25519PrivateKey.generate()
        return cls(key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    @property
    def job_key(self) -> bytes:
        """The private key, kept in the coordinator's ``job.key``; it never leaves the coordinator."""
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    def mint(self, role: str, member_id: int, incarnation: int = 0) -> Credential:
        subject = f"{role}:{member_id}:{incarnation}"
        return Credential(role, member_id, incarnation, self._private.sign(subject.encode()).hex())


class MemberRegistry:
    """The coordinator's side: issues a fresh credential per registration and accepts only the newest."""

    def __init__(self, keys: MemberKeys | None = None) -> None:
        self.keys = keys or MemberKeys.generate()
        self._incarnations: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def issue(self, role: str, member_id: int) -> Credential:
        with self._lock:
            incarnation = self._incarnations.get((role, member_id), -1) + 1
            self._incarnations[(role, member_id)] = incarnation
        return self.keys.mint(role, member_id, incarnation)

    def require(self, metadata: Iterable[tuple[str, str | bytes]] | None, role: str, member_id: int) -> Credential:
        """The caller is the newest registration of ``role`` ``member_id``; else NotIssued/PermissionDenied."""
        with self._lock:
            current = self._incarnations.get((role, member_id))
        if current is None:
            raise NotIssued(f"{role} {member_id} is not registered")
        credential = self.keys.require(metadata, role, member_id)
        if credential.incarnation != current:
            raise PermissionDenied(f"{role} {member_id} registered again since; this process was replaced")
        return credential

    def require_any(self, metadata: Iterable[tuple[str, str | bytes]] | None, role: str) -> Credential:
        """The caller is some current member of ``role``."""
        credential = self.keys.verify(metadata)
        if credential.role != role:
            raise PermissionDenied(f"the caller is {credential.name}; only a {role} may make this call")
        return self.require(metadata, role, credential.member_id)


class IdentityHolder:
    """The credential this process presents on its channels; empty until registration."""

    def __init__(self) -> None:
        self._header: tuple[str, str] | None = None

    def adopt(self, credential: str | Credential) -> None:
        text = credential.encode() if isinstance(credential, Credential) else credential
        if text:
            self._header = (HEADER, text)

    def headers(self) -> list[tuple[str, str]]:
        header = self._header
        return [header] if header is not None else []

    def __repr__(self) -> str:
        return f"IdentityHolder({'set' if self._header else 'unset'})"

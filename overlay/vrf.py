"""ECVRF-EDWARDS25519-SHA512-TAI (RFC 9381, suite_string 0x03) on libsodium.

The overlay elects zone initiators by the minimum verifiable random score
``sigma_p = VRF_p(seed(e - 1))`` (SemanticDFL Sec. 3.3.1); this module is that VRF. It follows
RFC 9381 Section 5 step by step: try-and-increment hash-to-curve (5.4.1.1), nonce generation
per RFC 8032 (5.4.2.2), a five-point challenge ``(Y, H, Gamma, U, V)`` truncated to
``cLen = 16`` octets (5.4.3), proofs ``Gamma || c || s`` of 32 + 16 + 32 = 80 octets, and
``beta = SHA-512(0x03 || 0x03 || point_to_string(8 * Gamma) || 0x00)`` (5.2).

Group operations are libsodium's, through PyNaCl. Two places need more care than calling it:

* **Which strings are points.** RFC 9381 Section 5.5 defines ``string_to_point`` as RFC 8032
  Section 5.1.3 decoding: the string is a point iff ``y < p``, ``x^2 = (y^2 - 1)/(d*y^2 + 1)``
  has a root, and the root is not ``x = 0`` with the sign bit set. Every such point counts,
  including points of small order and points with a torsion component; the try-and-increment
  loop must accept exactly these candidates and then multiply by the cofactor.
  libsodium has no predicate for exactly that set: ``crypto_core_ed25519_is_valid_point``
  also rejects small-order points and every point outside the prime-order subgroup (7 of 8
  decodable hash candidates), while its decoder (used by ``crypto_core_ed25519_add``) takes
  ``y >= p`` and the ``x = 0``, sign-bit-set encodings RFC 8032 rejects. So
  :func:`_canonical` checks those two conditions on Python integers (a comparison, no field
  arithmetic), and libsodium's decoder does the square-root test, which is RFC 8032's step 3
  operation for operation: the first doubling of ``8 * P`` fails exactly when there is no
  root. A pure-Python Euler-criterion oracle in the tests checks that the combination accepts
  precisely the RFC's strings. (Doing the square-root test in Python instead costs a 255-bit
  modular exponentiation, ~90-150 us, which was 40% of ``verify``.)
* **Multiplying points that are not in the prime-order subgroup.** libsodium's scalar
  multiplication refuses such points, yet RFC 9381 verification must multiply a public key
  ``Y`` or a ``Gamma`` that carries a torsion component (``validate_key`` rejects only keys
  with ``8*Y`` the identity). :func:`_split` writes such a point as ``P = P_L + T``:
  ``P_L = (8^-1 mod q) * (8*P)`` lies in the prime-order subgroup and ``T = P - P_L`` has
  order dividing 8, so ``c*P = c*P_L + (c mod 8)*T``: libsodium's multiplication for the
  first term, at most seven point additions for the second. Honest keys and proofs take the
  fast path (one ``is_valid_point`` check), so this costs nothing in the normal case and
  keeps verification exactly the RFC's for crafted inputs.

Secret-scalar arithmetic (``x mod q``, ``k``, ``s = k + c*x``) uses libsodium's scalar
functions and its constant-time multiplications; the public parts (challenge, decoding, the
checks in ``verify``) use Python integers.

The secret key is the 32-octet RFC 8032 seed; the public key is the Ed25519 public key of
that seed (RFC 9381 Section 5.5), the same 32 octets ``nacl.signing`` would produce.
"""

from __future__ import annotations

import hashlib

from nacl import bindings as sodium
from nacl.exceptions import RuntimeError as NaclRuntimeError

__all__ = [
    "BETA_LEN",
    "PROOF_LEN",
    "PUBLIC_KEY_LEN",
    "SECRET_KEY_LEN",
    "SUITE_STRING",
    "proof_to_hash",
    "prove",
    "public_key",
    "verify",
]

SUITE_STRING = b"\x03"  # ECVRF-EDWARDS25519-SHA512-TAI
SECRET_KEY_LEN = 32
PUBLIC_KEY_LEN = 32
_PT_LEN = 32  # ptLen: an encoded point
_C_LEN = 16  # cLen: the challenge
_Q_LEN = 32  # qLen: a scalar
PROOF_LEN = _PT_LEN + _C_LEN + _Q_LEN
BETA_LEN = 64

_P = 2**255 - 19  # the field prime
_Q = 2**252 + 27742317777372353535851937790883648493  # q: the prime subgroup's order
_COFACTOR = 8
_IDENTITY = b"\x01" + bytes(31)  # point_to_string of the neutral element (0, 1)
_ZERO_SCALAR = bytes(32)
_INV_COFACTOR = pow(_COFACTOR, -1, _Q).to_bytes(32, "little")
_Y_MASK = (1 << 255) - 1

# Domain separators (RFC 9381 Sections 5.2, 5.4.1.1, 5.4.3).
_ENCODE_TO_CURVE_FRONT = b"\x01"
_CHALLENGE_FRONT = b"\x02"
_PROOF_TO_HASH_FRONT = b"\x03"
_BACK = b"\x00"


# -- points -----------------------------------------------------------------------------------


def _canonical(encoding: bytes) -> bool:
    """The parts of RFC 8032 decoding that libsodium's point decoder does not enforce.

    RFC 8032 Section 5.1.3 rejects ``y >= p`` and the sign bit on ``x = 0`` (``y = 1`` or
    ``y = p - 1``); libsodium decodes both without complaint. Its square-root step is exactly
    RFC 8032's step 3, so with these two checks in front libsodium accepts the RFC's points.
    """
    if len(encoding) != _PT_LEN:
        return False
    value = int.from_bytes(encoding, "little")
    y, sign = value & _Y_MASK, value >> 255
    return y < _P and not (sign and y in (1, _P - 1))


def _add(a: bytes, b: bytes) -> bytes:
    # libsodium's add/sub work on any curve point (no subgroup check), torsion included.
    return sodium.crypto_core_ed25519_add(a, b)


def _sub(a: bytes, b: bytes) -> bytes:
    return sodium.crypto_core_ed25519_sub(a, b)


def _decode_times_cofactor(encoding: bytes) -> bytes | None:
    """``8 * string_to_point(encoding)``, or None where string_to_point is INVALID.

    The first doubling decodes the string: libsodium's addition fails exactly when the
    decoder finds no square root for ``x`` (RFC 8032 Section 5.1.3, step 3).
    """
    if not _canonical(encoding):
        return None
    try:
        doubled = _add(encoding, encoding)
    except NaclRuntimeError:
        return None
    doubled = _add(doubled, doubled)
    return _add(doubled, doubled)


def _mul_prime_order(scalar: bytes, point: bytes) -> bytes:
    """``scalar * point`` for ``point`` in the prime-order subgroup and ``scalar < q``.

    libsodium refuses a zero scalar and the identity (it reports an identity result as an
    error), so those cases, whose product is the identity, are answered here.
    """
    if scalar == _ZERO_SCALAR or point == _IDENTITY:
        return _IDENTITY
    return sodium.crypto_scalarmult_ed25519_noclamp(scalar, point)


def _mul_base(scalar: bytes) -> bytes:
    """``scalar * B`` for ``scalar < q``."""
    if scalar == _ZERO_SCALAR:
        return _IDENTITY
    return sodium.crypto_scalarmult_ed25519_base_noclamp(scalar)


def _split(point: bytes, times_cofactor: bytes) -> tuple[bytes, bytes]:
    """``(P_L, T)`` with ``point = P_L + T``, ``P_L`` of order 1 or q and ``T`` of order | 8.

    ``point`` is a valid encoding and ``times_cofactor`` is ``8 * point``.
    """
    if sodium.crypto_core_ed25519_is_valid_point(point):
        return point, _IDENTITY  # the common case: already in the prime-order subgroup
    prime_part = _mul_prime_order(_INV_COFACTOR, times_cofactor)
    return prime_part, _sub(point, prime_part)


def _mul_split(scalar: int, parts: tuple[bytes, bytes]) -> bytes:
    """``scalar * P`` for ``P`` given as :func:`_split` parts; ``0 <= scalar < q``."""
    prime_part, torsion = parts
    product = _mul_prime_order(scalar.to_bytes(32, "little"), prime_part)
    if torsion == _IDENTITY:
        return product
    for _ in range(scalar % _COFACTOR):  # T has order dividing 8
        product = _add(product, torsion)
    return product


def _validate_key(encoding: bytes) -> tuple[bytes, bytes] | None:
    """ECVRF_validate_key (5.4.5) as :func:`_split` parts of Y; None for INVALID."""
    if not _canonical(encoding):
        return None
    if sodium.crypto_core_ed25519_is_valid_point(encoding):
        return encoding, _IDENTITY  # fast path: in the subgroup, not the identity
    times_cofactor = _decode_times_cofactor(encoding)
    if times_cofactor is None or times_cofactor == _IDENTITY:  # not a point; small order
        return None
    return _split(encoding, times_cofactor)


# -- RFC 9381 Section 5.4 auxiliary functions --------------------------------------------------


def _encode_to_curve(salt: bytes, alpha: bytes) -> bytes:
    """ECVRF_encode_to_curve_try_and_increment (5.4.1.1), salt = PK_string.

    Raises ``ValueError`` when no counter 0..255 gives a point (probability about 2^-256;
    ``ctr`` must fit ``int_to_string(ctr, 1)``).
    """
    for ctr in range(256):
        digest = hashlib.sha512(
            SUITE_STRING + _ENCODE_TO_CURVE_FRONT + salt + alpha + bytes((ctr,)) + _BACK
        ).digest()
        # interpret_hash_value_as_a_point(s) = string_to_point(s[0]...s[31]), then 8 * H.
        point = _decode_times_cofactor(digest[:_PT_LEN])
        if point is not None and point != _IDENTITY:
            return point
    raise ValueError("ECVRF encode_to_curve found no point for counters 0..255")


def _expand_secret(secret_key: bytes) -> tuple[bytes, bytes, bytes]:
    """``(x mod q, Y, SHA-512(SK))`` for the RFC 8032 seed ``secret_key`` (5.1.5)."""
    if not isinstance(secret_key, bytes) or len(secret_key) != SECRET_KEY_LEN:
        raise ValueError(f"an ECVRF secret key is {SECRET_KEY_LEN} bytes (an RFC 8032 seed)")
    hashed = hashlib.sha512(secret_key).digest()
    clamped = bytearray(hashed[:32])
    clamped[0] &= 0xF8
    clamped[31] &= 0x7F
    clamped[31] |= 0x40
    x = sodium.crypto_core_ed25519_scalar_reduce(bytes(clamped) + bytes(32))
    pk, _ = sodium.crypto_sign_seed_keypair(secret_key)
    return x, pk, hashed


def _nonce_string(hashed_secret: bytes, h: bytes) -> bytes:
    """ECVRF_nonce_generation_RFC8032 (5.4.2.2) before ``mod q``: k_string."""
    return hashlib.sha512(hashed_secret[32:] + h).digest()


def _challenge(y: bytes, h: bytes, gamma: bytes, u: bytes, v: bytes) -> bytes:
    """ECVRF_challenge_generation (5.4.3): the first cLen octets of the hash."""
    digest = hashlib.sha512(SUITE_STRING + _CHALLENGE_FRONT + y + h + gamma + u + v + _BACK)
    return digest.digest()[:_C_LEN]


def _decode_proof(pi: bytes) -> tuple[bytes, bytes, int, int] | None:
    """ECVRF_decode_proof (5.4.4): ``(Gamma, 8 * Gamma, c, s)`` or None for INVALID."""
    if not isinstance(pi, bytes) or len(pi) != PROOF_LEN:
        return None
    gamma = pi[:_PT_LEN]
    gamma_times_cofactor = _decode_times_cofactor(gamma)
    if gamma_times_cofactor is None:
        return None
    c = int.from_bytes(pi[_PT_LEN : _PT_LEN + _C_LEN], "little")
    s = int.from_bytes(pi[_PT_LEN + _C_LEN :], "little")
    if s >= _Q:
        return None
    return gamma, gamma_times_cofactor, c, s


def _beta(gamma_times_cofactor: bytes) -> bytes:
    """proof_to_hash's beta_string (5.2, steps 4-6) from ``cofactor * Gamma``."""
    return hashlib.sha512(
        SUITE_STRING + _PROOF_TO_HASH_FRONT + gamma_times_cofactor + _BACK
    ).digest()


# -- the VRF ----------------------------------------------------------------------------------


def public_key(secret_key: bytes) -> bytes:
    """The 32-byte public key (PK_string) of a 32-byte RFC 8032 secret key (seed)."""
    return _expand_secret(secret_key)[1]


def prove(secret_key: bytes, alpha: bytes) -> bytes:
    """ECVRF_prove (RFC 9381 Section 5.1): the 80-byte proof pi for input ``alpha``.

    Deterministic: the same key and input always give the same proof. Raises ``ValueError``
    for a secret key that is not 32 bytes.
    """
    x, pk, hashed = _expand_secret(secret_key)
    h = _encode_to_curve(pk, alpha)
    gamma = _mul_prime_order(x, h)
    k = sodium.crypto_core_ed25519_scalar_reduce(_nonce_string(hashed, h))
    c = _challenge(pk, h, gamma, _mul_base(k), _mul_prime_order(k, h))
    s = sodium.crypto_core_ed25519_scalar_add(
        k, sodium.crypto_core_ed25519_scalar_mul(c + bytes(_Q_LEN - _C_LEN), x)
    )
    return gamma + c + s


def proof_to_hash(pi: bytes) -> bytes:
    """ECVRF_proof_to_hash (RFC 9381 Section 5.2): the 64-byte output beta of a proof.

    This does not verify the proof; use :func:`verify` for a proof from someone else.
    Raises ``ValueError`` when ``pi`` does not decode (wrong length, Gamma not a point,
    s >= q).
    """
    decoded = _decode_proof(pi)
    if decoded is None:
        raise ValueError(
            f"malformed ECVRF proof: expected {PROOF_LEN} bytes Gamma || c || s with Gamma "
            "a point encoding and s < q"
        )
    return _beta(decoded[1])


def verify(public_key: bytes, pi: bytes, alpha: bytes) -> bytes | None:
    """ECVRF_verify (RFC 9381 Section 5.3, with validate_key): beta, or None if invalid.

    None for a public key that is not a point encoding or whose cofactor multiple is the
    identity (Section 5.4.5), a proof that does not decode, and a proof that does not match
    the key and ``alpha``.
    """
    if not isinstance(public_key, bytes):
        return None
    y_parts = _validate_key(public_key)
    if y_parts is None:
        return None
    decoded = _decode_proof(pi)
    if decoded is None:
        return None
    gamma, gamma_times_cofactor, c, s = decoded
    try:
        h = _encode_to_curve(public_key, alpha)
    except ValueError:
        return None
    s_bytes = s.to_bytes(32, "little")
    u = _sub(_mul_base(s_bytes), _mul_split(c, y_parts))
    v = _sub(_mul_prime_order(s_bytes, h), _mul_split(c, _split(gamma, gamma_times_cofactor)))
    if _challenge(public_key, h, gamma, u, v) != pi[_PT_LEN : _PT_LEN + _C_LEN]:
        return None
    return _beta(gamma_times_cofactor)

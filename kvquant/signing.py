"""Signed reports: ``results.json`` carries an HMAC-SHA256 of its content under this user's private key (the key
that signs partial results too, :func:`result_key`), so ``python -m kvquant.export`` deploys only what
this user's own run decided, never a file edited by hand or written by another user or on another machine.

The signature covers the document as JSON reads it back (keys sorted, no spaces), not the file's bytes, so it
does not depend on how the file was indented; it is the document's last key, ``"signature"``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile

from kvquant.errors import KVQuantError
from kvquant.fs import cache_dir, read_file

SIGNATURE = "signature"
#: what a results.json signature signs besides the document, so that no other signature under the same key (a
#: partial result's) is ever a valid one for a report
DOMAIN = b"kvquant results.json v1\0"


#: what the signature of a long-context document file (``experiments/long_divergence.py``'s ``documents/doc-N.json``)
#: signs besides the file, so that neither a report's nor a partial result's signature is ever a valid one for it
DOCUMENT_DOMAIN = b"kvquant long-context document v1\0"


def result_key(make: bool = True) -> bytes | None:
    """This user's secret for signing partial results (``partial-results.key`` in kvquant's private cache, made
    once: written to a temporary file and linked into place, so racing runs agree on one); not ``make``: None where
    there is none yet (nothing is written)."""
    path = cache_dir("keys") / "partial-results.key"
    if not make and not os.path.lexists(path):
        return None
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        info = os.lstat(path)
        key = read_file(path)
    except OSError as err:
        raise KVQuantError(f"cannot read {path} ({err.strerror or err}); remove it to make a new one") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise KVQuantError(f"{path} is not a key only you can read (mode {stat.S_IMODE(info.st_mode):o}, uid "
                           f"{info.st_uid}): whoever reads it can sign results as you; remove it to make a new one")
    if len(key) != 64:
        raise KVQuantError(f"{path} is not a key kvquant wrote; remove it to make a new one")
    return key


def _signature(doc: dict, key: bytes, domain: bytes = DOMAIN) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hmac.new(key, domain + text.encode("ascii"), hashlib.sha256).hexdigest()


def json_form(doc: dict) -> dict:
    """``doc`` as ``results.json`` records it and a reader parses it back: JSON's types (lists for tuples, string
    keys), values JSON cannot hold written as floats."""
    return json.loads(json.dumps(doc, default=float))


def signed_json(doc: dict, domain: bytes = DOMAIN, indent: int | None = 2) -> str:
    """``results.json``'s text (``domain``: :data:`DOCUMENT_DOMAIN` for a long-context document file's): ``doc`` as
    JSON (values JSON cannot hold written as floats) with its signature under this user's key as its last key."""
    plain = json_form(doc)
    if SIGNATURE in plain:
        raise ValueError(f"a report document has no key {SIGNATURE!r} of its own")
    return json.dumps({**plain, SIGNATURE: _signature(plain, result_key(), domain)}, indent=indent)


def why_unverified(doc: dict, domain: bytes = DOMAIN) -> str | None:
    """Why ``doc`` (a parsed ``results.json``, or a file signed under ``domain``) is not one this user's kvquant
    signed, else None."""
    signature = doc.get(SIGNATURE)
    if signature is None:
        return "it carries no signature (written by hand, or by a kvquant older than signed files)"
    body = {k: v for k, v in doc.items() if k != SIGNATURE}
    if not (isinstance(signature, str) and signature.isascii()) or not hmac.compare_digest(
            signature, _signature(body, result_key(), domain)):
        return "its signature does not verify (edited after the run, or written by another user or machine)"
    return None

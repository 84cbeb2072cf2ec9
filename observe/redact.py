"""Credentials never leave the process: every URL the project writes or prints is redacted here.

config.py, corpus/text.py, the tracker and the launch's messages all call `redact_url`; this
module imports nothing of the project, so any of them can.
"""
from __future__ import annotations

import re
import urllib.parse

REDACTED = "***"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# Query parameters that carry credentials: tokens, API keys, signed-URL signatures (S3's
# X-Amz-Signature / X-Amz-Credential, Azure SAS `sig`), passwords, session ids.
_SECRET_PARAM = re.compile(r"token|key|sig|pass|pwd|secret|auth|credential|session", re.IGNORECASE)


def _redact_one(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, host = netloc.rsplit("@", 1)
        # user:password -> user:***; a lone user part may itself be a token (https://TOKEN@host)
        netloc = f"{user.split(':', 1)[0]}:{REDACTED}@{host}" if ":" in user else f"{REDACTED}@{host}"
    query = "&".join(
        f"{k}={REDACTED}" if _SECRET_PARAM.search(k) and v else (f"{k}={v}" if sep else k)
        for k, sep, v in (item.partition("=") for item in parts.query.split("&"))) if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by ***: the password of
    user:password@ (or a lone user part, often a token), and the values of query parameters whose
    names speak of a token, key, signature, password, secret, auth, credential or session.
    Everything the project writes or prints about the config or the corpus source goes through
    this one function (Config.to_dict, corpus/text.py's source line, warnings and errors); the real
    URL stays in the live config, and only the download uses it."""
    return _URL.sub(lambda m: _redact_one(m.group(0)), text)


def has_redacted_credentials(url: str) -> bool:
    """A URL whose credentials are the *** of a redacted copy (e.g. a run's config.yaml)."""
    probe = url.replace(REDACTED, "x")
    return REDACTED in url and redact_url(url) == url and redact_url(probe) != probe


def redact_strings(value):
    """`value` (nested dicts and lists, e.g. Config.to_dict) with every string's URLs redacted."""
    if isinstance(value, dict):
        return {k: redact_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_strings(v) for v in value]
    return redact_url(value) if isinstance(value, str) else value

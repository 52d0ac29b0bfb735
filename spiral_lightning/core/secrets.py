"""Secrets out of every message and every saved file.

A uri is copied into specs, logs, errors and states, so each message shows it ``masked``: a
password, the value of every query field but the version ids the library's own uris carry, and a
fragment become ``***``. ``masking(uri)`` does the same to an error raised below it (and to the
errors it was raised from), whatever wrote the message. ``is_secret_key`` tells, from its name,
whether an option or config entry holds a secret, and ``masked_config`` copies a configuration
with every such value masked, for the config a command line saves.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

#: What a secret is shown as.
MASK = "***"

#: Query fields of the library's own uris that pin a version (``spiral:<root>?resource_id=..&
#: version_id=..``, ``sds:<root>?dataset=..&snapshot=..&digest=..``): ids, never secrets, so shown.
PUBLIC_QUERY_KEYS = frozenset({"resource_id", "version_id", "dataset", "snapshot", "digest"})

#: ``//user:password@``: the user has no ``/``, and the password runs to the last ``@`` before
#: the query (a secret key may hold ``/``, which hides it from ``urllib.parse``).
_USERINFO = re.compile(r"//(?P<user>[^/?#@:]*):(?P<password>[^?#]*)@")

#: Words of a key name that make its value a secret (``aws_secret_access_key``, ``sas_token``,
#: ``X-Amz-Security-Token``, ``clientSecret``, ``db_password``).
_SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "token",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "creds",
        "sas",
        "sig",
        "signature",
        "apikey",
        "authorization",
        "cookie",
    }
)
#: ``<word>_key`` is a secret after these words (``account_key``, ``private_key``, ``api_key``);
#: an access key id is not (AWS's model: the id names the key, the secret proves it).
_KEY_OWNERS = frozenset({"account", "private", "api", "master", "shared", "signing", "encryption", "storage"})
#: A name ending in one of these says what a secret is about, not the secret (``client_id``,
#: ``google_token_expiration``, ``credentials_file``, ``pad_token_id``).
_NOT_SECRET_ENDS = frozenset(
    {"id", "ids", "expiration", "expiry", "expires", "uri", "url", "endpoint", "type", "kind", "path", "file", "dir"}
)
#: ``<word>_token`` of a tokenizer (``pad_token``, ``eos_token``) is a vocabulary entry.
_VOCABULARY = frozenset({"pad", "bos", "eos", "sep", "cls", "unk", "mask", "special", "start", "end", "max", "num"})


def masked(uri: str) -> str:
    """``uri`` as a message shows it: a password (``//user:***@``), the value of every query field
    but the version ids of ``PUBLIC_QUERY_KEYS`` (``?X-Amz-Security-Token=***``) and the fragment
    of a url (``#***``; in a local path ``#`` is a character of a name) masked; the scheme, host,
    path and query field names stay, so it still says which table it is."""
    rest, hashmark, fragment = uri.partition("#") if "://" in uri else (uri, "", "")
    rest, question, query = rest.partition("?")
    rest = _USERINFO.sub(lambda found: f"//{found['user']}:{MASK}@", rest, count=1)
    if question:
        rest += "?" + "&".join(_masked_field(field) for field in query.split("&"))
    if hashmark:
        rest += "#" + (MASK if fragment else "")
    return rest


def _masked_field(field: str) -> str:
    name, equals, value = field.partition("=")
    if not equals:
        return MASK if name else ""
    return field if name in PUBLIC_QUERY_KEYS or not value else f"{name}={MASK}"


def has_password(uri: str) -> bool:
    """Whether ``uri`` carries ``//user:password@``, even one ``urllib.parse`` misses."""
    return _USERINFO.search(uri.partition("?")[0].partition("#")[0]) is not None


def secret_parts(uri: str) -> list[str]:
    """The pieces of ``uri`` that ``masked`` hides: its password, query values and fragment."""
    rest, _, fragment = uri.partition("#") if "://" in uri else (uri, "", "")
    rest, _, query = rest.partition("?")
    parts = [found["password"] for found in _USERINFO.finditer(rest)][:1]
    for field in query.split("&") if query else []:
        name, equals, value = field.partition("=")
        if not equals:
            parts.append(name)
        elif name not in PUBLIC_QUERY_KEYS:
            parts.append(value)
    parts.append(fragment)
    return [part for part in parts if part]


def scrub_uri(text: str, uri: str) -> str:
    """``text`` with ``uri`` shown ``masked`` and every secret part of it replaced by ``***``
    (parts shorter than four characters only where the whole uri appears: a short value is no
    credential, and replacing it everywhere would garble the message)."""
    shown = masked(uri)
    if shown == uri:
        return text
    text = text.replace(uri, shown).replace(repr(uri)[1:-1], repr(shown)[1:-1])
    for part in sorted(secret_parts(uri), key=len, reverse=True):
        if len(part) >= 4:
            text = text.replace(part, MASK)
    return text


def scrub_error(error: BaseException, uri: str) -> None:
    """Scrub ``uri``'s secrets (``scrub_uri``) from the message of ``error``, its notes and the
    errors it was raised from or during, in place, so a traceback shows none of them."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.args = tuple(scrub_uri(arg, uri) if isinstance(arg, str) else arg for arg in current.args)
        if isinstance(current, OSError):
            for name in ("strerror", "filename", "filename2"):
                value = getattr(current, name, None)
                if isinstance(value, str):
                    setattr(current, name, scrub_uri(value, uri))
        notes = getattr(current, "__notes__", None)
        if isinstance(notes, list):
            notes[:] = [scrub_uri(note, uri) if isinstance(note, str) else note for note in notes]
        pending.extend(found for found in (current.__cause__, current.__context__) if found is not None)


@contextmanager
def masking(uri: str) -> Iterator[None]:
    """Run the block; an error it raises leaves with ``uri``'s secrets scrubbed (``scrub_error``)."""
    try:
        yield
    except Exception as error:
        if masked(uri) != uri:
            scrub_error(error, uri)
        raise


def _words(name: str) -> list[str]:
    """The words of a key name: ``aws_secret_access_key``, ``clientSecret``, ``X-Amz-Security-Token``."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word]


def is_secret_key(name: str) -> bool:
    """Whether an option or config entry called ``name`` holds a secret: its name has a word such
    as secret, token, password, credential, sas or signature, or ends in account / private / api
    ``_key`` (``aws_secret_access_key``, ``azure_storage_sas_token``, ``account_key``), but not an id,
    expiry, endpoint or file of one (``aws_access_key_id``, ``google_token_expiration``), nor a
    tokenizer's ``pad_token`` or ``max_tokens``."""
    words = _words(name)
    if not words or words[-1] in _NOT_SECRET_ENDS:
        return False
    for index, word in enumerate(words):
        before = words[index - 1] if index else ""
        if word == "token" and before in _VOCABULARY:
            continue
        if word in _SECRET_WORDS:
            return True
        if word == "key" and before in _KEY_OWNERS:
            return True
    return False


def _looks_like_uri(text: str) -> bool:
    return " " not in text and re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", text) is not None


def masked_config(config: Any, secret: bool = False) -> Any:
    """A copy of ``config`` (mappings, lists, tuples and ``argparse`` / jsonargparse namespaces,
    nested) with the text of every entry ``is_secret_key`` names, and everything under one,
    replaced by ``***``, and every uri ``masked``. Numbers and flags stay: a secret is text."""
    if isinstance(config, argparse.Namespace):
        copied = copy.copy(config)
        for name, value in vars(config).items():
            vars(copied)[name] = masked_config(value, secret or is_secret_key(name))
        return copied
    if isinstance(config, Mapping):
        return {
            name: masked_config(value, secret or (isinstance(name, str) and is_secret_key(name)))
            for name, value in config.items()
        }
    if isinstance(config, list | tuple):
        items = [masked_config(value, secret) for value in config]
        return type(config)(*items) if hasattr(config, "_fields") else type(config)(items)
    if isinstance(config, str):
        if secret and config:
            return MASK
        return masked(config) if _looks_like_uri(config) else config
    return config

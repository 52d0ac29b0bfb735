"""Where a file-backed table's bytes live: the filesystem a uri names, opened with storage options.

A table uri names a local path (``/data/t``, ``file:///data/t``) or an object in a store
(``s3://bucket/prefix``, ``gs://bucket/prefix``, ``abfs://container@account.dfs.core.windows.net/prefix``).
Credentials and endpoints come from ``storage_options`` (keys in the style of pandas, Polars and
delta-rs) and, for every key not given, from the store's standard environment and configuration
files. Credentials never live in the uri: a uri is copied into specs, logs, errors and states.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from spiral_lightning.core.secrets import has_password, masked

__all__ = ["ALIASES", "KEYS", "SECRET_KEYS", "StorageOptions", "masked", "parse", "scrub"]

#: Option keys whose values are secrets: masked in every ``repr`` and scrubbed from error messages.
SECRET_KEYS = frozenset(
    {
        "aws_secret_access_key",
        "aws_session_token",
        "google_access_token",
        "azure_storage_account_key",
        "azure_storage_sas_token",
        "azure_storage_client_secret",
    }
)

#: Other names accepted for each key, as pandas, Polars, object_store and delta-rs spell them.
ALIASES = {
    "access_key_id": "aws_access_key_id",
    "secret_access_key": "aws_secret_access_key",
    "session_token": "aws_session_token",
    "token": "aws_session_token",
    "region": "aws_region",
    "aws_default_region": "aws_region",
    "endpoint_url": "aws_endpoint",
    "endpoint": "aws_endpoint",
    "aws_endpoint_url": "aws_endpoint",
    "aws_allow_http": "allow_http",
    "google_endpoint_url": "google_endpoint",
    "account_name": "azure_storage_account_name",
    "azure_account_name": "azure_storage_account_name",
    "account_key": "azure_storage_account_key",
    "azure_account_key": "azure_storage_account_key",
    "sas_token": "azure_storage_sas_token",
    "azure_sas_token": "azure_storage_sas_token",
    "client_id": "azure_storage_client_id",
    "azure_client_id": "azure_storage_client_id",
    "client_secret": "azure_storage_client_secret",
    "azure_client_secret": "azure_storage_client_secret",
    "tenant_id": "azure_storage_tenant_id",
    "azure_tenant_id": "azure_storage_tenant_id",
    "azure_storage_endpoint": "azure_endpoint",
}

#: The keys each kind of store reads, after aliases; ``connect_timeout`` and ``timeout`` are
#: seconds, ``allow_http`` a bool (or "true"/"false"), ``retry_seconds`` how long a read of a pinned
#: version retries a store that fails (``sources/retry.py``).
KEYS = {
    "s3": frozenset(
        {
            "aws_access_key_id",
            "aws_secret_access_key",
            "aws_session_token",
            "aws_region",
            "aws_endpoint",
            "allow_http",
            "connect_timeout",
            "timeout",
            "retry_seconds",
        }
    ),
    "gcs": frozenset(
        {
            "google_access_token",
            "google_token_expiration",
            "google_endpoint",
            "google_project_id",
            "google_anonymous",
            "allow_http",
            "retry_seconds",
        }
    ),
    "azure": frozenset(
        {
            "azure_storage_account_name",
            "azure_storage_account_key",
            "azure_storage_sas_token",
            "azure_storage_client_id",
            "azure_storage_client_secret",
            "azure_storage_tenant_id",
            "azure_endpoint",
            "allow_http",
            "retry_seconds",
        }
    ),
    "local": frozenset[str](),
}

_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "abfs": "azure", "abfss": "azure", "az": "azure"}


class StorageOptions(Mapping[str, str]):
    """How to reach a table's store: option keys (aliases folded into their canonical names) and
    their values, as strings. Its ``repr`` masks every secret, so a spec printed, logged or put in
    an error never shows one. It pickles whole, since worker processes need the secrets too."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        values: dict[str, str] = {}
        for key, value in (options or {}).items():
            if not isinstance(key, str):
                raise TypeError(f"storage option names are strings, not {key!r}")
            name = ALIASES.get(key.lower(), key.lower())
            if name in values:
                raise ValueError(f"storage option {name!r} is given twice (as {key!r} and under another name)")
            if value is None:
                continue
            if not isinstance(value, str | bool | int | float):
                raise TypeError(f"storage option {key!r} must be a string, number or bool, not {type(value).__name__}")
            values[name] = str(value).lower() if isinstance(value, bool) else str(value)
        known = frozenset().union(*KEYS.values())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown storage options {unknown}; known: {sorted(known)} (and the aliases {sorted(ALIASES)})"
            )
        self._values = values

    def __getitem__(self, key: str) -> str:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._values.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._values) == dict(other)

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={'***' if key in SECRET_KEYS else value!r}" for key, value in self._values.items())
        return f"StorageOptions({shown})"

    def __reduce__(self) -> tuple[type[StorageOptions], tuple[dict[str, str]]]:
        return StorageOptions, (dict(self._values),)

    def secrets(self) -> list[str]:
        """The secret values, to scrub from text that may echo them."""
        return [value for key, value in self._values.items() if key in SECRET_KEYS and value]


def parse(target: str) -> tuple[str, str, str | None]:
    """The kind of store ``target`` names, the path inside it and an Azure account named in it;
    ``ValueError`` for a uri that carries credentials or a query, or an unknown scheme."""
    if "://" not in target or target.startswith("file://"):
        return "local", os.path.abspath(urlsplit(target).path if target.startswith("file://") else target), None
    parts = urlsplit(target)
    kind = _SCHEMES.get(parts.scheme)
    if kind is None:
        raise ValueError(
            f"unsupported storage scheme {parts.scheme!r} in {masked(target)!r}; "
            f"files are read from local paths, file://, {', '.join(sorted(s + '://' for s in _SCHEMES))}"
        )
    if parts.password is not None or has_password(target) or (parts.username is not None and kind != "azure"):
        raise ValueError(
            f"{masked(target)!r} carries credentials; a uri is copied into specs, logs and checkpoints, so give "
            "them as storage_options (aws_access_key_id, aws_secret_access_key, ...) or in the environment"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            f"{masked(target)!r} has a query or fragment; give store settings and credentials as storage_options "
            "(for example {'aws_endpoint': ..., 'aws_region': ...}), never in the uri"
        )
    if kind == "azure" and parts.username is not None:
        account = (parts.hostname or "").split(".", 1)[0] or None
        return kind, f"{parts.username}{parts.path}".rstrip("/"), account
    return kind, f"{parts.netloc}{parts.path}".rstrip("/"), None


def scrub(text: str, options: StorageOptions | None) -> str:
    """``text`` with every secret of ``options`` replaced by ``***``."""
    for secret in options.secrets() if options else []:
        text = text.replace(secret, "***")
    return text

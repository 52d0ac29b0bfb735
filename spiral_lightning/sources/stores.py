"""Where a file-backed table's bytes live: one pyarrow filesystem per store and storage options
per process."""

from __future__ import annotations

import datetime
import functools
import os
from typing import NamedTuple
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from spiral_lightning.core.storage import KEYS, StorageOptions, masked, parse

#: What a store says when it refuses the credentials or what they may do, in the words of S3
#: (and compatible servers), GCS and Azure, lowercased: an unknown key id, a wrong secret, an
#: expired token, a denied bucket.
_DENIED = (
    "access_denied",
    "accessdenied",
    "access denied",
    "invalid_access_key",
    "invalidaccesskey",
    "signature_does_not_match",
    "signaturedoesnotmatch",
    "signature",
    "expired_token",
    "expiredtoken",
    "invalid_token",
    "invalidtoken",
    "forbidden",
    "unauthorized",
    "unauthenticated",
    "permission denied",
    "permission_denied",
    "authenticationfailed",
    "authorizationfailure",
    "authorizationpermissionmismatch",
    "http status 401",
    "http status 403",
    "status code 401",
    "status code 403",
)

#: The options and environment that hold each kind of store's credentials, for the fix a refusal names.
CREDENTIALS = {
    "s3": "storage options aws_access_key_id / aws_secret_access_key (/ aws_session_token), or "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY",
    "gcs": "storage option google_access_token, or GOOGLE_APPLICATION_CREDENTIALS",
    "azure": "storage options azure_storage_account_key, azure_storage_sas_token or azure_storage_client_secret, "
    "or AZURE_STORAGE_ACCOUNT_KEY",
    "local": "the file permissions",
}


def denied(text: str) -> bool:
    """Whether a store's error ``text`` says it refused the credentials (unknown key id, wrong
    secret, expired token) or what they may do (403): a ``PermissionError`` that no retry mends."""
    lowered = text.lower()
    return any(mark in lowered for mark in _DENIED)


def credentials_of(target: str) -> str:
    """Where the credentials of the store ``target`` names come from, for an error's fix."""
    try:
        kind = parse(target)[0]
    except ValueError:
        kind = "s3"
    return CREDENTIALS[kind]


class Location(NamedTuple):
    """A uri resolved to its store: ``kind`` (``local``, ``s3``, ``gcs`` or ``azure``), the path
    inside the filesystem, and the filesystem (one per process for each store and options)."""

    kind: str
    path: str
    filesystem: pafs.FileSystem

    @property
    def remote(self) -> bool:
        return self.kind != "local"


def locate(target: str, options: StorageOptions | None = None) -> Location:
    """The store and path of ``target`` (a path or an object-store uri), reached with ``options``
    and, for what they leave out, the environment."""
    options = options or StorageOptions()
    kind, path, account = parse(target)
    unknown = sorted(set(options) - KEYS[kind])
    if unknown:
        raise ValueError(
            f"storage options {unknown} do not apply to {masked(target)!r} ({kind}); "
            f"it reads {sorted(KEYS[kind]) or 'none'}"
        )
    if kind == "local":
        return Location(kind, path, _local())
    return Location(kind, path, _filesystem(kind, options, account, _environment(kind)))


@functools.cache
def _local() -> pafs.LocalFileSystem:
    return pafs.LocalFileSystem()


#: The prefixes of the environment variables each kind of store reads what its options leave out from.
_ENVIRONMENT = {"s3": ("AWS_",), "gcs": ("GOOGLE_", "GCS_"), "azure": ("AZURE_",)}


def _environment(kind: str) -> tuple[tuple[str, str], ...]:
    """The environment variables a ``kind`` store may read, so that a filesystem made before
    they changed is not reused after."""
    prefixes = _ENVIRONMENT.get(kind, ())
    return tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith(prefixes)))


@functools.lru_cache(maxsize=64)
def _filesystem(
    kind: str, options: StorageOptions, account: str | None, environment: tuple[tuple[str, str], ...]
) -> pafs.FileSystem:
    """The filesystem of a store, built once per process for each set of options and of the
    ``environment`` it reads."""
    if kind == "s3":
        return _s3(options)
    if kind == "gcs":
        return _gcs(options)
    return _azure(options, account)


def _flag(options: StorageOptions, key: str) -> bool:
    value = options.get(key, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise ValueError(f"storage option {key!r} is a bool (true or false), not {value!r}")
    return value in ("true", "1")


def _seconds(options: StorageOptions, key: str) -> float | None:
    """Option ``key`` in seconds; ``None`` leaves the store client's own default (about 10 s
    before a store that accepts a connection but never answers is given up, retries included)."""
    value = options.get(key)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"storage option {key!r} is a positive number of seconds, not {value!r}")
    return seconds


def _endpoint(options: StorageOptions, key: str, environment: tuple[str, ...]) -> tuple[str | None, str | None]:
    """The host[:port] and scheme of an endpoint from ``options`` or else the environment."""
    endpoint = options.get(key) or next((os.environ[name] for name in environment if os.environ.get(name)), None)
    if endpoint is None:
        return None, "http" if _flag(options, "allow_http") else None
    parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
    if parts.scheme == "http" and not _flag(options, "allow_http") and key in options:
        raise ValueError(
            f"the endpoint {endpoint!r} is plain http; set storage option allow_http=true to read it unencrypted"
        )
    return parts.netloc, parts.scheme


def _s3(options: StorageOptions) -> pafs.S3FileSystem:
    host, scheme = _endpoint(options, "aws_endpoint", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    region = options.get("aws_region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region is None and host is not None:
        # An S3-compatible server has no regions to discover, and the lookup would fail.
        region = "us-east-1"
    return pafs.S3FileSystem(
        access_key=options.get("aws_access_key_id"),
        secret_key=options.get("aws_secret_access_key"),
        session_token=options.get("aws_session_token"),
        region=region,
        endpoint_override=host,
        scheme=scheme,
        connect_timeout=_seconds(options, "connect_timeout"),
        request_timeout=_seconds(options, "timeout"),
    )


def _gcs(options: StorageOptions) -> pafs.GcsFileSystem:
    host, scheme = _endpoint(options, "google_endpoint", ("STORAGE_EMULATOR_HOST",))
    token = options.get("google_access_token")
    expiration = options.get("google_token_expiration")
    if (token is None) != (expiration is None):
        raise ValueError("storage options google_access_token and google_token_expiration (ISO time) go together")
    return pafs.GcsFileSystem(
        anonymous=_flag(options, "google_anonymous"),
        access_token=token,
        credential_token_expiration=datetime.datetime.fromisoformat(expiration) if expiration else None,
        endpoint_override=host,
        scheme=scheme,
        project_id=options.get("google_project_id"),
    )


def _azure(options: StorageOptions, account: str | None) -> pafs.AzureFileSystem:
    name = options.get("azure_storage_account_name") or account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if name is None:
        raise ValueError(
            "an Azure uri names its storage account in abfs://<container>@<account>.dfs.core.windows.net/..., "
            "or in storage option azure_storage_account_name"
        )
    host, scheme = _endpoint(options, "azure_endpoint", ())
    key = options.get("azure_storage_account_key") or (
        None if options.get("azure_storage_sas_token") else os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    )
    return pafs.AzureFileSystem(
        name,
        account_key=key,
        sas_token=options.get("azure_storage_sas_token"),
        client_id=options.get("azure_storage_client_id"),
        client_secret=options.get("azure_storage_client_secret"),
        tenant_id=options.get("azure_storage_tenant_id"),
        blob_storage_authority=host,
        blob_storage_scheme=scheme,
        dfs_storage_authority=host,
        dfs_storage_scheme=scheme,
    )

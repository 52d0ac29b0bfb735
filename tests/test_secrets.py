"""Secrets stay out of what the library says and saves: a secret in a uri's query, fragment or
password is masked in every refusal (and in the errors chained below it); storage options given
on the command line are masked in the config LightningCLI saves and in what Ray Train records;
and a store that refuses the credentials raises ``PermissionError`` naming the table and the fix,
against a real S3 server."""

from __future__ import annotations

import json
import pickle
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonargparse import Namespace

from spiral_lightning import TableDataset, TableSpec, write_table
from spiral_lightning.core.secrets import is_secret_key, masked, masked_config, masking
from spiral_lightning.demos.data import demo_data
from spiral_lightning.lightning.cli import main
from spiral_lightning.sources.stores import denied
from tests.objectstore import S3Server
from tests.test_objectstore import bucket, options, uneven

TOKEN = "FQoGZXIvYXdzEJr-session-token-0123456789"


def shown(error: BaseException) -> str:
    """Everything a traceback of ``error`` shows: its message and the errors chained below it."""
    return "".join(traceback.format_exception(error))


@pytest.mark.parametrize(
    "uri",
    [
        f"parquet:s3://bkt/t?X-Amz-Security-Token={TOKEN}",
        f"parquet:s3://bkt/t?X-Amz-Security-Token={TOKEN}#also",
        f"parquet:s3://bkt/t#{TOKEN}",
        f"parquet:abfs://container@account.dfs.core.windows.net/t?sv=2022-11-02&sig={TOKEN}",
        f"s3://bkt/t?X-Amz-Security-Token={TOKEN}",  # no scheme: refused by the backend registry
        f"sds:s3://bkt/root?X-Amz-Security-Token={TOKEN}",
        f"spiral:/tmp/no-table?token={TOKEN}",
        f"parquet:s3://AKIAEXAMPLE:{TOKEN}/with/slashes@bkt/t",  # a secret with '/' hides from urllib
        f"spiral://AKIAEXAMPLE:{TOKEN}@project/table",
    ],
)
def test_every_refusal_of_a_uri_masks_its_secret(uri: str) -> None:
    with pytest.raises(ValueError) as refused:
        TableSpec(uri).resolve()
    assert TOKEN not in shown(refused.value)
    assert "***" in str(refused.value)


def test_a_query_refusal_still_names_the_table_and_the_fields() -> None:
    with pytest.raises(ValueError, match=r"'s3://bkt/t\?X-Amz-Security-Token=\*\*\*' has a query") as refused:
        TableSpec(f"parquet:s3://bkt/t?X-Amz-Security-Token={TOKEN}")
    assert "storage_options" in str(refused.value)
    with pytest.raises(ValueError, match=r"'spiral:/t\?resource_id=a&version_id=b&x=\*\*\*' has unknown query fields"):
        TableSpec(f"spiral:/t?resource_id=a&version_id=b&x={TOKEN}").resolve()


@pytest.mark.parametrize(
    "uri",
    [
        f"spiral:/data/t?resource_id=r1&version_id=v2&token={TOKEN}",
        f"sds:/data/root?dataset=d&X-Amz-Security-Token={TOKEN}",
        f"spiral://project/table#{TOKEN}",
    ],
)
def test_a_specs_repr_masks_the_secrets_of_its_uri_and_shows_the_rest(uri: str) -> None:
    # Such a spec is refused only when resolved; it is printed and logged before that.
    spec = TableSpec(uri, columns=["id"])
    shown = repr(spec)
    assert TOKEN not in shown and TOKEN not in str([spec]), shown
    assert shown.startswith(f"TableSpec(uri={masked(uri)!r}, columns=('id',), filter=None, ") and "***" in shown
    assert repr(TableSpec("spiral:/data/t?resource_id=r1&version_id=v2")).startswith(
        "TableSpec(uri='spiral:/data/t?resource_id=r1&version_id=v2', "
    )


def test_masked_keeps_what_names_a_table_and_hides_the_rest() -> None:
    assert masked("parquet:s3://bkt/prefix/t") == "parquet:s3://bkt/prefix/t"
    assert masked("spiral:/data/t?resource_id=r1&version_id=v2") == "spiral:/data/t?resource_id=r1&version_id=v2"
    assert masked("sds:/r?dataset=d&snapshot=s&digest=h") == "sds:/r?dataset=d&snapshot=s&digest=h"
    assert masked("spiral://project/path@v3") == "spiral://project/path@v3"
    assert masked("abfs://c@acct.dfs.core.windows.net/p") == "abfs://c@acct.dfs.core.windows.net/p"
    assert masked("parquet:/data/run#3/t") == "parquet:/data/run#3/t"  # a local name, not a url's fragment
    assert masked(f"s3://k:{TOKEN}@b/t?a=1&flag#frag") == "s3://k:***@b/t?a=***&***#***"
    assert masked(f"s3://k:{TOKEN}/x@b/t") == "s3://k:***@b/t"


def test_masking_scrubs_the_errors_chained_below_and_their_notes() -> None:
    uri = f"sds:/r?token={TOKEN}"
    with pytest.raises(KeyError) as raised, masking(uri):
        try:
            raise OSError(2, f"cannot open {uri}", uri)
        except OSError as inner:
            error = KeyError(f"while reading {uri!r}")
            error.add_note(f"the token was {TOKEN}")
            raise error from inner
    assert TOKEN not in shown(raised.value)
    assert "sds:/r?token=***" in shown(raised.value)


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("aws_secret_access_key", True),
        ("aws_session_token", True),
        ("X-Amz-Security-Token", True),
        ("azure_storage_sas_token", True),
        ("azure_storage_account_key", True),
        ("account_key", True),
        ("clientSecret", True),
        ("google_access_token", True),
        ("db_password", True),
        ("credentials", True),
        ("api_key", True),
        ("aws_access_key_id", False),  # AWS's model: the id names the key, the secret proves it
        ("azure_storage_client_id", False),
        ("google_token_expiration", False),
        ("aws_endpoint", False),
        ("pad_token", False),
        ("max_tokens", False),
        ("key", False),
        ("batch_size", False),
    ],
)
def test_which_names_hold_secrets(name: str, secret: bool) -> None:
    assert is_secret_key(name) is secret


def test_a_config_is_copied_with_its_secrets_masked() -> None:
    config = Namespace(
        data=Namespace(
            class_path="spiral_lightning.SpiralDataModule",
            init_args=Namespace(
                train={"uri": "parquet:s3://b/t", "storage_options": {"aws_secret_access_key": TOKEN}},
                storage_options={"aws_access_key_id": "AKIA", "aws_session_token": TOKEN, "allow_http": True},
                batch_size=64,
            ),
        ),
        credentials={"nested": [TOKEN]},
        tokens=["a", "b"],
    )
    copied = masked_config(config)
    assert TOKEN not in str(copied)
    assert copied.data.init_args.storage_options == {
        "aws_access_key_id": "AKIA",
        "aws_session_token": "***",
        "allow_http": True,
    }
    assert copied.data.init_args.train["storage_options"] == {"aws_secret_access_key": "***"}
    assert copied.credentials == {"nested": ["***"]}
    assert copied.tokens == ["a", "b"] and copied.data.init_args.batch_size == 64
    # The original is untouched: the run reads the real keys.
    assert config.data.init_args.storage_options["aws_session_token"] == TOKEN


def test_the_ray_command_hands_its_workers_the_yaml_and_shows_it_masked() -> None:
    from ray_adapter.cli import Sealed

    settings = Namespace(data=Namespace(init_args=Namespace(storage_options={"aws_secret_access_key": TOKEN})))
    sealed = Sealed(f"data: {{init_args: {{storage_options: {{aws_secret_access_key: {TOKEN}}}}}}}", settings)
    assert TOKEN not in str(sealed) and TOKEN not in repr(sealed) and "***" in str(sealed)
    # What the workers get, pickled, is the whole YAML.
    assert TOKEN in pickle.loads(pickle.dumps(sealed)).text


def test_a_wrong_key_id_or_secret_raises_permission_error_naming_the_table_and_the_fix(s3_server: S3Server) -> None:
    uri = uneven(s3_server)
    pinned = TableSpec(uri, storage_options=options(s3_server)).resolve()
    wrongs = {
        "key id": options(s3_server, aws_access_key_id="AKIANOSUCHKEY000"),
        "secret": options(s3_server, aws_secret_access_key="not-the-secret"),
    }
    for wrong, store in wrongs.items():
        with pytest.raises(PermissionError) as refused:
            TableSpec(uri, storage_options=store).resolve()
        message = str(refused.value)
        assert f"the object store refused listing the files for {uri!r}" in message, (wrong, message)
        assert "check the credentials (storage options aws_access_key_id / aws_secret_access_key" in message
        assert "not-the-secret" not in shown(refused.value)
        # A pinned version read with the wrong keys: refused at the pass's check, the same way.
        with pytest.raises(PermissionError, match="check the credentials"):
            sum(1 for _ in TableDataset(TableSpec(uri, files=pinned.files, storage_options=store), batch_size=500))
    with pytest.raises(PermissionError, match="check the credentials"):
        write_table(f"{uri}-new", demo_data(10), storage_options=wrongs["key id"])


def test_denied_knows_each_stores_words() -> None:
    for text in [
        "AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation",
        "AWS Error SIGNATURE_DOES_NOT_MATCH during HeadObject",
        "AWS Error ACCESS_DENIED during GetObject",
        "AWS Error UNKNOWN (HTTP status 403) during HeadObject operation",
        "AWS Error EXPIRED_TOKEN during GetObject",
        "GCS error: Permission denied on bucket",
        "Azure Error: AuthenticationFailed",
    ]:
        assert denied(text), text
    assert not denied("AWS Error NETWORK_CONNECTION during GetObject")
    assert not denied("AWS Error NO_SUCH_KEY during GetObject")


@pytest.mark.slow
def test_storage_options_given_on_the_command_line_are_masked_in_the_saved_config(
    s3_server: S3Server, tmp_path: Path
) -> None:
    name = bucket(s3_server)
    write_table(f"parquet:s3://{name}/demo", demo_data(400), split_rows=200, storage_options=options(s3_server))
    # A new endpoint spelling keeps this process's filesystems, made with other keys, out of it.
    store = options(s3_server, s3_server.endpoint.replace("127.0.0.1", "localhost"))
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(
        textwrap.dedent(
            f"""
            trainer:
              accelerator: cpu
              max_steps: 2
              logger: false
              enable_progress_bar: false
              enable_model_summary: false
              default_root_dir: {tmp_path}
              callbacks:
                - class_path: lightning.pytorch.callbacks.ModelCheckpoint
                  init_args: {{dirpath: {tmp_path / "checkpoints"}, save_last: true}}
            model:
              class_path: spiral_lightning.demos.tabular.DemoModel
            data:
              class_path: spiral_lightning.SpiralDataModule
              init_args:
                train: parquet:s3://{name}/demo
                batch_size: 100
            """
        )
    )
    main(["fit", "--config", str(experiment), "--data.storage_options", json.dumps(store)])
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    saved = tmp_path / "config.yaml"
    text = saved.read_text()
    assert "aws_secret_access_key: '***'" in text, text
    assert f"aws_access_key_id: {s3_server.access_key}" in text  # an id is no secret
    written: list[Any] = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert [path for path in written if s3_server.secret_key.encode() in path.read_bytes()] == []


def test_print_config_shows_storage_options_given_on_the_command_line_masked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = {"aws_secret_access_key": "s3cr3t", "aws_access_key_id": "AKIDEXAMPLE"}
    arguments = [
        "fit",
        "--model",
        "spiral_lightning.demos.tabular.DemoModel",
        "--data",
        "spiral_lightning.SpiralDataModule",
    ]
    arguments += ["--data.train", "parquet:s3://bkt/t", "--data.storage_options", json.dumps(store), "--print_config"]
    with pytest.raises(SystemExit) as exited:
        main(arguments)
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert "s3cr3t" not in printed
    assert "aws_secret_access_key: '***'" in printed and "aws_access_key_id: AKIDEXAMPLE" in printed, printed
    assert "train: parquet:s3://bkt/t" in printed

"""Where the S3 keys come from, and the one-line errors when they cannot be found."""

from __future__ import annotations

from pathlib import Path

import pytest

from hubd.s3.credentials import CredentialsError, find_credentials


def files(tmp_path: Path, credentials: str | None = None,
          config: str | None = None) -> dict[str, str]:
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
           "AWS_CONFIG_FILE": str(tmp_path / "config")}
    if credentials is not None:
        (tmp_path / "credentials").write_text(credentials)
    if config is not None:
        (tmp_path / "config").write_text(config)
    return env


def test_environment_first(tmp_path: Path) -> None:
    env = files(tmp_path, "[default]\naws_access_key_id = FILE\naws_secret_access_key = s\n")
    env |= {"AWS_ACCESS_KEY_ID": "ENV", "AWS_SECRET_ACCESS_KEY": "x", "AWS_SESSION_TOKEN": "t"}
    creds = find_credentials(env)
    assert (creds.access_key_id, creds.secret_access_key, creds.session_token) == \
        ("ENV", "x", "t")
    assert creds.source == "environment"


@pytest.mark.parametrize(("env", "missing"), [
    ({"AWS_ACCESS_KEY_ID": "A"}, "AWS_SECRET_ACCESS_KEY"),
    ({"AWS_SECRET_ACCESS_KEY": "s"}, "AWS_ACCESS_KEY_ID"),
])
def test_half_a_pair_in_the_environment(tmp_path: Path, env: dict[str, str],
                                        missing: str) -> None:
    with pytest.raises(CredentialsError, match=f"^{missing} is not set"):
        find_credentials(files(tmp_path) | env)


def test_default_profile_of_the_shared_file(tmp_path: Path) -> None:
    env = files(tmp_path, "[other]\naws_access_key_id = O\naws_secret_access_key = o\n"
                          "[default]\naws_access_key_id = D\naws_secret_access_key = d\n"
                          "aws_session_token = tok\n")
    creds = find_credentials(env)
    assert (creds.access_key_id, creds.session_token) == ("D", "tok")
    assert "credentials" in creds.source


def test_aws_profile(tmp_path: Path) -> None:
    env = files(tmp_path, "[other]\naws_access_key_id = O\naws_secret_access_key = o\n")
    assert find_credentials(env | {"AWS_PROFILE": "other"}).access_key_id == "O"


def test_profile_in_the_config_file(tmp_path: Path) -> None:
    env = files(tmp_path, config="[profile team]\nregion = eu-west-1\n"
                                 "aws_access_key_id = C\naws_secret_access_key = c\n")
    assert find_credentials(env | {"AWS_PROFILE": "team"}).access_key_id == "C"


def test_unknown_profile(tmp_path: Path) -> None:
    env = files(tmp_path, "[default]\naws_access_key_id = D\naws_secret_access_key = d\n")
    with pytest.raises(CredentialsError, match="AWS_PROFILE=nope names no profile"):
        find_credentials(env | {"AWS_PROFILE": "nope"})


def test_nothing_anywhere(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match=r"^no S3 credentials: set AWS_ACCESS_KEY_ID"):
        find_credentials(files(tmp_path))


def test_profile_without_static_keys(tmp_path: Path) -> None:
    env = files(tmp_path, config="[profile sso]\nsso_start_url = https://x\n")
    with pytest.raises(CredentialsError, match="holds no static keys"):
        find_credentials(env | {"AWS_PROFILE": "sso"})


def test_half_a_pair_in_a_file(tmp_path: Path) -> None:
    env = files(tmp_path, "[default]\naws_access_key_id = D\n")
    with pytest.raises(CredentialsError, match="has no aws_secret_access_key"):
        find_credentials(env)


def test_malformed_file_is_one_line_without_secrets(tmp_path: Path) -> None:
    env = files(tmp_path, "aws_secret_access_key = SECRET\n[default\n")
    with pytest.raises(CredentialsError) as info:
        find_credentials(env)
    message = str(info.value)
    assert message.startswith("cannot parse") and "\n" not in message
    assert "SECRET" not in message


def test_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "credentials").mkdir()
    with pytest.raises(CredentialsError, match=r"cannot read .*credentials: Is a directory"):
        find_credentials(files(tmp_path))
